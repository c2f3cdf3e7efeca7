"""The engine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import gc
import json
import logging
import random
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sid.config import EngineConfig
from sid.engine.calibrate import measure_pass_costs
from sid.engine.detokenizer import IncrementalDetokenizer
from sid.engine.fingerprint import numerics_fingerprint, processor, source_digest, weights_digest
from sid.engine.kv_cache import KVCacheManager, PrefixCacheStats, cdiv
from sid.engine.request import Request, RequestStatus
from sid.engine.router import RequestContext, Router, RouterPolicy
from sid.engine.scheduler import CPU_COST, GPU_COST, ScheduledChunk, Scheduler, StepPlan
from sid.engine.selftest import self_test
from sid.model.config import CheckpointError, ModelConfig
from sid.model.decoder import Shard
from sid.model.loader import build_model
from sid.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from sid.runtime.attention import PagedKVCache, get_backend
from sid.runtime.blas import use_row_invariant_gemms
from sid.runtime.cuda_graphs import CUDAGraphs
from sid.runtime.model_runner import ChunkResult, LaunchedPass, ModelRunner, SampledToken, TokenFeed, placeholder
from sid.runtime.tp_worker import TPWorkers, WorkerSpec
from sid.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
DEFAULT_DETERMINISTIC_SEED = 0
"""Seed of a deterministic request that samples (temperature > 0) without giving one."""
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
        self.canonical = config.canonical_sizes_for(self.device)
        self.blas = use_row_invariant_gemms(self.device)
        cuda = self.device.type == "cuda"
        # Bytes other engines held when this one started: KV sizing leaves them out.
        self._memory_baseline = torch.cuda.memory_allocated(self.device) if cuda else 0
        max_positions = max(self.max_model_len, self.canonical.max)  # padding rows too
        self.workers = self._start_workers(max_positions)
        try:
            self._build(max_positions)
        except BaseException:
            self.shutdown()
            raise
        # What is alive now (torch's and transformers' modules, the model) lives as long as
        # the engine. A full collection that scans it all took 0.22-0.24 s on the H200's host,
        # once every few seconds of a busy engine (3 % of its time): it leaves the
        # collector's sight, as in vLLM, until shutdown.
        gc.collect()
        gc.freeze()

    @property
    def canonical_rows(self) -> int:
        """``M_canon``, the smallest canonical pass."""
        return self.canonical.base

    def _start_workers(self, max_positions: int) -> TPWorkers | None:
        """Spawn ranks 1..N-1 (None at TP=1); the checks that need no model run first."""
        config = self.config
        size = config.tensor_parallel_size
        if size == 1:
            return None
        Shard.of(self.model_config, 0, size)  # a model that cannot be split fails before any spawn
        if self.device.type == "cuda" and size > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs; {torch.cuda.device_count()} are visible")
        spec = WorkerSpec(
            model=str(self.path),
            load_format=config.load_format,
            seed=config.seed,
            dtype=self.dtype,
            device_type=self.device.type,
            max_positions=max_positions,
            block_size=config.block_size,
            attention_backend=config.attention_backend,
            canonical=self.canonical,
            num_threads=torch.get_num_threads(),
            size=size,
        )
        workers = TPWorkers(spec, self.device)
        weakref.finalize(self, workers.shutdown)
        return workers

    def _build(self, max_positions: int) -> None:
        config = self.config
        self.model = build_model(
            self.model_config,
            self.path,
            dtype=self.dtype,
            device=self.device,
            max_positions=max_positions,
            load_format=config.load_format,
            seed=config.seed,
            tp=self.workers.group if self.workers is not None else None,
        )
        if self.workers is not None:
            self.workers.wait_ready()
        self.backend = get_backend(config.attention_backend, self.device)
        num_blocks = config.num_kv_blocks or self._auto_num_blocks()
        self.kv_cache = self._kv_cache(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            canonical=self.canonical,
            verify_window=config.verify_window,
            strategy=config.determinism_strategy,
            cost_model=GPU_COST if self.device.type == "cuda" else CPU_COST,
        )
        self.runner = ModelRunner(
            self.model, self.kv_cache, config.block_size, self.device, self.canonical, self.workers
        )
        # Under TP the graphs would have to capture the collectives too; TP runs eagerly.
        if self.device.type == "cuda" and not config.enforce_eager and self.workers is None:
            max_batch = min(config.max_num_seqs, 256)
            canonical_graphs = [s for s in self.canonical.sizes if s <= max(max_batch, self.canonical.base)]
            self.runner.graphs = CUDAGraphs(
                self.model,
                self.kv_cache,
                max_batch=max_batch,
                canonical_sizes=canonical_graphs if config.enable_determinism else (),
                max_blocks=cdiv(max_positions, config.block_size),
                max_seq_len=max_positions,
            )
            self.runner.graphs.capture()
        self.router = Router(_router_policy(config.router_policy))
        self.numerics = self._numerics_config()
        self.fingerprint = numerics_fingerprint(self.numerics)
        self.canonical_domain = f"canonical:{self.fingerprint}"
        self.stats = DeterminismStats()
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._seed_rng = random.Random(config.seed)
        self._arrivals = 0
        self._steps = 0
        self._in_flight: StepInFlight | None = None
        self.async_scheduling = config.async_scheduling_for(self.device)
        if config.enable_determinism:
            self.canonical = self_test(self.runner, self.kv, self.canonical_domain, self.max_model_len)
            self.scheduler.canonical = self.runner.canonical = self.canonical
            self.scheduler.graph_rows = max((s for s in self.canonical.sizes if self.runner.graphed(s)), default=0)
            self.scheduler.fast_graph_rows = self.runner.graphs.buckets[-1] if self.runner.graphs is not None else 0
            if self.device.type == "cuda":
                measured = measure_pass_costs(
                    self.runner,
                    self.kv,
                    self.canonical_domain,
                    fast_graph_rows=self.scheduler.fast_graph_rows,
                    graph_rows=self.scheduler.graph_rows,
                    max_rows=config.max_num_batched_tokens,
                    chunk_len=min(1024, self.max_model_len - 1),
                    context=min(1024, self.max_model_len // 2),
                    launches=4 if self.async_scheduling else 1,  # lockstep: a pass's host and GPU time add up
                )
                self.scheduler.cost_model = measured or GPU_COST
            self.kv.stats = PrefixCacheStats()

    def _kv_cache(self, num_blocks: int) -> PagedKVCache:
        """This rank's KV cache; under TP every worker allocates its own of the same block count."""
        if self.workers is not None:
            self.workers.allocate_kv_cache(num_blocks)
        block_size = self.config.block_size
        return PagedKVCache.for_model(self.backend, self.model, num_blocks, block_size, self.dtype, self.device)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any; the engine cannot step afterwards."""
        gc.unfreeze()
        if self.workers is not None:
            self.workers.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _numerics_config(self) -> dict[str, Any]:
        """Everything that fixes canonical bits (DESIGN 3.2); see ``sid.engine.fingerprint``."""
        from sid.kernels import triton_version

        return {
            "canonical_rows": self.canonical_rows,
            "blas": self.blas,
            "dtype": str(self.dtype),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "attention": self.backend.canonical_config(),
            "sources": source_digest(),
            "torch": torch.__version__,
            "triton": triton_version(),
            "processor": processor(self.device),
            "weights": weights_digest(self.path, self.config.load_format, self.config.seed),
            "architecture": self.model_config.architecture,
        }

    def _block_bytes(self) -> int:
        cfg = self.model_config
        return PagedKVCache.bytes_per_block(
            cfg.num_layers, self.config.block_size, self.model.shard.num_kv_heads, cfg.head_dim, self.dtype
        )

    def _auto_num_blocks(self) -> int:
        """Pool size: this engine's share of the GPU (``gpu_memory_utilization`` of its
        memory, as in vLLM) after its own weights and peak activations, within what is free.
        Memory held by others (another engine in the process) counts against the free part only."""
        per_block = self._block_bytes()
        if self.device.type != "cuda":
            wanted = cdiv(self.config.max_num_seqs * self.max_model_len, self.config.block_size)
            return max(1, min(wanted, self.config.cpu_kv_cache_bytes // per_block))
        own_peak = self._profile_peak_bytes() - self._memory_baseline
        own_now = torch.cuda.memory_allocated(self.device) - self._memory_baseline
        free, total = torch.cuda.mem_get_info(self.device)
        share = int(total * self.config.gpu_memory_utilization)
        budget = min(share - own_peak, free - (own_peak - own_now))
        if budget < per_block:
            raise ValueError(
                f"no memory left for the KV cache: weights and activations take {own_peak / 2**30:.1f} GiB of "
                f"this engine's {share / 2**30:.1f} GiB, with {free / 2**30:.1f} GiB free on the device; "
                "raise gpu_memory_utilization or free the GPU"
            )
        return budget // per_block

    def _profile_peak_bytes(self) -> int:
        """Peak memory of the largest step the scheduler can plan, with a throwaway cache."""
        bs = self.config.block_size
        tokens = self.config.max_num_batched_tokens
        seq_len = min(tokens, self.max_model_len)
        num_seqs = cdiv(tokens, seq_len)
        profile_cache = self._kv_cache(num_seqs * cdiv(seq_len, bs))
        runner = ModelRunner(self.model, profile_cache, bs, self.device, self.canonical, self.workers)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.9, logprobs=5)
        chunks = []
        for s in range(num_seqs):
            n = min(seq_len, tokens - s * seq_len)
            r = Request(f"profile-{s}", None, [0] * n, params, 0, 1, frozenset(), 0)
            chunks.append(ScheduledChunk(r, 0, n))
        width = cdiv(seq_len, bs)
        tables = np.arange(num_seqs * width, dtype=np.int32).reshape(num_seqs, width)  # the whole throwaway cache
        runner.execute(chunks, tables)
        if self.config.enable_determinism:
            # The largest canonical pass with every row choosing a token: its LM head and
            # sampler take more memory than the fast step's few sampled rows.
            rows = min(self.canonical.max, width * bs)
            r = Request("profile-canonical", None, [0], params, 0, rows, frozenset(), 0)
            r.token_ids.extend([0] * (rows - 1))
            r.num_emitted = rows - 1
            runner.execute([ScheduledChunk(r, 0, rows)], tables[:1], canonical=True)
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
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        deterministic: bool = False,
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
        if deterministic and not self.config.enable_determinism:
            raise ValueError("deterministic requests need enable_determinism=True (the start-up self-test)")
        if params.seed is not None:
            seed = params.seed
        else:
            seed = DEFAULT_DETERMINISTIC_SEED if deterministic else self._seed_rng.getrandbits(63)
        self._arrivals += 1
        return Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            seed=seed,
            max_tokens=max_tokens,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            arrival=self._arrivals,
            deterministic=deterministic,
            domain=self.canonical_domain if deterministic else "fast",
        )

    def make_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        context: RequestContext | None = None,
    ) -> Request:
        """Validate and route a request without enqueueing it; raises ``ValueError`` saying what is wrong."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        text, ids, salt = self._tokenize(prompt)
        deterministic, _ = self.router.decide(params, context)
        request = self._new_request(request_id, ids, params, text, deterministic)
        request.cache_salt = salt
        return request

    def enqueue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        if self.tokenizer is not None:
            p = request.params
            self._detok[request.request_id] = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, p.skip_special_tokens, p.stop_strings, p.include_stop_str_in_output
            )
        if request.deterministic:
            self.stats.deterministic_requests += 1
        self.scheduler.add(request)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        context: RequestContext | None = None,
    ) -> None:
        """Validate and queue a request; a bad one raises at once and nothing else changes."""
        self.enqueue(self.make_request(request_id, prompt, params, context))

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            request = self.requests.pop(rid, None)
            if request is not None:
                self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
                self._detok.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        """Requests queued or running, or a launched step whose results are still to be read."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's name), so the next requests compute their
        prompts again; refused (False) while requests are unfinished."""
        return not self.has_unfinished_requests() and self.kv.pool.reset_cache()

    def get_stats(self) -> dict[str, Any]:
        """Engine counters: scheduling, prefix cache, and what determinism cost."""
        sched = self.scheduler.stats
        return {
            **asdict(self.stats),
            "steps": sched.steps,
            "preemptions": sched.preemptions,
            "scheduled_tokens": sched.scheduled_tokens,
            "canonical_passes": sched.canonical_passes,
            "canonical_pass_sizes": list(self.canonical.sizes),
            "canonical_rows_used": sched.canonical_rows_used,
            "canonical_rows_padded": sched.canonical_rows_padded,
            "strategy_choices": dict(sched.strategy_choices),
            "prefix_cache_hit_rate": self.kv.stats.hit_rate,
            "kv_usage": self.kv.pool.usage(),
            "fingerprint": self.fingerprint,
        }

    # --------------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the requests that progressed (cumulative outputs).

        With overlapped scheduling the step is launched before the previous one's results
        are read, and it returns those: the host plans step N+1 while the GPU runs step N.
        """
        plan = self.scheduler.schedule()
        progressed: dict[str, Request] = {}
        previous, self._in_flight = self._in_flight, None
        if previous is not None and any(c.request.params.uses_penalties for c in plan.chunks):
            self._finish(previous, progressed)  # penalties count the previous step's tokens on the host
            previous = None
        launched = self._launch(plan, previous)
        if previous is not None:
            self._finish(previous, progressed)
        if self.async_scheduling and launched.passes:
            self._in_flight = launched
        else:
            self._finish(launched, progressed)
        outputs = []
        for request in progressed.values():
            if request.finished:
                self.scheduler.finish(request, request.status)
            if request.finished or request.params.output_kind is RequestOutputKind.CUMULATIVE:
                outputs.append(self._output(request))
            if request.finished:
                self.requests.pop(request.request_id, None)
                self._detok.pop(request.request_id, None)
        return outputs

    def _launch(self, plan: StepPlan, previous: StepInFlight | None) -> StepInFlight:
        """Queue every pass of ``plan`` (canonical ones first) and advance the requests'
        counters as if they had run: a placeholder stands for each token still to arrive."""
        self._steps += 1
        launched = StepInFlight(self._steps)
        feed = previous.feed() if previous is not None else None
        passes = [(chunks, True) for chunks in plan.canonical] + ([(plan.fast, False)] if plan.fast else [])
        for planned, canonical in passes:
            chunks = [c for c in planned if self._still_valid(c, canonical)]
            if not chunks:
                continue
            table = self.kv.block_table([c.request for c in chunks])
            handle = self.runner.launch(chunks, table, canonical=canonical, feed=feed)
            offset = launched.num_tokens
            planned_under = []
            for chunk, row in zip(chunks, handle.token_rows):
                request = chunk.request
                request.num_computed_tokens = max(request.num_computed_tokens, chunk.end)
                if canonical and request.deterministic:
                    request.n_canon = chunk.end
                takes = row is not None and chunk.end == request.num_tokens and request.num_output_tokens < request.max_tokens
                if takes:
                    request.token_ids.append(placeholder(launched.step, offset + row))  # type: ignore[operator]
                planned_under.append(Planned(request.epoch, takes))
            launched.add(handle, planned_under)
        return launched

    def _finish(self, launched: StepInFlight, progressed: dict[str, Request]) -> None:
        """Wait for a launched step's passes and fold their results into the requests."""
        for handle, planned in zip(launched.passes, launched.planned):
            results = self.runner.collect(handle)
            for chunk, result, under in zip(handle.chunks, results, planned):
                request = chunk.request
                if request.finished or request.epoch != under.epoch:
                    continue  # aborted, finished, rolled back or preempted since the launch
                if self._apply(chunk, result, handle.canonical, under.takes_token):
                    progressed[request.request_id] = request

    def _still_valid(self, chunk: ScheduledChunk, canonical: bool) -> bool:
        """False once results read after planning voided the chunk: its request finished, was
        rolled back below it, or lost the blocks it writes."""
        request = chunk.request
        if request.finished or chunk.end > request.num_tokens:
            return False
        if len(self.kv.blocks_of(request)) * self.kv.block_size < chunk.end:
            return False
        return not (canonical and request.deterministic and chunk.start != request.n_canon)

    def _apply(self, chunk: ScheduledChunk, result: ChunkResult, canonical: bool, takes_token: bool) -> bool:
        """Fold one chunk's results into its request; True if it emitted a token or finished."""
        request = chunk.request
        if request.prompt_logprobs is not None and result.prompt_logprobs:
            request.prompt_logprobs.extend(self._decorate(e) for e in result.prompt_logprobs)
        emitted = request.num_emitted
        cacheable = chunk.end
        if request.deterministic and canonical:
            cacheable = self._verify(request, chunk.end, result.samples)
        elif takes_token:  # the chunk's last row chose the token its placeholder stands for
            last = result.samples[-1]
            _fill(request, last.position + 1, last.token_id)
            if request.deterministic:
                self.stats.proposed_tokens += 1  # it waits for verification
                cacheable = 0
            else:
                self._emit(request, last.logprobs)
        elif request.deterministic:
            cacheable = 0
        if chunk.end == request.num_tokens and request.max_tokens == 0 and not request.wants_prompt_logprobs:
            request.status = RequestStatus.FINISHED_LENGTH
        self.kv.cache_full_blocks(request, cacheable)
        return request.num_emitted > emitted or request.finished

    def _verify(self, request: Request, end: int, samples: list[SampledToken]) -> int:
        """Compare canonical tokens with what the request holds; commit, or roll back (DESIGN 3.4).

        ``samples`` come from the chunk's rows up to ``end`` that choose a token (a large pass
        leaves out prompt rows before the last). Returns how many leading positions now have
        canonical K/V that belongs to committed tokens."""
        verified = False
        for sampled in samples:
            nxt = sampled.position + 1
            if nxt < request.num_committed_tokens:
                if nxt >= request.num_prompt_tokens and request.token_ids[nxt] != sampled.token_id:
                    raise RuntimeError(
                        f"{request.request_id}: canonical recompute of position {sampled.position} disagrees with "
                        "its committed token; the numerics contract is broken"
                    )
                continue
            if request.max_tokens == 0:
                return nxt
            held = request.token_ids[nxt]
            rollback = held >= 0 and held != sampled.token_id
            if held >= 0 and not verified:
                verified = True
                self.stats.verifications += 1
            if rollback:
                self.stats.rollbacks += 1
                self.stats.recomputed_tokens += sum(t >= 0 for t in request.token_ids[nxt:])  # not in-flight ones
                del request.token_ids[nxt + 1 :]
                request.token_ids[nxt] = sampled.token_id
                self.kv.truncate(request, nxt)  # later rows of this pass read the wrong tokens
                request.n_canon = nxt
                request.epoch += 1  # passes launched since read the wrong tokens too
            elif held < 0:
                _fill(request, nxt, sampled.token_id)
            else:
                self.stats.accepted_tokens += 1
            self._emit(request, sampled.logprobs)
            if rollback or request.finished:
                return nxt
        return end

    def _emit(self, request: Request, logprobs: PositionLogprobs | None) -> None:
        """Commit the next held token to the output, then check the stop conditions."""
        token = request.token_ids[request.num_committed_tokens]
        request.num_emitted += 1
        if logprobs is not None and request.logprobs is not None:
            request.logprobs.append(self._decorate(logprobs))
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

    def _decorate(self, entry: PositionLogprobs) -> PositionLogprobs:
        if self.tokenizer is None:
            return entry
        return {t: Logprob(lp.logprob, lp.rank, self.tokenizer.decode([t])) for t, lp in entry.items()}

    def _output(self, request: Request) -> RequestOutput:
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


@dataclass(frozen=True)
class Planned:
    """A launched chunk's request as it was: its epoch, and whether a placeholder awaits the
    chunk's last token."""

    epoch: int
    takes_token: bool


@dataclass
class StepInFlight:
    """One step's launched passes, in launch order, with the request epochs they ran under."""

    step: int
    passes: list[LaunchedPass] = field(default_factory=list)
    planned: list[list[Planned]] = field(default_factory=list)  # per pass, per chunk

    @property
    def tokens(self) -> list[torch.Tensor]:
        return [p.tokens for p in self.passes if p.tokens is not None]

    @property
    def num_tokens(self) -> int:
        """Rows sampled so far: where the next pass's tokens start in ``feed``."""
        return sum(t.numel() for t in self.tokens)

    def add(self, handle: LaunchedPass, planned: list[Planned]) -> None:
        self.passes.append(handle)
        self.planned.append(planned)

    def feed(self) -> TokenFeed | None:
        """Every pass's sampled tokens, on the device, for the next step's placeholders."""
        tokens = self.tokens
        if not tokens:
            return None
        return TokenFeed(tokens[0] if len(tokens) == 1 else torch.cat(tokens), self.step)


def _fill(request: Request, index: int, token: int) -> None:
    """Put a sampled token where the launch of its pass left a placeholder."""
    if request.token_ids[index] >= 0:
        raise RuntimeError(f"{request.request_id}: position {index} holds a token, not a placeholder")
    request.token_ids[index] = token


@dataclass
class DeterminismStats:
    deterministic_requests: int = 0
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verifications: int = 0
    rollbacks: int = 0
    recomputed_tokens: int = 0
    """Proposals thrown away on rollback: fast-lane work the canonical lane redid."""


def _router_policy(policy: RouterPolicy | dict[str, Any] | str | Path | None) -> RouterPolicy:
    if policy is None:
        return RouterPolicy()
    if isinstance(policy, RouterPolicy):
        return policy
    if isinstance(policy, dict):
        return RouterPolicy.from_dict(policy)
    return RouterPolicy.from_file(policy)
