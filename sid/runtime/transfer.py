"""Host-to-device copies of a step's small integer and float lists, batched.

Every ``torch.tensor(list, device="cuda")`` is a separate copy from pageable memory with a
driver round trip of tens of microseconds, and a step needs a dozen such lists; packing them
into one copy per dtype keeps the host's share of a decode step small.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain

import torch


def upload(device: torch.device, parts: Sequence[Sequence[int] | Sequence[float]], dtype: torch.dtype) -> list[torch.Tensor]:
    """``parts`` as 1-D tensors on ``device`` (views of one buffer), in one copy."""
    flat = torch.tensor(list(chain.from_iterable(parts)), dtype=dtype)
    return list(flat.to(device).split([len(p) for p in parts]))


def padded_table(tables: Sequence[Sequence[int]], width: int, rows: int | None = None) -> list[int]:
    """Block tables flattened row by row, each padded with zeros to ``width``, plus all-zero
    rows up to ``rows``."""
    flat = [b for t in tables for b in chain(t, [0] * (width - len(t)))]
    return flat + [0] * (width * ((rows or len(tables)) - len(tables)))
