"""The batched host-to-device copy: values intact, every view 16-byte aligned (Triton
specialises kernels on pointer alignment, so a misaligned view compiles another variant)."""

import numpy as np
import pytest
import torch

from sid.runtime.transfer import upload


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.float32])
def test_upload_keeps_values_in_aligned_views_of_one_buffer(dtype: torch.dtype) -> None:
    parts = [[1, 2, 3], np.arange(5).reshape(1, 5), [], [7], list(range(9))]
    views = upload(torch.device("cpu"), parts, dtype)
    for part, view in zip(parts, views):
        expected = torch.tensor(np.asarray(part, dtype=np.float64).ravel(), dtype=dtype)
        assert view.dtype == dtype and torch.equal(view, expected)
        assert view.data_ptr() % 16 == 0
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1
