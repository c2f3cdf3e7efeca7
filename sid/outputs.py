"""Request outputs in vLLM's shape, so callers can switch engines unchanged."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    """Log-probability of one token at one position, and its rank (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


PositionLogprobs = dict[int, Logprob]
"""Token id -> Logprob at one position: the chosen token plus the top-N."""


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    deterministic: bool = False
    fingerprint: str | None = None
