"""Committed tokens into user-facing outputs (vLLM's output processing).

A token reaches the output only once it is committed (for a deterministic request in the
windowed lane, once verified). Committing it detokenizes incrementally, checks the stop
conditions (end of sequence, stop token ids, stop strings, ``max_tokens``, the model's
length limit) and records its logprobs; ``output`` builds the cumulative ``RequestOutput``.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from sid.engine.detokenizer import IncrementalDetokenizer
from sid.engine.request import Request, RequestStatus
from sid.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, max_model_len: int, fingerprint: str) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.fingerprint = fingerprint
        self._detok: dict[str, IncrementalDetokenizer] = {}

    def add(self, request: Request) -> None:
        if self.tokenizer is not None:
            p = request.params
            self._detok[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, p.skip_special_tokens, p.stop_strings,
                p.include_stop_str_in_output
            )

    def remove(self, request_id: str) -> None:
        self._detok.pop(request_id, None)

    def emit(self, request: Request, logprobs: PositionLogprobs | None) -> None:
        """Commit the next held token to the output, then check the stop conditions."""
        token = request.token_ids[request.num_committed_tokens]
        request.num_emitted += 1
        if logprobs is not None and request.logprobs is not None:
            request.logprobs.append(self.decorate(logprobs))
            request.cumulative_logprob += logprobs[token].logprob
        detok = self._detok.get(request.request_id)
        stop_str = detok.sync(request.output_token_ids) if detok is not None and detok.stop_strings else None
        if token in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        elif token in request.params.stop_token_ids:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif stop_str is not None:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        elif request.num_emitted >= request.max_tokens or request.num_committed_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
        if request.finished:
            del request.token_ids[request.num_committed_tokens :]

    def decorate(self, entry: PositionLogprobs) -> PositionLogprobs:
        if self.tokenizer is None:
            return entry
        return {t: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([t])) for t, lp in entry.items()}

    def output(self, request: Request) -> RequestOutput:
        detok = self._detok.get(request.request_id)
        if detok is not None:
            detok.sync(request.output_token_ids)
        finished = request.finished
        completion = CompletionOutput(
            index=0,
            text=detok.text if detok is not None else "",
            token_ids=request.output_token_ids,
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            logprobs=list(request.logprobs) if request.logprobs is not None else None,
            finish_reason=request.status.value if finished else None,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            deterministic=request.deterministic,
            fingerprint=self.fingerprint,
        )
