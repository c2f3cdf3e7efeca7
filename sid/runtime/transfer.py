"""Host-to-device copies of a step's small integer and float lists, batched.

Every ``torch.tensor(list, device="cuda")`` is a separate copy from pageable memory with a
driver round trip of tens of microseconds, and a step needs a dozen such lists; packing them
into one copy per dtype keeps the host's share of a decode step small. The host buffer is
built with ``numpy.fromiter``, about 4x faster than ``torch.tensor`` on a Python list
(measured on 256 block tables: 0.34 vs 1.4 ms). The buffer is pinned: a copy from pageable
memory waits for the stream, which would stall the host behind the pass in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def upload(device: torch.device, parts: Sequence[Sequence[int] | Sequence[float]], dtype: torch.dtype) -> list[torch.Tensor]:
    """``parts`` as 1-D tensors on ``device`` (views of one buffer), in one copy."""
    sizes = [len(p) for p in parts]
    host = torch.from_numpy(np.fromiter(chain.from_iterable(parts), _NUMPY[dtype], sum(sizes)))
    if device.type == "cuda":
        host = host.pin_memory()
    return list(host.to(device, non_blocking=True).split(sizes))


def padded_table(tables: Sequence[Sequence[int]], width: int, rows: int | None = None) -> list[int]:
    """Block tables flattened row by row, each padded with zeros to ``width``, plus all-zero
    rows up to ``rows``."""
    flat = [b for t in tables for b in chain(t, [0] * (width - len(t)))]
    return flat + [0] * (width * ((rows or len(tables)) - len(tables)))
