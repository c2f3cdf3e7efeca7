"""Triton launches repeated with arguments that specialise alike, at the launcher's host cost.

Triton's JIT call (``kernel[grid](*args, **constants)``) binds and specialises every argument
and looks the compiled kernel up again at each launch. With ``_attention_kernel``'s 62
parameters that cost 70-117 us of host time a launch on the H200's host, against 17-44 us
through the compiled kernel's own launcher (``CompiledKernel[grid](*args)``, TMA descriptors
filled in both; Qwen3-0.6B heads, a prompt step's launches; 2026-12-04). A prompt step runs
each layer's attention eagerly between its CUDA graph pieces, every layer with the launches
of one plan, so a small model's prompt step was host-bound on them.

``Relaunch`` keeps, per kernel, the compiled kernel that a JIT call returned and what Triton
specialised it on: each tensor's dtype and 16-byte alignment, each descriptor's layout, and
every other argument's value, options included. A later call whose arguments match launches
that kernel directly; any other goes through the JIT call, which finds or compiles the right
kernel, and is then the one kept. Matching values is stricter than Triton's own
specialisation (an integer's value decides only whether it is 1 or a multiple of 16), so a
direct launch always runs the kernel the JIT call would have chosen. Under the interpreter a
JIT call returns no compiled kernel, and every call goes through it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from triton.compiler.compiler import CompiledKernel
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

_DESCRIPTORS = (TensorDescriptor, GluonTensorDescriptor)
"""Host-side TMA descriptors: Triton's, and Gluon's, which carry their shared-memory layout."""


class _Layout(NamedTuple):
    """Where a call's tensors, descriptors and other arguments sit among its positional ones."""

    types: tuple[type, ...]
    tensors: tuple[int, ...]
    descriptors: tuple[int, ...]
    others: Callable[[Sequence[Any]], tuple[Any, ...]]

    @classmethod
    def of(cls, args: Sequence[Any]) -> _Layout:
        kinds = [torch.Tensor if isinstance(a, torch.Tensor) else TensorDescriptor if isinstance(a, _DESCRIPTORS)
                 else None for a in args]  # fmt: skip
        others = [i for i, k in enumerate(kinds) if k is None]
        return cls(
            tuple(map(type, args)),
            tuple(i for i, k in enumerate(kinds) if k is torch.Tensor),
            tuple(i for i, k in enumerate(kinds) if k is TensorDescriptor),
            # ``itemgetter`` returns a lone item bare
            operator.itemgetter(*others) if len(others) > 1 else lambda args: tuple(args[i] for i in others),
        )

    def key(self, args: Sequence[Any]) -> tuple[Any, ...]:
        """What Triton specialises a kernel on, and more (module doc), of arguments whose types
        are ``types``."""
        descriptors = (args[i] for i in self.descriptors)
        return (
            self.others(args),
            tuple((args[i].dtype, args[i].data_ptr() % 16 == 0) for i in self.tensors),
            tuple((d.base.dtype, *d.shape, *d.strides, *d.block_shape, getattr(d, "layout", 0)) for d in descriptors),
        )


class _Known(NamedTuple):
    """A kernel a JIT call returned, and the key of the arguments it serves."""

    compiled: CompiledKernel
    constants: dict[str, Any]
    constexprs: tuple[Any, ...]
    """The constant arguments' values, in the kernel's parameter order after the others."""
    layout: _Layout
    key: tuple[Any, ...]


class Relaunch:
    """One launch site's compiled kernels (module doc): a plan's launch, run by every layer."""

    def __init__(self) -> None:
        self._known: dict[JITFunction, _Known] = {}
        self.direct = 0
        """Launches that skipped the JIT call (the tests read it)."""

    def __call__(
        self, kernel: JITFunction, grid: tuple[int, ...], args: Sequence[Any], constants: dict[str, Any]
    ) -> None:
        """``kernel[grid](*args, **constants)``: ``args`` the parameters passed by position,
        ``constants`` the rest (compile-time constants) and the launch options."""
        known = self._known.get(kernel)
        if (
            known is not None
            and constants == known.constants
            and tuple(map(type, args)) == known.layout.types
            and known.layout.key(args) == known.key
        ):
            known.compiled[(*grid, 1, 1)[:3]](*args, *known.constexprs)  # the launcher reads three axes
            self.direct += 1
            return
        compiled = kernel[grid](*args, **constants)
        if not isinstance(compiled, CompiledKernel):  # the interpreter
            return
        layout = _Layout.of(args)
        constexprs = tuple(constants[name] for name in kernel.arg_names[len(args) :])
        self._known[kernel] = _Known(compiled, dict(constants), constexprs, layout, layout.key(args))
