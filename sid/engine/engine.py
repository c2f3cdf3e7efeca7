"""The engine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from sid.config import EngineConfig
from sid.engine.calibrate import calibrate
from sid.engine.fingerprint import numerics_config, numerics_fingerprint
from sid.engine.inflight import Planned, StepInFlight
from sid.engine.inputs import InputProcessor, PromptType, eos_token_ids, load_tokenizer, router_policy
from sid.engine.kv_cache import KVCacheManager, PrefixCacheStats, cdiv
from sid.engine.memory import num_kv_blocks
from sid.engine.outputs import OutputProcessor
from sid.engine.plan import PassSizes, ScheduledChunk, SchedulerStats, StepPlan
from sid.engine.request import Request, RequestStatus
from sid.engine.router import RequestContext, Router
from sid.engine.scheduler import Scheduler
from sid.engine.windowed import CPU_COST, GPU_COST, DeterminismStats, WindowedLane, verify
from sid.model.config import ModelConfig
from sid.model.decoder import column_families
from sid.model.loader import build_model
from sid.outputs import RequestOutput
from sid.runtime.attention import PagedKVCache, get_backend
from sid.runtime.cuda_graphs import GraphSpec, decode_buckets
from sid.runtime.gemm import CPU_TILE, candidates, padding_tables, prove_families, prove_plan, shape_of
from sid.runtime.model_runner import ChunkResult, ModelRunner, placeholder
from sid.runtime.piecewise_graphs import piece_buckets
from sid.runtime.tp_worker import TPWorkers
from sid.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

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
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {limit} positions")
        self.max_model_len = config.max_model_len or limit
        self.canonical = config.canonical_sizes_for(self.device, proven=False)
        self.ride = False
        """Deterministic rows ride in ordinary passes (GEMMs proven row-invariant, DESIGN 1b)."""
        self.gemm_failures: dict[str, str] = {}
        cuda = self.device.type == "cuda"
        # Bytes other engines held when this one started: KV sizing leaves them out.
        memory_baseline = torch.cuda.memory_allocated(self.device) if cuda else 0
        proven_sizes = config.canonical_sizes_for(self.device, proven=True)
        self.max_positions = max(self.max_model_len, self.canonical.max, proven_sizes.max)  # padding rows too
        self.workers = TPWorkers.start(
            config, self.model_config, self.dtype, self.device, self.canonical, self.max_positions
        )
        if self.workers is not None:
            weakref.finalize(self, self.workers.shutdown)
        try:
            self._build(self.max_positions, proven_sizes, memory_baseline)
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

    def _build(self, max_positions: int, proven_sizes: PassSizes, memory_baseline: int) -> None:
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
        self.model.gemms.set_fast(self.device, self.model.gemm_weights())
        if config.tp_invariant_chunks is not None:
            self.model.split_row_parallel(config.tp_invariant_chunks)
        if self.workers is not None:
            self.workers.wait_ready()
        if config.enable_determinism:
            self._prove_gemms(proven_sizes)
        self.backend = get_backend(config.attention_backend, self.device)
        num_blocks = config.num_kv_blocks or num_kv_blocks(self, memory_baseline)
        self.kv_cache = self.kv_cache_of(num_blocks)
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        windowed = WindowedLane(
            self.canonical,
            config.verify_window,
            config.determinism_strategy,
            GPU_COST if self.device.type == "cuda" else CPU_COST,
            SchedulerStats(),
            config.max_canonical_rows,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            windowed=windowed,
        )
        self.runner = ModelRunner(
            self.model, self.kv_cache, config.block_size, self.device, self.canonical, self.workers
        )
        self.scheduler.ride = self.runner.ride = self.ride
        if self.device.type == "cuda" and not config.enforce_eager:
            self.capture_graphs()
        self.numerics = numerics_config(self)
        self.fingerprint = numerics_fingerprint(self.numerics)
        self.canonical_domain = f"canonical:{self.fingerprint}"
        self.inputs = InputProcessor(
            tokenizer=self.tokenizer,
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            block_size=config.block_size,
            num_blocks=num_blocks,
            enable_determinism=config.enable_determinism,
            canonical_domain=self.canonical_domain,
            eos_token_ids=eos_token_ids(self.path, self.model_config, self.tokenizer),
            router=Router(router_policy(config.router_policy)),
            seed=config.seed,
        )
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len, self.fingerprint)
        self.stats = DeterminismStats()
        self.requests: dict[str, Request] = {}
        self._steps = 0
        self._in_flight: StepInFlight | None = None
        self.async_scheduling = config.async_scheduling_for(self.device)
        calibrate(self, windowed)
        self.kv.stats = PrefixCacheStats()

    def capture_graphs(self) -> None:
        """Capture the CUDA graphs on every rank (start-up does on CUDA, unless ``enforce_eager``):
        decode steps by batch bucket, canonical passes of a decode bucket's size (with proven
        GEMMs the canonical sizes are too many to capture them all), and passes with prompt
        rows in pieces, where riding rows take the proven GEMMs at proven sizes and the fast
        lane alone its own. Chunked TP-invariant sums are for canonical rows: eager. Off CUDA
        the graphs' computation runs eagerly through their buffers (the tests' twin)."""
        config = self.config
        max_batch = min(config.max_num_seqs, 256)
        canonical_lane = config.enable_determinism and not self.ride
        buckets = set(decode_buckets(max(max_batch, self.canonical.base)))
        invariant = self.model.gemms.invariant
        riding_sizes = self.canonical.sizes if self.ride else None
        pieces = config.tp_invariant_chunks is None
        spec = GraphSpec(
            max_batch=max_batch,
            canonical_sizes=tuple(s for s in self.canonical.sizes if s in buckets) if canonical_lane else (),
            max_blocks=cdiv(self.max_positions, config.block_size),
            max_seq_len=self.max_positions,
            riding=self.ride,
            invariant_decode=self.ride and not self.model.gemms.fast_is_proven(),
            canonical_invariant=invariant is not None,
            piece_buckets=tuple(piece_buckets(config.max_num_batched_tokens, riding_sizes)) if pieces else (),
            pieces_invariant=self.ride,
        )
        if self.workers is not None:
            self.workers.capture_graphs(spec)  # they capture beside rank 0: the warm-ups' collectives meet
        self.runner.graphs, self.runner.pieces = spec.capture(self.model, self.kv_cache)

    def _prove_gemms(self, sizes: PassSizes) -> None:
        """Prove, per weight shape, a GEMM path that gives a row the same bits at every pass
        size of ``sizes`` (``sid.runtime.gemm``). With one for every shape, deterministic rows
        ride in ordinary passes padded to those sizes (unless a windowed strategy is asked
        for) and canonical passes may be as small as one row; without, deterministic requests
        take the windowed canonical lane at today's ``M_canon``. With ``tp_invariant_chunks``,
        the column-parallel GEMMs take paths proven for every TP size the chunks cover, so the
        fingerprint need not name the TP size (``Gemms.tp_free``)."""
        config = self.config
        strategy = config.determinism_strategy
        paths = candidates(self.device, CPU_TILE)
        chunks = config.tp_invariant_chunks
        families = prove_families(
            column_families(self.model_config, chunks) if chunks else [], paths, list(sizes.sizes), self.dtype,
            self.device, config.tensor_parallel_size,
        )  # fmt: skip
        plan, failures = prove_plan(self.model.gemm_weights(), paths, list(sizes.sizes), families.shapes)
        self.gemm_failures = {**families.failures, **failures}
        if plan is None:
            if strategy == "ride":
                failed = "; ".join(f"{k}: {v}" for k, v in self.gemm_failures.items())
                raise ValueError(
                    f"determinism_strategy='ride' needs GEMMs that keep a row's bits at every row count: {failed}"
                )
            logger.info("no row-invariant GEMM path for every shape; deterministic requests take the windowed lane")
            return
        gemms = self.model.gemms
        gemms.invariant, gemms.sizes = plan, sizes
        if families.shapes:
            pieces = {shape_of(w, None) for w in self.model.chunk_weights()}
            gemms.tp_free = families.names | {f"chunk {o}x{i}": str(plan[o, i, b]) for o, i, b in sorted(pieces)}
        gemms.padding = padding_tables(plan, self.model.gemm_weights(), gemms.fast)
        if self.workers is not None:
            self.workers.set_gemms(gemms)
        self.canonical = sizes
        self.ride = strategy in ("auto", "ride")

    def kv_cache_of(self, num_blocks: int) -> PagedKVCache:
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

    def check_health(self) -> None:
        """Raise a ``RuntimeError`` saying why if the engine cannot step: under TP, a worker
        died or the group broke (``TPGroupError``). Safe to call from another thread."""
        if self.workers is not None:
            self.workers.check_health()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ----------------------------------------------------------------- requests

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
        return self.inputs.make_request(request_id, prompt, params, context)

    def enqueue(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.outputs.add(request)
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
                self.outputs.remove(rid)

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
            "determinism": "ride" if self.ride else "windowed",
            "gemm_paths": self.model.gemms.describe(),
            **self.model.gemms.describe_choices(),
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
                outputs.append(self.outputs.output(request))
            if request.finished:
                self.requests.pop(request.request_id, None)
                self.outputs.remove(request.request_id)
        return outputs

    def _launch(self, plan: StepPlan, previous: StepInFlight | None) -> StepInFlight:
        """Queue every pass of ``plan`` (canonical ones first) and advance the requests'
        counters as if they had run: a placeholder stands for each token still to arrive."""
        self._steps += 1
        launched = StepInFlight(self._steps)
        feed = previous.feed() if previous is not None else None
        passes = [(chunks, True) for chunks in plan.canonical] + ([(plan.fast, False)] if plan.fast else [])
        for planned, canonical in passes:
            # One-row chunks (decodes) first: attention gives a pass's leading one-row sequences
            # a decode launch of their own beside its prompt rows (``paged_attention``).
            chunks = sorted((c for c in planned if self._still_valid(c, canonical)), key=lambda c: c.num_tokens != 1)
            if not chunks:
                continue
            table = self.kv.block_table([c.request for c in chunks])
            handle = self.runner.launch(chunks, table, canonical=canonical, feed=feed)
            offset = launched.num_tokens
            planned_under = []
            for chunk, row in zip(chunks, handle.token_rows):
                request = chunk.request
                request.num_computed_tokens = max(request.num_computed_tokens, chunk.end)
                if request.deterministic and (canonical or self.ride):
                    request.n_canon = chunk.end  # canonical K/V: a canonical pass, or rows that rode
                takes = (
                    row is not None and chunk.end == request.num_tokens
                    and request.num_output_tokens < request.max_tokens
                )
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
            request.prompt_logprobs.extend(self.outputs.decorate(e) for e in result.prompt_logprobs)
        emitted = request.num_emitted
        cacheable = chunk.end
        if request.deterministic and canonical:
            cacheable = verify(request, chunk.end, result.samples, self.kv, self.stats, self.outputs.emit)
        elif takes_token:  # the chunk's last row chose the token its placeholder stands for
            last = result.samples[-1]
            request.fill(last.position + 1, last.token_id)
            if request.deterministic and not self.ride:
                self.stats.proposed_tokens += 1  # it waits for verification
                cacheable = 0
            else:
                self.outputs.emit(request, last.logprobs)  # riding rows are canonical: committed at once
        elif request.deterministic and not self.ride:
            cacheable = 0
        if chunk.end == request.num_tokens and request.max_tokens == 0 and not request.wants_prompt_logprobs:
            request.status = RequestStatus.FINISHED_LENGTH
        self.kv.cache_full_blocks(request, cacheable)
        return request.num_emitted > emitted or request.finished
