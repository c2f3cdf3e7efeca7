"""Per-request state, owned by the engine and advanced by the scheduler."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sid.outputs import PositionLogprobs
from sid.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        # Module-level names and identity: looking members up on the class costs several
        # times more, and the engine asks this of every request several times a step.
        return self is _STOPPED or self is _LENGTH or self is _ABORTED


_STOPPED, _LENGTH, _ABORTED = (
    RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED
)


@dataclass(eq=False)
class Request:
    """A prompt, how to continue it, and how far it got.

    ``token_ids`` holds the prompt followed by every generated token; the K/V of the first
    ``num_computed_tokens`` of them is in the cache. Whenever every token is computed
    except the last, the next step samples one more.

    A deterministic request also tracks ``n_canon``, the leading positions whose K/V is
    canonical (DESIGN 3.4). Its committed tokens are ``token_ids[: n_canon + 1]`` once the
    prompt is canonical; anything after them is a fast-lane proposal awaiting verification.
    ``num_emitted`` counts the output tokens committed and handed to the user.

    Counters run ahead of results: launching a pass advances ``num_computed_tokens`` (and
    ``n_canon``) and appends a negative placeholder for each token it will sample, which
    the pass's results replace (``sid.runtime.model_runner.placeholder``).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    max_tokens: int
    eos_token_ids: frozenset[int]
    arrival: int
    cache_salt: str | None = None
    deterministic: bool = False
    domain: str = "fast"
    token_ids: list[int] = field(init=False)
    stop_token_set: frozenset[int] = field(init=False)
    n_canon: int = 0
    num_emitted: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    epoch: int = 0
    """Bumped when work already launched for the request became void (a rollback, a
    preemption): results of passes launched under an older epoch are dropped."""
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.stop_token_set = self.eos_token_ids | frozenset(self.params.stop_token_ids or ())
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens handed to the user (proposals excluded)."""
        return self.token_ids[self.num_prompt_tokens : self.num_prompt_tokens + self.num_emitted]

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens held, proposals included."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_committed_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_emitted

    @property
    def num_proposals(self) -> int:
        return self.num_tokens - self.num_committed_tokens

    @property
    def num_unverified(self) -> int:
        """Held tokens past the one after the canonical prefix: proposals no canonical pass
        has been launched to verify yet (equal to ``num_proposals`` between steps)."""
        return self.num_tokens - self.n_canon - 1

    @property
    def last_token_in_flight(self) -> bool:
        """The pass sampling the last token the request may hold is launched and nothing
        waits for verification: when its result arrives the request finishes."""
        return (
            self.token_ids[-1] < 0
            and self.num_output_tokens >= self.max_tokens
            and (not self.deterministic or self.num_unverified == 0)
        )

    @property
    def needs_canonical_rows(self) -> bool:
        """Positions below the committed tail lack canonical K/V (prompt, or recompute)."""
        return self.deterministic and self.n_canon < self.num_committed_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Still owes logprobs for some prompt positions (computed rows must give logits)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def may_read_prefix_cache(self) -> bool:
        """Prompt logprobs need logits at every prompt position, so such requests compute all."""
        return self.prompt_logprobs is None

    def fill(self, index: int, token: int) -> None:
        """Put a sampled token where the launch of its pass left a placeholder."""
        if self.token_ids[index] >= 0:
            raise RuntimeError(f"{self.request_id}: position {index} holds a token, not a placeholder")
        self.token_ids[index] = token

    def cache_keys(self) -> tuple[str, ...]:
        """Extra keys of this request's block hashes: numerics domain and cache salt."""
        return (self.domain, self.cache_salt or "")
