"""The engine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sid.config import EngineConfig
from sid.engine.detokenizer import IncrementalDetokenizer
from sid.engine.kv_cache import KVCacheManager, cdiv
from sid.engine.request import Request, RequestStatus
from sid.engine.scheduler import ScheduledChunk, Scheduler
from sid.model.config import CheckpointError, ModelConfig
from sid.model.loader import build_model
from sid.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from sid.runtime.attention import PagedKVCache, get_backend
from sid.runtime.model_runner import ModelRunner
from sid.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(path: Path) -> PreTrainedTokenizerBase | None:
    """The checkpoint's tokenizer, or None when it ships none (token-id prompts only)."""
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # transformers raises many types for broken tokenizer files
        raise CheckpointError(f"cannot load the tokenizer in {str(path)!r}: {exc}") from None


def _eos_token_ids(path: Path, cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase | None) -> frozenset[int]:
    ids = set(cfg.eos_token_ids)
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(int(i) for i in ids)


class LLMEngine:
    """Owns the model, the KV cache and the scheduler; ``step()`` advances every request."""

    def __init__(self, config: EngineConfig) -> None:
        if config.model is None:
            raise ValueError("EngineConfig.model must name a checkpoint directory")
        self.config = config
        self.path = Path(config.model)
        self.model_config = ModelConfig.from_path(self.path)
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        self.tokenizer = load_tokenizer(self.path)
        self.eos_token_ids = _eos_token_ids(self.path, self.model_config, self.tokenizer)
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} positions")
        self.max_model_len = config.max_model_len or limit
        self.model = build_model(
            self.model_config,
            self.path,
            dtype=self.dtype,
            device=self.device,
            max_positions=self.max_model_len,
            load_format=config.load_format,
            seed=config.seed,
        )
        self.backend = get_backend(config.attention_backend, self.device)
        num_blocks = config.num_kv_blocks or self._auto_num_blocks()
        cfg = self.model_config
        self.kv_cache = PagedKVCache(
            self.backend,
            num_layers=cfg.num_layers,
            num_blocks=num_blocks,
            block_size=config.block_size,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens
        )
        self.runner = ModelRunner(self.model, self.kv_cache, config.block_size, self.device)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._seed_rng = random.Random(config.seed)
        self._arrivals = 0

    def _block_bytes(self) -> int:
        cfg = self.model_config
        return PagedKVCache.bytes_per_block(
            cfg.num_layers, self.config.block_size, cfg.num_kv_heads, cfg.head_dim, self.dtype
        )

    def _auto_num_blocks(self) -> int:
        """Pool size: what the memory budget allows after weights and peak activations."""
        per_block = self._block_bytes()
        if self.device.type != "cuda":
            wanted = cdiv(self.config.max_num_seqs * self.max_model_len, self.config.block_size)
            return max(1, min(wanted, self.config.cpu_kv_cache_bytes // per_block))
        peak = self._profile_peak_bytes()
        _, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * self.config.gpu_memory_utilization) - peak
        if budget < per_block:
            raise ValueError(
                f"no memory left for the KV cache: weights and activations take {peak / 2**30:.1f} GiB of "
                f"{total * self.config.gpu_memory_utilization / 2**30:.1f} GiB; raise gpu_memory_utilization"
            )
        return budget // per_block

    def _profile_peak_bytes(self) -> int:
        """Peak memory of the largest step the scheduler can plan, with a throwaway cache."""
        cfg, bs = self.model_config, self.config.block_size
        tokens = self.config.max_num_batched_tokens
        seq_len = min(tokens, self.max_model_len)
        num_seqs = cdiv(tokens, seq_len)
        profile_cache = PagedKVCache(
            self.backend,
            num_layers=cfg.num_layers,
            num_blocks=num_seqs * cdiv(seq_len, bs),
            block_size=bs,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        runner = ModelRunner(self.model, profile_cache, bs, self.device)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, logprobs=5)
        chunks, tables = [], []
        for s in range(num_seqs):
            n = min(seq_len, tokens - s * seq_len)
            r = self._new_request(f"profile-{s}", [0] * n, params, None)
            chunks.append(ScheduledChunk(r, 0, n))
            first = s * cdiv(seq_len, bs)
            tables.append(list(range(first, first + cdiv(n, bs))))
        runner.execute(chunks, tables)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - sum(
            t.numel() * t.element_size() for t in profile_cache.k + profile_cache.v
        )
        del profile_cache, runner
        torch.cuda.empty_cache()
        return peak

    # ----------------------------------------------------------------- requests

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int], str | None]:
        """(text, token ids, cache salt) of any accepted prompt form."""
        salt = None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids instead of text")
            return prompt, self.tokenizer(prompt).input_ids, salt
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, prompt, salt
        raise ValueError(f"unsupported prompt type {type(prompt).__name__}: use a string, token ids or a dict")

    def _new_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> Request:
        vocab = self.model_config.vocab_size
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        room = self.max_model_len - n
        if room < (1 if params.max_tokens != 0 else 0):
            raise ValueError(
                f"the prompt has {n} tokens, which leaves no room to generate within max_model_len={self.max_model_len}"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        blocks = cdiv(n + max_tokens, self.config.block_size)
        if blocks > self.kv.pool.num_blocks:
            raise ValueError(
                f"the request needs {blocks} KV blocks ({n} prompt + {max_tokens} new tokens) but the cache has "
                f"only {self.kv.pool.num_blocks}; lower max_tokens or enlarge the cache"
            )
        self._arrivals += 1
        return Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            seed=params.seed if params.seed is not None else self._seed_rng.getrandbits(63),
            max_tokens=max_tokens,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            arrival=self._arrivals,
        )

    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> Request:
        """Validate a request without enqueueing it; raises ``ValueError`` saying what is wrong."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids, salt = self._tokenize(prompt)
        request = self._new_request(request_id, ids, params, text)
        request.cache_salt = salt
        return request

    def enqueue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self.tokenizer is not None:
            p = request.params
            self._detok[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, p.skip_special_tokens, p.stop_strings, p.include_stop_str_in_output
            )
        self.scheduler.add(request)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        """Validate and queue a request; a bad one raises at once and nothing else changes."""
        self.enqueue(self.make_request(request_id, prompt, params))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                self._detok.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    # --------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the requests that progressed (cumulative outputs)."""
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        block_ids = [self.kv.block_ids(c.request) for c in plan.chunks]
        results = self.runner.execute(plan.chunks, block_ids)
        self.scheduler.commit(plan)
        outputs = []
        for chunk, result in zip(plan.chunks, results):
            request = chunk.request
            if request.prompt_logprobs is not None and result.prompt_logprobs:
                request.prompt_logprobs.extend(self._decorate(e) for e in result.prompt_logprobs)
            if result.token_id is not None:
                self._append_token(request, result.token_id, result.logprobs)
            elif chunk.samples and request.max_tokens == 0:
                request.status = RequestStatus.FINISHED_LENGTH
            else:
                continue
            if request.finished:
                self.scheduler.finish(request, request.status)
            outputs.append(self._output(request))
            if request.finished:
                self.requests.pop(request.request_id, None)
                self._detok.pop(request.request_id, None)
        return outputs

    def _append_token(self, request: Request, token: int, logprobs: PositionLogprobs | None) -> None:
        request.token_ids.append(token)
        if logprobs is not None and request.logprobs is not None:
            request.logprobs.append(self._decorate(logprobs))
            request.cumulative_logprob += logprobs[token].logprob
        detok = self._detok.get(request.request_id)
        stop_str = detok.update([token]) if detok is not None else None
        if token in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
        elif token in request.params.stop_token_ids:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif stop_str is not None:
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop_str
        elif request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH

    def _decorate(self, entry: PositionLogprobs) -> PositionLogprobs:
        if self.tokenizer is None:
            return entry
        return {t: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([t])) for t, lp in entry.items()}

    def _output(self, request: Request) -> RequestOutput:
        detok = self._detok.get(request.request_id)
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
        )
