"""Tensor-parallel process groups, and rank 0's per-step plan channel.

The *data* group (NCCL on CUDA, gloo on the CPU) carries the model's all-reduces and
gathers, with a timeout so a hung peer turns into an error.

Plans do not travel through a process group. Every rank runs on one host (rank 0 starts
the workers), so rank 0 writes each plan into one pipe per worker: the write returns as
soon as the kernel has the bytes (rank 0 never waits for a worker to pick a plan up), and
a worker blocked in ``read`` wakes as soon as they land. A gloo broadcast went through
gloo's I/O threads on both ends and cost a round trip per plan (``benchmarks/tp_plan.py``).
A worker that dies turns rank 0's next write into ``BrokenPipeError``; a rank 0 that dies
gives its workers an end of file, and they exit.

A canonical pass reduces in a fixed order (DESIGN 3.1): ring all-reduce adds an element's
partial sums in an order that depends on the element's offset, so a row's bits would
depend on its slot. Gathering every rank's partial result and summing them in rank order
makes each element ``x_0 + x_1 + ... + x_{n-1}``, whatever its offset.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from sid.runtime.gemm import tree_sum
from sid.runtime.model_runner import StepInputs

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
"""How long the store waits for a peer; the engine's collectives wait ``collective_timeout_s``."""

STEP, KV_CACHE, STOP, GEMMS, GRAPHS = 1, 2, 3, 4, 5
"""Control message kinds: run a forward pass, (re)allocate the KV cache, exit, take the
proven GEMM paths (from the store), capture the CUDA graphs (their spec in the store)."""
_ALL_CANONICAL, _PER_SEQUENCE, _INVARIANT, _ALL_LOGITS, _GRAPHED = 1, 2, 4, 8, 16
"""Bits of a step header's flags: every sequence canonical, per-sequence flags follow,
row-invariant GEMMs, every row's logits (``logit_rows`` is None), a captured graph runs it."""
_HEADER = 8
"""A message's first int64s: kind, rows (or the argument), sequences, table width, logit
rows, flags, patched table entries, and how many int64s follow."""


class TPGroup:
    """This process's place in the tensor-parallel group, and the collectives the model uses."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce_sum(self, x: torch.Tensor, canonical: bool) -> torch.Tensor:
        """Sum of ``x`` over the ranks; in a fixed rank order when ``canonical``."""
        if not canonical:
            dist.all_reduce(x)
            return x
        out, *rest = self._gather(x)
        for part in rest:
            out = out + part
        return out

    def all_reduce_tree(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, added as a balanced tree in rank order (TP-invariant
        chunks: the top of the tree whose leaves are the K chunks)."""
        return tree_sum(self._gather(x))

    def all_gather_cat(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (exact: no arithmetic)."""
        return torch.cat(self._gather(x), dim)

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as rank 0 holds it, in place on every rank (on the device: no host round trip)."""
        dist.broadcast(x, src=0)
        return x

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return parts


def init_group(store: dist.Store, rank: int, size: int, device: torch.device, timeout: timedelta) -> None:
    """Join the data group (the default group; rank ``r`` on ``cuda:r``); a collective that
    waits longer than ``timeout`` for a peer fails."""
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        store=store,
        rank=rank,
        world_size=size,
        timeout=timeout,
        device_id=torch.device("cuda", rank) if device.type == "cuda" else None,
    )


@dataclass
class TableState:
    """The block table of the last plan, which both ends hold, so that a plan carries a
    sequence's row only as the entries that changed since that sequence's last step."""

    table: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))
    rows: dict[int, int] = field(default_factory=dict)
    """Rank 0 only: each sequence key of the last plan -> its row in ``table``."""

    def predict(self, src: np.ndarray, width: int) -> np.ndarray:
        """Rows of the last table (``src``; zeros where -1), cut or zero-padded to ``width``."""
        out = np.zeros((len(src), width), dtype=np.int32)
        known = src >= 0
        w = min(width, self.table.shape[1])
        out[known, :w] = self.table[src[known], :w]
        return out


class _Buffer:
    """A growing int64 array, reused by every message."""

    def __init__(self, size: int = 1 << 14) -> None:
        self.array = np.zeros(size, dtype=np.int64)

    def fit(self, size: int) -> np.ndarray:
        if size > len(self.array):
            self.array = np.zeros(max(size, 2 * len(self.array)), dtype=np.int64)
        return self.array


class ControlChannel:
    """Rank 0's end: plans written to one pipe per worker (``fds``, write ends).

    A step plan is the rows' token ids and cache layout (workers need no sampling state:
    rank 0 alone samples). Block tables go as patches: a sequence that was in the last plan
    (``StepInputs.seq_keys``) sends only its entries that changed (a decode step: a new
    block every ``block_size`` tokens), a new one its whole row.
    """

    def __init__(self, fds: Sequence[int]) -> None:
        self.fds = list(fds)
        self.buffer = _Buffer()
        self.tables = TableState()
        self.ints_sent = 0
        """Int64s written per worker so far (headers included)."""

    def send(self, kind: int, arg: int = 0) -> None:
        message = self.buffer.fit(_HEADER)
        message[:_HEADER] = (kind, arg, 0, 0, 0, 0, 0, 0)
        self._write(message[:_HEADER])

    def send_step(self, step: StepInputs) -> None:
        table = step.block_tables
        seqs, width = table.shape
        keys = step.seq_keys
        assert len(keys) == seqs, "rank 0's plans name every sequence (StepInputs.seq_keys)"
        rows = self.tables.rows
        src = np.fromiter((rows.get(k, -1) for k in keys), dtype=np.int64, count=seqs)
        patched = src >= 0
        changed = np.flatnonzero((table != self.tables.predict(src, width)) & patched[:, None])
        flat = table.reshape(-1)
        n, logit_rows, per_seq = len(step.input_ids), step.logit_rows, step.canonical_seqs
        flags = (
            _ALL_CANONICAL * step.canonical
            | _PER_SEQUENCE * (per_seq is not None)
            | _INVARIANT * step.invariant
            | _ALL_LOGITS * (logit_rows is None)
            | _GRAPHED * step.graphed
        )
        parts = (
            step.input_ids,
            step.positions,
            step.slots,
            step.seq_lens,
            step.query_start_loc,
            logit_rows or (),
            per_seq or (),
            src,
            table[~patched].reshape(-1),
            changed,
            flat[changed],
        )
        size = _HEADER + sum(len(p) for p in parts)
        message = self.buffer.fit(size)
        message[:_HEADER] = (STEP, n, seqs, width, len(logit_rows or ()), flags, len(changed), size - _HEADER)
        at = _HEADER
        for part in parts:
            message[at : at + len(part)] = part
            at += len(part)
        self._write(message[:size])
        self.tables.table = table.copy()
        self.tables.rows = {k: i for i, k in enumerate(keys)}

    def _write(self, message: np.ndarray) -> None:
        self.ints_sent += len(message)
        data = memoryview(message).cast("B")
        for fd in self.fds:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])

    def close(self) -> None:
        """Close the pipes: a worker still reading sees the end of its input and exits."""
        for fd in self.fds:
            os.close(fd)
        self.fds = []


class ControlReceiver:
    """A worker's end: rank 0's messages read from the pipe ``fd``, block tables rebuilt
    from their patches."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.header = np.zeros(_HEADER, dtype=np.int64)
        self.buffer = _Buffer()
        self.tables = TableState()

    def _read(self, into: np.ndarray) -> bool:
        """Fill ``into`` from the pipe; False at the end of input (rank 0 is gone)."""
        view = memoryview(into).cast("B")
        done = 0
        while done < len(view):
            got = os.readv(self.fd, [view[done:]])
            if got == 0:
                return False
            done += got
        return True

    def recv(self) -> tuple[int, int | StepInputs]:
        """``(STEP, plan)``, ``(KV_CACHE, num_blocks)``, ``(GEMMS, 0)``, ``(GRAPHS, 0)`` or ``(STOP, 0)``
        (also at the end of input)."""
        if not self._read(self.header):
            return STOP, 0
        kind, n, seqs, width, n_logits, flags, n_changed, body = self.header.tolist()
        if kind != STEP:
            return kind, n
        message = self.buffer.fit(body)[:body]
        if not self._read(message):
            return STOP, 0
        at = 0

        def take(count: int) -> np.ndarray:
            nonlocal at
            at += count
            return message[at - count : at]

        ids, positions, slots = take(n).tolist(), take(n).tolist(), take(n).copy()
        seq_lens, qsl, logit_rows = take(seqs).tolist(), take(seqs + 1).tolist(), take(n_logits).tolist()
        per_seq = take(seqs).tolist() if flags & _PER_SEQUENCE else None
        src = take(seqs)
        fresh = src < 0
        table = self.tables.predict(src, width)
        table[fresh] = take(int(fresh.sum()) * width).reshape(-1, width)
        where, values = take(n_changed), take(n_changed)
        np.put(table, where, values)
        self.tables.table = table
        return STEP, StepInputs(
            input_ids=ids,
            positions=positions,
            slots=slots,
            block_tables=table,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            canonical=bool(flags & _ALL_CANONICAL),
            logit_rows=None if flags & _ALL_LOGITS else logit_rows,
            canonical_seqs=per_seq,
            invariant=bool(flags & _INVARIANT),
            graphed=bool(flags & _GRAPHED),
        )
