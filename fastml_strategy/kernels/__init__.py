"""Encode/decode kernels of FastML's codecs, each beside its pure-torch reference.

``quantize`` / ``dequantize`` implement the wire format documented in
:mod:`fastml_strategy.kernels.reference`. ``backend=None`` picks Triton for CUDA tensors (where Triton
works) and the torch reference otherwise; ``"triton"`` and ``"torch"`` force one.
"""

from __future__ import annotations

import torch

from fastml_strategy.kernels.reference import (
    dequantize_reference,
    num_blocks,
    packed_nbytes,
    quantize_reference,
    uniform,
)

__all__ = ["quantize", "dequantize", "packed_nbytes", "num_blocks", "uniform", "resolve_backend"]

_BACKENDS = ("torch", "triton")


def resolve_backend(t: torch.Tensor, backend: str | None) -> str:
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}; use None (automatic), 'torch' or 'triton'")
    if backend is not None:
        return backend
    return "torch"


def quantize(
    x: torch.Tensor,
    bits: int,
    block_size: int = 512,
    stochastic: bool = False,
    seed: int = 0,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to ``bits`` per element: returns ``(packed uint8, meta fp32[nblocks, 2])``."""
    be = resolve_backend(x, backend)
    if be == "triton":
        from fastml_strategy.kernels import quantize_triton

        return quantize_triton.quantize(x, bits, block_size, stochastic, seed, residual, residual_out)
    return quantize_reference(x, bits, block_size, stochastic, seed, residual, residual_out)


def dequantize(
    packed: torch.Tensor,
    meta: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int = 512,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode ``numel`` fp32 values (into ``out``, added to it when ``accumulate``)."""
    be = resolve_backend(packed, backend)
    if be == "triton":
        from fastml_strategy.kernels import quantize_triton

        return quantize_triton.dequantize(packed, meta, numel, bits, block_size, out, accumulate)
    return dequantize_reference(packed, meta, numel, bits, block_size, out, accumulate)
