"""Request and response schemas of the OpenAI-compatible API (vLLM's extras included).

Requests validate strictly (a string where a number belongs is an error, not a guess),
ignore unknown fields, and reject OpenAI parameters Sid does not implement by name.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from sid.sampling_params import SamplingParams


class ParamError(ValueError):
    """A request value the engine refuses, with the request field it came from."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


_NEUTRAL: tuple[Any, ...] = (None, 1, "", [], {}, {"type": "text"})


def _only_neutral(value: Any, info: ValidationInfo) -> Any:
    if value not in _NEUTRAL:
        raise ValueError(f"{info.field_name}={value!r} is not supported by this server")
    return value


Unsupported = Annotated[Any, AfterValidator(_only_neutral)]
"""An OpenAI parameter Sid does not implement: accepted only at its neutral value."""


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingRequest(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    n: Unsupported = 1
    best_of: Unsupported = None
    logit_bias: Unsupported = None
    # Sid and vLLM extras.
    deterministic: bool | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    cache_salt: str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None
    ) -> SamplingParams:
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                deterministic=self.deterministic,
            )
        except ValueError as exc:
            match = re.match(r"invalid SamplingParams: (\w+)", str(exc))
            raise ParamError(str(exc), match.group(1) if match else None) from None

    def prompt_dict(self, prompt: str | list[int]) -> dict[str, Any]:
        """The engine's prompt form, carrying the cache salt."""
        key = "prompt" if isinstance(prompt, str) else "prompt_token_ids"
        return {key: prompt, "cache_salt": self.cache_salt}


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: Unsupported = None

    @model_validator(mode="after")
    def _scoring_needs_echo_and_logprobs(self) -> CompletionRequest:
        if self.max_tokens == 0 and not (self.echo and self.logprobs is not None):
            raise ValueError("max_tokens=0 needs echo=true and logprobs (it scores the prompt)")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One engine prompt per choice: a string, token ids, or a list of either."""
        p = self.prompt
        if isinstance(p, str) or not p or isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self) -> SamplingParams:
        prompt_logprobs = self.logprobs if self.echo else None
        return self._sampling_params(self.max_tokens, self.logprobs, prompt_logprobs)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self) -> dict[str, str]:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content or [])
        return {"role": self.role, "content": text} | ({"name": self.name} if self.name else {})


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: Unsupported = None
    functions: Unsupported = None
    response_format: Unsupported = None

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens == 0:
            raise ParamError("max_tokens must be at least 1 for chat completions", "max_tokens")
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None, None)


# ----------------------------------------------------------------------- responses


class _Response(BaseModel):
    created: int = Field(default_factory=lambda: int(time.time()))


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(_Response):
    """A whole completion, or one streamed chunk of it (OpenAI uses one shape for both)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    model: str
    system_fingerprint: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    model: str
    system_fingerprint: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    owned_by: str = "sid"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
