"""Turns a planned pass into tensors, runs the model, and samples.

A *fast* pass has as many rows as it has tokens, computes logits only for rows that need
them, and attends with the fast schedule. A *canonical* pass (DESIGN 3.1) is padded to one
of the canonical sizes (``PassSizes``, from ``M_canon`` up; padding rows write nothing),
runs the final norm, the LM head and sampling on fixed-size sets of rows, and attends with
the canonical schedule, so each row's result is a function of its own request and position
alone.

Where the GEMMs keep a row's bits at every row count (``ride``, DESIGN 1b), a fast pass may
carry deterministic requests' rows: those rows run the GEMMs on their row-invariant paths
(the other rows too, except on a bounded path, where they take the fast one: ``RowSplit``), the pass
is padded to a size the start-up proof covered (as are its LM head and sampler rows), and
those rows attend with the canonical schedule while the others keep the fast one.

``launch`` queues a pass and its sampling without waiting for the GPU; ``collect`` waits for
the sampled tokens, copied to pinned host memory, and hands them out. Between the two the
engine can plan and launch the next step (overlapped scheduling).

Under tensor parallelism this runner is rank 0's: it turns chunks into a ``StepInputs``
(token ids and cache layout only), which every rank's ``forward`` runs, and it alone
samples. The workers' runners only ever run ``forward``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING

import numpy as np
import torch

from sid.engine.kv_cache import cdiv
from sid.engine.request import Request
from sid.engine.plan import PassSizes, ScheduledChunk
from sid.model.decoder import CausalLM
from sid.outputs import Logprob, PositionLogprobs
from sid.runtime.attention import AttentionMetadata, PagedKVCache
from sid.runtime.cuda_graphs import CUDAGraphs
from sid.runtime.faults import FAULTS
from sid.runtime.gemm import RowSplit
from sid.runtime.piecewise_graphs import PieceGraphs
from sid.runtime.sampler import SamplerOutput, SamplingBatch, compute_logprobs, sample
from sid.runtime.transfer import upload
from sid.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sid.runtime.tp_worker import TPWorkers

_PAD_PARAMS = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class SampledToken:
    """The token chosen from the logits at ``position`` (it goes at ``position + 1``)."""

    position: int
    token_id: int
    logprobs: PositionLogprobs | None = None


@dataclass
class StepInputs:
    """One forward pass as every rank sees it: rows, their cache layout, the rows needing logits."""

    input_ids: list[int]
    positions: list[int]
    slots: np.ndarray | list[int]
    block_tables: np.ndarray
    """int32 [sequences, width]; entries past a sequence's blocks are never read."""
    seq_lens: list[int]
    query_start_loc: list[int]
    canonical: bool
    """Every sequence attends with the canonical schedule (a canonical pass)."""
    logit_rows: list[int] | None
    """Rows whose logits are computed, in this order; None = every row (a small canonical pass)."""
    canonical_seqs: list[int] | None = None
    """Per sequence, 1 = canonical attention (a ride pass: deterministic rows among fast ones)."""
    invariant: bool = False
    """The GEMMs take their row-invariant paths."""
    seq_keys: Sequence[int] = ()
    """Rank 0 only: each sequence's identity (its request's arrival; -1 for padding), so the
    plan channel sends a block-table row as the entries that changed since that sequence's
    last pass. Workers never need it."""
    graphed: bool = False
    """A captured graph runs the pass (``CUDAGraphs``; every rank replays its own)."""


@dataclass
class ChunkResult:
    samples: list[SampledToken] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs] = field(default_factory=list)
    logits: torch.Tensor | None = None  # a canonical chunk's sampled rows' logits, when asked for (self-test)


PLACEHOLDER_STRIDE = 1 << 24
"""Placeholder ids of one step: ``-1 - (step * PLACEHOLDER_STRIDE + index)``, index below the stride."""


def placeholder(step: int, index: int) -> int:
    """The host's stand-in for token ``index`` of step ``step``'s sampled tokens, still on the device."""
    return -1 - (step * PLACEHOLDER_STRIDE + index)


@dataclass
class TokenFeed:
    """The tokens one step sampled, on the device, for the next step's inputs.

    With overlapped scheduling the next step is planned and launched before these tokens
    reach the host, so its rows hold placeholders; ``resolve`` swaps them on the device.
    """

    tokens: torch.Tensor  # [N] int64: every pass's sampled rows, in launch order
    step: int

    @staticmethod
    def check(input_ids: list[int], feed: TokenFeed | None) -> TokenFeed | None:
        """``feed`` if ``input_ids`` hold placeholders (all of them from its step), else None."""
        if min(input_ids, default=0) >= 0:
            return None
        high = -1 - feed.step * PLACEHOLDER_STRIDE if feed is not None else -1
        low = high - feed.tokens.numel() + 1 if feed is not None else 0
        if feed is None or any(not low <= t <= high for t in input_ids if t < 0):
            raise RuntimeError("a pass reads a token that no finished or in-flight step has sampled")
        return feed

    def resolve(self, ids: torch.Tensor) -> None:
        """Replace placeholders in the device tensor ``ids`` with the tokens they stand for."""
        index = (-1 - self.step * PLACEHOLDER_STRIDE - ids).clamp_(0, self.tokens.numel() - 1)
        ids.copy_(torch.where(ids < 0, self.tokens[index], ids))


@dataclass
class PassRows:
    """A pass's rows: ``pad`` trailing padding rows (canonical passes) write nothing."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    prompt_rows: list[tuple[int, int, int]] = field(default_factory=list)  # (row, target token, chunk)
    sample_rows: list[tuple[int, int]] = field(default_factory=list)  # (row, chunk)
    token_rows: list[int | None] = field(default_factory=list)  # see LaunchedPass.token_rows
    pad: int = 0
    logit_rows: list[int] | None = None
    """Rows whose logits are computed, in this order (sampled rows last); None = every row."""
    logit_pad: int = 0  # trailing logit rows that stand in for padding (canonical and ride passes)
    prompt_index: list[int] = field(default_factory=list)  # each prompt row's place among the logit rows
    canonical_seqs: list[int] | None = None  # a ride pass's per-sequence attention flags (StepInputs)


@dataclass
class LaunchedPass:
    """A pass whose kernels are queued: which rows produce what, and its outputs as they
    arrive on the host (``wait`` blocks until they have)."""

    chunks: list[ScheduledChunk]
    canonical: bool
    sample_rows: list[tuple[int, int]]  # (row, chunk) of each sampled row, in sampled order
    token_rows: list[int | None]
    """Per chunk, the index among the sampled rows of its last row (None: it samples nothing)."""
    positions: list[int]
    prompt_owners: list[int]  # chunk of each prompt-logprob row
    tokens: torch.Tensor | None = None  # sampled token ids on the device (the next step's feed)
    sampled: SamplerOutput | None = None
    prompt_scored: SamplerOutput | None = None
    logits: list[torch.Tensor] = field(default_factory=list)  # per chunk, when asked for (self-test)
    ready: torch.cuda.Event | None = None

    def to_host(self) -> None:
        """Start copying the sampler's outputs to pinned host memory; record when they land."""
        probe = self.tokens if self.tokens is not None else self.prompt_scored.token_ids if self.prompt_scored else None
        if probe is None or not probe.is_cuda:
            return
        self.sampled = _to_host(self.sampled)
        self.prompt_scored = _to_host(self.prompt_scored)
        self.ready = torch.cuda.Event()
        self.ready.record()

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


def _to_host(out: SamplerOutput | None) -> SamplerOutput | None:
    if out is None:
        return None
    fields = {name: getattr(out, name) for name in ("token_ids", "logprob", "rank", "top_ids", "top_logprobs")}
    return SamplerOutput(**{k: v.to("cpu", non_blocking=True) if v is not None else None for k, v in fields.items()})


def _position_logprobs(out: SamplerOutput, row: int, num_top: int) -> PositionLogprobs:
    """One row of a ``SamplerOutput`` as vLLM's ``{token_id: Logprob}``: chosen token first."""
    assert out.logprob is not None and out.rank is not None
    entry = {int(out.token_ids[row]): Logprob(float(out.logprob[row]), int(out.rank[row]))}
    if num_top and out.top_ids is not None and out.top_logprobs is not None:
        ids = out.top_ids[row, :num_top].tolist()
        lps = out.top_logprobs[row, :num_top].tolist()
        for rank, (tok, lp) in enumerate(zip(ids, lps), start=1):
            entry.setdefault(tok, Logprob(lp, rank))
    return entry


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        block_size: int,
        device: torch.device,
        canonical: PassSizes,
        workers: TPWorkers | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = device
        self.canonical = canonical
        self.vocab_size = model.cfg.vocab_size
        self.graphs: CUDAGraphs | None = None
        self.pieces: PieceGraphs | None = None
        """Fast passes that no decode graph runs (prompt rows) replay these, attention between."""
        self.workers = workers
        """Rank 0 of a tensor-parallel group: each pass is sent to these workers first."""
        self.ride = False
        """Deterministic requests' rows ride in fast passes (the engine sets it once the GEMMs are proven)."""

    def _tensor(
        self, data: Sequence[int] | Sequence[float] | Sequence[Sequence[int]], dtype: torch.dtype
    ) -> torch.Tensor:
        return torch.tensor(data, dtype=dtype, device=self.device)

    def _layout(
        self, chunks: Sequence[ScheduledChunk], table: np.ndarray, rows: PassRows
    ) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
        """Slots, block tables, context lengths and query starts; the ``rows.pad`` trailing
        rows form one sequence that writes nothing."""
        bs, pad = self.block_size, rows.pad
        counts = [c.num_tokens for c in chunks]
        positions = np.array(rows.positions[: len(rows.positions) - pad], dtype=np.int64)
        seq = np.repeat(np.arange(len(chunks)), counts)
        slots = table[seq, positions // bs].astype(np.int64) * bs + positions % bs
        qsl = [0, *accumulate(counts)]
        seq_lens = [c.end for c in chunks]
        if pad:
            slots = np.concatenate([slots, np.full(pad, -1, dtype=np.int64)])
            padded = np.zeros((len(chunks) + 1, max(table.shape[1], cdiv(pad, bs))), dtype=np.int32)
            padded[: len(chunks), : table.shape[1]] = table
            table = padded
            qsl.append(qsl[-1] + pad)
            seq_lens.append(pad)
        return slots, table, seq_lens, qsl

    def _sampling_batch(self, rows: Sequence[tuple[Request | None, int]]) -> SamplingBatch:
        """Settings for rows choosing the token after ``position`` of their request."""
        params = [r.params if r is not None else _PAD_PARAMS for r, _ in rows]
        v = self.vocab_size
        f32, i64 = torch.float32, torch.int64
        temperature, top_p, min_p = upload(
            self.device, [[p.temperature for p in params], [p.top_p for p in params], [p.min_p for p in params]], f32
        )
        top_k, seeds, positions = upload(
            self.device,
            [
                [p.top_k if p.top_k > 0 else v for p in params],
                [r.seed if r is not None else 0 for r, _ in rows],
                [pos + 1 for _, pos in rows],
            ],
            i64,
        )
        b = SamplingBatch(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=seeds,
            positions=positions,
            any_random=any(not p.greedy for p in params),
            any_top_k=any(0 < p.top_k < v for p in params),
            any_top_p_or_min_p=any(p.top_p < 1.0 or p.min_p > 0.0 for p in params),
        )
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            b.num_logprobs = max(wanted)
        if any(p.uses_penalties for p in params):
            penalties = [[p.presence_penalty for p in params], [p.frequency_penalty for p in params]]
            penalties.append([p.repetition_penalty for p in params])
            b.presence_penalty, b.frequency_penalty, b.repetition_penalty = upload(self.device, penalties, f32)
            counts = torch.zeros((len(rows), v), dtype=i64, device=self.device)
            seen = torch.zeros((len(rows), v), dtype=torch.bool, device=self.device)
            for i, (r, pos) in enumerate(rows):
                if r is not None and r.params.uses_penalties:
                    out_ids = self._tensor(r.token_ids[r.num_prompt_tokens : pos + 1], i64)
                    counts[i].scatter_add_(0, out_ids, torch.ones_like(out_ids))
                    seen[i, self._tensor(r.token_ids[: pos + 1], i64)] = True
            b.output_counts, b.seen = counts, seen
        return b

    @torch.inference_mode()
    def execute(
        self,
        chunks: Sequence[ScheduledChunk],
        block_table: np.ndarray,
        *,
        canonical: bool = False,
        keep_logits: bool = False,
    ) -> list[ChunkResult]:
        """Run one forward pass over ``chunks`` and wait for what each chunk produced."""
        return self.collect(self.launch(chunks, block_table, canonical=canonical, keep_logits=keep_logits))

    def _rows(self, chunks: Sequence[ScheduledChunk], canonical: bool, ride: bool, probe: bool = False) -> PassRows:
        """What each row of the pass is: its token and position, and which rows give logits.

        A canonical pass of ``M_canon`` rows, or of a size a graph replays, computes every
        row's logits. A larger one (long prompts) leaves out rows that choose no token (prompt
        positions before the last) and runs the LM head on the rest, padded to a pass size of
        its own: it gives those rows the same bits (rows are independent at every size), and
        a pass inside a long prompt skips the LM head and sampling altogether. A ride pass
        (``ride``) is padded to a proven size unless a decode graph pads it to its bucket (a
        proven size too), and its LM head and sampler rows to one as well; with ``probe`` (the
        self-test) every row of a deterministic chunk gives logits.
        """
        rows = PassRows()
        num_rows = sum(c.num_tokens for c in chunks)
        size = self.canonical.fit(num_rows) if canonical else num_rows
        every_row = canonical and (size == self.canonical.base or self.graphed(size))
        for i, chunk in enumerate(chunks):
            r = chunk.request
            row0 = len(rows.input_ids)
            rows.input_ids.extend(r.token_ids[chunk.start : chunk.end])
            rows.positions.extend(range(chunk.start, chunk.end))
            first_choice = r.num_prompt_tokens - 1  # the first position that chooses a token
            if r.wants_prompt_logprobs:
                first = max(chunk.start, len(r.prompt_logprobs or ()) - 1)
                for p in range(first, min(chunk.end, r.num_prompt_tokens - 1)):
                    rows.prompt_rows.append((row0 + p - chunk.start, r.token_ids[p + 1], i))
                first_choice = min(first_choice, first)
            if canonical:
                skip = 0 if every_row else min(chunk.num_tokens, max(0, first_choice - chunk.start))
                rows.sample_rows.extend((row0 + k, i) for k in range(skip, chunk.num_tokens))
            elif ride and probe and r.deterministic:
                rows.sample_rows.extend((row0 + k, i) for k in range(chunk.num_tokens))
            elif chunk.samples and r.num_output_tokens < r.max_tokens:
                rows.sample_rows.append((row0 + chunk.num_tokens - 1, i))
            last = rows.sample_rows[-1] if rows.sample_rows else None
            rows.token_rows.append(len(rows.sample_rows) - 1 if last is not None and last[1] == i else None)
        if ride and not self._graph_runs(False, bool(rows.prompt_rows), num_rows, len(chunks), ride):
            size = self.canonical.fit(num_rows)  # a decode graph pads to its bucket instead
        rows.pad = size - num_rows
        rows.input_ids.extend([0] * rows.pad)
        rows.positions.extend(range(rows.pad))
        prompt = [row for row, _, _ in rows.prompt_rows]
        if not canonical:
            rows.logit_rows = prompt + [row for row, _ in rows.sample_rows]
            rows.prompt_index = list(range(len(prompt)))
            if ride:
                flags = [int(c.request.deterministic) for c in chunks]
                rows.canonical_seqs = flags + [min(flags)] * bool(rows.pad)  # padding joins an all-deterministic pass
                if rows.logit_rows:
                    rows.logit_rows, rows.logit_pad = _pad_rows(
                        rows.logit_rows, self.canonical.fit(len(rows.logit_rows))
                    )
        elif every_row:
            rows.logit_pad = rows.pad
            rows.prompt_index = prompt
        else:
            head = [row for row, _ in rows.sample_rows]
            rows.logit_pad = self.canonical.fit(len(head)) - len(head) if head else 0
            rows.logit_rows = head + [size - 1] * rows.logit_pad
            where = {row: k for k, row in enumerate(head)}
            rows.prompt_index = [where[row] for row in prompt]
        return rows

    @torch.inference_mode()
    def launch(
        self,
        chunks: Sequence[ScheduledChunk],
        block_table: np.ndarray,
        *,
        canonical: bool = False,
        keep_logits: bool = False,
        feed: TokenFeed | None = None,
    ) -> LaunchedPass:
        """Queue one forward pass over ``chunks`` and its sampling; nothing waits for the GPU.

        ``block_table`` holds each chunk's request's block ids (``KVCacheManager.block_table``).
        Input tokens the host holds as placeholders are taken from ``feed`` on the device.
        """
        ride = self.ride and not canonical and any(c.request.deterministic for c in chunks)
        rows = self._rows(chunks, canonical, ride, probe=keep_logits)
        input_ids, positions, prompt_rows, sample_rows, index = (
            rows.input_ids, rows.positions, rows.prompt_rows, rows.sample_rows, rows.logit_rows
        )
        fed = TokenFeed.check(input_ids, feed)
        layout = self._layout(chunks, block_table, rows)
        invariant = ride or (canonical and self.model.gemms.invariant is not None)
        launched = LaunchedPass(
            list(chunks), canonical, sample_rows, rows.token_rows, positions, [i for _, _, i in prompt_rows]
        )
        sampled_rows = [(chunks[i].request, positions[row]) for row, i in sample_rows] + [(None, 0)] * rows.logit_pad
        # Uploaded before the pass is launched: copies issued after it would wait for the GPU.
        batch = self._sampling_batch(sampled_rows) if sampled_rows else None
        targets, prompt_index_t = (
            upload(self.device, [[t for _, t, _ in prompt_rows], rows.prompt_index], torch.int64)
            if prompt_rows
            else (None, None)
        )
        graphed = self._graph_runs(canonical, bool(prompt_rows), len(input_ids), len(chunks), ride)
        assert not graphed or not canonical or index is None  # the canonical graph computes every row's logits
        keys = [c.request.arrival for c in chunks] + [-1] * bool(rows.pad)
        step = StepInputs(
            input_ids, positions, *layout, canonical, index, rows.canonical_seqs, invariant, keys, graphed
        )
        logits = self.forward(step, fed)
        if logits is None:
            return launched
        if FAULTS.canonical_cross_row and (canonical or ride):  # rows that see their company
            logits = logits + FAULTS.canonical_cross_row * float(sum(input_ids) % 7)
        if canonical:
            if FAULTS.broken_pass_size == len(input_ids):
                logits = logits + 1e-3
            sample_logits = logits
        else:
            if FAULTS.fast_lane_logit_noise:
                logits = self._fast_lane_faults(logits, len(input_ids), chunks, rows)
            sample_logits = logits[len(prompt_rows) :]
        if keep_logits:  # a chunk's sampled rows are consecutive, in chunk order
            counts = Counter(i for _, i in sample_rows)
            first = 0
            for i in range(len(chunks)):
                launched.logits.append(sample_logits[first : first + counts[i]].clone())
                first += counts[i]
        if prompt_rows:
            num_top = max(chunks[i].request.params.prompt_logprobs or 0 for _, _, i in prompt_rows)
            launched.prompt_scored = compute_logprobs(logits[prompt_index_t], targets, num_top)
        if batch is not None:
            sampled = sample(sample_logits, batch)
            launched.tokens = sampled.token_ids
            launched.sampled = sampled
        launched.to_host()
        return launched

    def collect(self, launched: LaunchedPass) -> list[ChunkResult]:
        """Wait for a launched pass and hand each chunk what it produced."""
        launched.wait()
        chunks, positions = launched.chunks, launched.positions
        results = [ChunkResult() for _ in chunks]
        for i, logits in enumerate(launched.logits):
            results[i].logits = logits
        if launched.prompt_scored is not None:
            scored = launched.prompt_scored
            for k, i in enumerate(launched.prompt_owners):
                own_top = chunks[i].request.params.prompt_logprobs or 0
                results[i].prompt_logprobs.append(_position_logprobs(scored, k, own_top))
        if launched.sampled is not None:
            sampled = launched.sampled
            tokens = sampled.token_ids.tolist()
            for k, (row, i) in enumerate(launched.sample_rows):
                r = chunks[i].request
                lp = _position_logprobs(sampled, k, r.params.logprobs) if r.params.logprobs is not None else None
                results[i].samples.append(SampledToken(positions[row], tokens[k], lp))
        return results

    def graphed(self, canonical_size: int) -> bool:
        """Whether a CUDA graph replays canonical passes of this many rows."""
        return self.graphs is not None and self.graphs.has_canonical(canonical_size)

    def _graph_runs(self, canonical: bool, prompt_rows: bool, num_rows: int, num_seqs: int, ride: bool) -> bool:
        """Whether a captured graph computes this pass: canonical passes of a captured size,
        and decode-only fast steps (one row per sequence, no prompt logprobs) up to the
        largest bucket, for riding rows a bucket of a proven size."""
        if canonical:
            return self.graphed(num_rows)
        if self.graphs is None or prompt_rows or num_rows != num_seqs:
            return False
        bucket = self.graphs.bucket(num_rows)
        return bucket is not None and (not ride or bucket in self.canonical.sizes)

    @torch.inference_mode()
    def forward(self, step: StepInputs, fed: TokenFeed | None = None) -> torch.Tensor | None:
        """Every rank's part of a pass: the model over its rows (a captured graph's replay when
        ``step.graphed``), then the logits of ``step.logit_rows`` (None when there are none).
        Rank 0 sends the step to the workers first; ``fed`` resolves placeholder ids (``_resolve``)."""
        with self.workers.running(step) if self.workers is not None else nullcontext():
            if step.graphed:
                return self._replay(step, fed)
            width = step.block_tables.shape[1]
            qsl = step.query_start_loc
            ids, positions, slots, logit_rows = upload(
                self.device, [step.input_ids, step.positions, step.slots, step.logit_rows or []], torch.int64
            )
            self._resolve(ids, step, fed)
            flags = step.canonical_seqs
            seq_lens, query_start_loc, tables, canonical_seqs = upload(
                self.device, [step.seq_lens, qsl, step.block_tables, flags or ()], torch.int32
            )
            q_lens = [qsl[i + 1] - qsl[i] for i in range(len(qsl) - 1)]
            decodes = next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens))
            self.kv_cache.meta = AttentionMetadata(
                slot_mapping=slots,
                block_tables=tables.view(-1, width),
                seq_lens=seq_lens,
                query_start_loc=query_start_loc,
                max_query_len=max(q_lens),
                max_seq_len=max(step.seq_lens),
                num_decodes=decodes,
                canonical=step.canonical if flags is None else canonical_seqs,
                schedules=(True, True) if flags is None else _schedules(flags),
                part_schedules=None if flags is None else (_schedules(flags[:decodes]), _schedules(flags[decodes:])),
            )
            gemms = self.model.gemms
            pieces, rows = self.pieces, len(step.input_ids)
            bucket = pieces.bucket(rows) if pieces is not None and not step.canonical else None
            body, head = self._splits(step, body=bucket is None)
            if pieces is not None and bucket is not None:
                assert pieces.invariant or not step.invariant, "riding rows need pieces on the proven GEMMs"
                pieces.load(ids, positions, slots, bucket)
                hidden = pieces.run(rows, bucket)
            else:
                gemms.select(step.invariant, body, step.canonical)
                hidden = self.model(ids, positions, self.kv_cache)
            if step.logit_rows is None:
                return self.model.compute_logits(hidden)  # every row, padding included
            if not step.logit_rows:
                return None
            gemms.select(step.invariant, head, step.canonical)
            return self.model.compute_logits(hidden[logit_rows])

    def _resolve(self, ids: torch.Tensor, step: StepInputs, fed: TokenFeed | None) -> None:
        """Placeholders among the pass's ids (overlapped scheduling) resolved from ``fed`` on
        rank 0, which broadcasts the resolved ids to the workers on the device: the plan they
        got holds the same placeholders, so every rank knows to take part."""
        if fed is not None:
            fed.resolve(ids)
        # Rank 0 has a feed exactly when its inputs hold placeholders (``TokenFeed.check``);
        # a worker has none, and reads the same placeholders in its plan.
        tp = self.model.tp
        if tp is not None and (fed is not None or (self.workers is None and min(step.input_ids, default=0) < 0)):
            tp.broadcast_from_first(ids)

    def _replay(self, step: StepInputs, fed: TokenFeed | None) -> torch.Tensor | None:
        """The pass from its captured graph: a decode graph computes every row's logits (the
        sampled rows are kept, usually all), a canonical graph every row's, padding included."""
        graphs = self.graphs
        assert graphs is not None, "a plan names a graph this rank has not captured"
        shape = graphs.load(
            step.input_ids, step.positions, np.asarray(step.slots), step.block_tables, step.seq_lens,
            step.query_start_loc, canonical=step.canonical, invariant=step.invariant,
            canonical_seqs=step.canonical_seqs,
        )  # fmt: skip
        self._resolve(graphs.input_ids[: len(step.input_ids)], step, fed)
        index = step.logit_rows
        # Uploaded before the replay: a copy issued behind it could wait for the GPU.
        gather = upload(self.device, [index], torch.int64)[0] if index and index != list(range(len(index))) else None
        logits = graphs.replay(shape)
        if index is None:
            return logits
        if not index:
            return None
        return logits[gather] if gather is not None else logits[: len(index)]

    def _splits(self, step: StepInputs, body: bool) -> tuple[RowSplit | None, RowSplit | None]:
        """The canonical rows of a ride pass (its deterministic sequences'), among all rows
        (when the ``body`` runs eagerly: graphs run every row on the proven paths) and among the
        logit rows: the proven GEMMs run only those (``Gemms.linear``). None where every row is
        canonical, as in canonical passes (and CUDA graphs, ``CUDAGraphs.forward``)."""
        if not step.invariant or step.canonical_seqs is None:
            return None, None
        rows = np.repeat(np.array(step.canonical_seqs, dtype=bool), np.diff(step.query_start_loc))
        if rows.all():
            return None, None
        gemms = self.model.gemms
        head = gemms.split_of(rows[step.logit_rows], self.device) if step.logit_rows else None
        return gemms.split_of(rows, self.device) if body else None, head

    def _fast_lane_faults(
        self, logits: torch.Tensor, num_rows: int, chunks: Sequence[ScheduledChunk], rows: PassRows
    ) -> torch.Tensor:
        """Batch-dependent noise on the fast lane's logits; riding deterministic rows are canonical and keep theirs."""
        gen = torch.Generator(device=self.device).manual_seed(num_rows)
        noise = torch.randn(logits.shape, generator=gen, device=self.device)
        if rows.canonical_seqs is not None:
            owners = [chunks[i].request for _, _, i in rows.prompt_rows] + [
                chunks[i].request for _, i in rows.sample_rows
            ]
            keep = [r.deterministic for r in owners] + [True] * rows.logit_pad
            noise[torch.tensor(keep, device=self.device)] = 0.0
        return logits + FAULTS.fast_lane_logit_noise * noise


def _schedules(flags: Sequence[int]) -> tuple[bool, bool]:
    """(any fast sequence, any canonical one) among per-sequence flags (1 = canonical)."""
    return not all(flags), any(flags)


def _pad_rows(rows: list[int], size: int) -> tuple[list[int], int]:
    """``rows`` padded to ``size`` entries, and how many were added: the next rows when
    ``rows`` are the first ones (a decode graph then keeps a prefix of its logits), else the
    last row again."""
    pad = size - len(rows)
    if rows == list(range(len(rows))):
        return list(range(size)), pad
    return rows + [rows[-1]] * pad, pad
