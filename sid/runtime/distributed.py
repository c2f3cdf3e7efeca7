"""Tensor-parallel process groups: the model's collectives and rank 0's per-step plan channel.

Two groups span the same ranks. The *data* group (NCCL on CUDA, gloo on the CPU) carries
the model's all-reduces and gathers, with a timeout so a hung peer turns into an error.
The *control* group (always gloo, on the CPU) carries rank 0's small plan messages to the
workers; it has no practical timeout, because a worker waits on it for as long as the
engine stays idle.

A canonical pass reduces in a fixed order (DESIGN 3.1): ring all-reduce adds an element's
partial sums in an order that depends on the element's offset, so a row's bits would
depend on its slot. Gathering every rank's partial result and summing them in rank order
makes each element ``x_0 + x_1 + ... + x_{n-1}``, whatever its offset.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta
from itertools import chain

import numpy as np
import torch
import torch.distributed as dist

from sid.runtime.model_runner import StepInputs

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
"""How long a model collective waits for a peer before it fails (a hung worker)."""
_IDLE_TIMEOUT = timedelta(days=365)

STEP, KV_CACHE, STOP, GEMMS = 1, 2, 3, 4
"""Control message kinds: run a forward pass, (re)allocate the KV cache, exit, take the
proven GEMM paths (from the store)."""
_ALL_CANONICAL, _PER_SEQUENCE, _INVARIANT = 1, 2, 4
"""Bits of a step header's flags: every sequence canonical, per-sequence flags follow, row-invariant GEMMs."""
_HEADER = 6
_FIRST = 4096
"""Int64s in a message's first broadcast: a 32 KiB copy costs less than a second round trip."""


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

    def all_gather_cat(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's ``x`` concatenated along ``dim`` in rank order (exact: no arithmetic)."""
        return torch.cat(self._gather(x), dim)

    def _gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return parts


def init_groups(store: dist.Store, rank: int, size: int, device: torch.device) -> dist.ProcessGroup:
    """Join the data group (the default group; rank ``r`` on ``cuda:r``) and return the control group."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=size,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=torch.device("cuda", rank) if device.type == "cuda" else None,
    )
    return dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)


class ControlChannel:
    """Rank 0 -> workers messages: one broadcast of ``_FIRST`` int64s (a header and, for all
    but the largest steps, the whole plan), then the rest of the plan if it did not fit.

    A plan is only the rows' token ids and cache layout (a few integers per row); workers
    need no sampling state, since rank 0 alone samples.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def _broadcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, 0, group=self.group)

    def _send(self, header: list[int], payload: Iterable[int] = ()) -> None:
        message = np.fromiter(chain(header, payload), dtype=np.int64)
        first = np.zeros(_FIRST, dtype=np.int64)
        first[: len(message)] = message[:_FIRST]
        self._broadcast(torch.from_numpy(first))
        if len(message) > _FIRST:
            self._broadcast(torch.from_numpy(message[_FIRST:]))

    def send(self, kind: int, arg: int = 0) -> None:
        self._send([kind, arg, 0, 0, 0, 0])

    def send_step(self, step: StepInputs) -> None:
        width = step.block_tables.shape[1]
        tables = step.block_tables.ravel().tolist()
        n_logits = -1 if step.logit_rows is None else len(step.logit_rows)
        flags = (
            _ALL_CANONICAL * step.canonical
            | _PER_SEQUENCE * (step.canonical_seqs is not None)
            | _INVARIANT * step.invariant
        )
        header = [STEP, len(step.input_ids), len(step.seq_lens), width, n_logits, flags]
        layout = (step.slots, tables, step.seq_lens, step.query_start_loc, step.logit_rows or (), step.canonical_seqs or ())
        self._send(header, chain(step.input_ids, step.positions, *layout))

    def recv(self) -> tuple[int, int | StepInputs]:
        """``(STEP, plan)``, ``(KV_CACHE, num_blocks)``, ``(GEMMS, 0)`` or ``(STOP, 0)``."""
        first = torch.empty(_FIRST, dtype=torch.int64)
        self._broadcast(first)
        kind, n, seqs, width, n_logits, flags = first[:_HEADER].tolist()
        if kind != STEP:
            return kind, n
        cuts = [n, 2 * n, 3 * n, 3 * n + seqs * width, 3 * n + seqs * (width + 1), 3 * n + seqs * (width + 2) + 1]
        cuts.append(cuts[-1] + max(n_logits, 0))
        size = _HEADER + cuts[-1] + (seqs if flags & _PER_SEQUENCE else 0)
        message = first
        if size > _FIRST:
            rest = torch.empty(size - _FIRST, dtype=torch.int64)
            self._broadcast(rest)
            message = torch.cat([first, rest])
        values = message[_HEADER:size].tolist()
        ids, positions, slots, tables, seq_lens, qsl, logit_rows = (values[a:b] for a, b in zip([0, *cuts], cuts))
        return STEP, StepInputs(
            input_ids=ids,
            positions=positions,
            slots=slots,
            block_tables=np.array(tables, dtype=np.int32).reshape(seqs, width),
            seq_lens=seq_lens,
            query_start_loc=qsl,
            canonical=bool(flags & _ALL_CANONICAL),
            logit_rows=None if n_logits < 0 else logit_rows,
            canonical_seqs=values[cuts[-1] :] if flags & _PER_SEQUENCE else None,
            invariant=bool(flags & _INVARIANT),
        )
