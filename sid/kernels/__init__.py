"""Kernels: Triton kernels and the torch references they are tested against.

The Triton kernels run on CUDA only. Triton is the ``gpu`` extra (CUDA builds of torch bring
it too), so a CPU-only install has none and imports only the references.
"""

from importlib.util import find_spec

HAS_TRITON = find_spec("triton") is not None


def triton_version() -> str | None:
    """Triton's version for the numerics fingerprint; None where it is not installed."""
    if not HAS_TRITON:
        return None
    import triton

    return triton.__version__
