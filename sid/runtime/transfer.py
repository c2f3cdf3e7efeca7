"""Host-to-device copies of a step's small integer and float lists, batched.

Every ``torch.tensor(list, device="cuda")`` is a separate copy from pageable memory with a
driver round trip of tens of microseconds, and a step needs a dozen such lists; packing them
into one copy per dtype keeps the host's share of a decode step small. Lists become arrays
with ``numpy.fromiter``, about 4x faster than ``torch.tensor`` on a Python list; block
tables arrive as arrays already (``BlockTables``). The buffer is pinned: a copy from
pageable memory waits for the stream, which would stall the host behind the pass in flight.
It is allocated pinned and filled by numpy, not pinned by ``Tensor.pin_memory()``, whose copy
of more than 32,768 elements (a long-tailed batch's block tables) is split over torch's
intra-op threads every step.
Every view starts on a 16-byte boundary: Triton specialises a kernel on whether each pointer
argument is 16-byte aligned, so views at arbitrary offsets made the attention kernel compile
new variants mid-run (1.5-2 s each, several per run; Qwen3-0.6B on the H200).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate

import numpy as np
import torch

_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}
_ALIGN_BYTES = 16


def upload(
    device: torch.device, parts: Sequence[Sequence[int] | Sequence[float] | np.ndarray], dtype: torch.dtype
) -> list[torch.Tensor]:
    """``parts`` (lists, or arrays taken whole, flattened) as 1-D tensors on ``device``
    (16-byte aligned views of one buffer), in one copy."""
    kind = _NUMPY[dtype]
    arrays = [
        p.astype(kind, copy=False).ravel() if isinstance(p, np.ndarray) else np.fromiter(p, kind, len(p)) for p in parts
    ]
    align = _ALIGN_BYTES // np.dtype(kind).itemsize
    starts = list(accumulate((-(-a.size // align) * align for a in arrays), initial=0))
    host = torch.empty(starts[-1], dtype=dtype, pin_memory=device.type == "cuda")
    packed = host.numpy()  # filled by numpy: the gaps between parts are never read
    for start, a in zip(starts, arrays):
        packed[start : start + a.size] = a
    buffer = host.to(device, non_blocking=True)
    return [buffer[start : start + a.size] for start, a in zip(starts, arrays)]
