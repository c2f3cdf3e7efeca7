"""Sampling parameters, with vLLM's names, validated on construction."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
"""Most top logprobs a request may ask for (the OpenAI API's limit, vLLM's default ``max_logprobs``)."""


class RequestOutputKind(enum.Enum):
    """What ``step()`` returns for a request: every step's cumulative output, or the last only."""

    CUMULATIVE = "cumulative"
    FINAL_ONLY = "final_only"


@dataclass
class SamplingParams:
    """How to pick each generated token and when to stop.

    Randomness is a pure function of (``seed``, position of the token being chosen), so a
    seeded request samples the same tokens whatever batch it runs in. Without a seed the
    engine draws one per request from its own ``seed``.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    deterministic: bool | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.stop_strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def fail(msg: str) -> None:
            raise ValueError(f"invalid SamplingParams: {msg}")

        if self.n != 1:
            fail(f"n={self.n}: only n=1 is implemented")
        if self.max_tokens is not None:
            if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
                fail(f"max_tokens must be an integer >= 0 (0 only with prompt_logprobs), got {self.max_tokens!r}")
            if self.max_tokens == 0 and self.prompt_logprobs is None:
                fail("max_tokens=0 is allowed only with prompt_logprobs (scoring a prompt)")
        if not self.temperature >= 0.0:
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail(f"top_k must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not self.repetition_penalty > 0.0:
            fail(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS):
                fail(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            fail(f"seed must be an integer in [0, 2**63), got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            fail("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids must be non-negative integers")
        if self.deterministic not in (None, True, False):
            fail(f"deterministic must be None, True or False, got {self.deterministic!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
