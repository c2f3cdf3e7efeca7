"""``LLM``: the offline Python API, shaped like vLLM's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from sid.config import EngineConfig
from sid.engine.engine import LLMEngine
from sid.engine.inputs import PromptType
from sid.engine.request import Request
from sid.model.builtin import default_model_path
from sid.outputs import RequestOutput
from sid.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Generate completions for batches of prompts with continuous batching.

    ``model`` is a local Hugging Face checkpoint directory; without one, Sid's small
    built-in default model is used.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.llm_engine = LLMEngine(EngineConfig(model=model or str(default_model_path()), **kwargs))
        self._counter = 0

    def get_tokenizer(self):  # noqa: ANN201 - a transformers tokenizer or None
        return self.llm_engine.tokenizer

    def stats(self) -> dict[str, Any]:
        """Engine counters: deterministic requests, verifications, rollbacks, recomputed
        tokens, canonical rows used vs padded, strategy choices, preemptions, cache hits."""
        return self.llm_engine.get_stats()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; False (nothing done) while requests are unfinished."""
        return self.llm_engine.reset_prefix_cache()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order.

        Every request is validated before any work starts: a bad one raises a
        ``ValueError`` naming its index, and nothing is queued.
        """
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"got {len(prompt_list)} prompts but {len(params_list)} sampling params")
        engine = self.llm_engine
        requests: list[Request] = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list)):
            try:
                if isinstance(params, SamplingParams):  # only the final output is read here
                    params = replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                requests.append(engine.make_request(f"gen-{self._counter + i}", prompt, params))
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        self._counter += len(requests)
        for request in requests:
            engine.enqueue(request)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(requests), desc="generate", disable=not use_tqdm) as bar:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        bar.update(1)
        return [finished[r.request_id] for r in requests]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """A single prompt (text, token ids or dict) or a list of them, as a list."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise ValueError(f"unsupported prompt type {type(prompts).__name__}: use a string, token ids or a dict")
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]
