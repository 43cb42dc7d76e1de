"""Top-k sparsification with error feedback: selection, gather (optionally quantized), scatter-add.

Encoding one tensor (:func:`topk_encode`):

1. ``acc = x + residual`` (fp32);
2. select the ``k`` largest ``|acc|`` (``torch.topk``; indices then sorted ascending, so the message
   is deterministic and the scatter on decode walks memory forward), sent as int32 when the tensor
   has fewer than 2**31 elements;
3. gather ``values = acc[indices]``, sent as fp32, or quantized with the block format of
   :mod:`fastml_strategy.kernels.reference` (``bits``; blocks run over the k values);
4. new residual = ``acc`` with the sent part removed: 0 at the selected indices (fp32 values), or the
   quantization error ``values - decoded`` there (quantized values).

A NaN or an inf in ``acc`` is always selected (``torch.topk`` ranks NaN above everything, and
``|inf|`` above every finite value), so it reaches every rank; the residual is then left unchanged,
as for the quantize codec.

Decoding (:func:`topk_decode_add`) adds one message into an fp32 buffer: ``out[indices] += values``.
Indices are unique within a message, so each element receives one addition: the result is exact and
deterministic on every backend (Triton's atomics included); messages from several ranks are added
one after the other, in rank order, so every replica computes the same sum. With quantized values the
Triton and CPU backends decode and scatter in one pass.

How it differs from the usual top-k: nothing here is top-k-specific beyond the selection; the
quantized variant reuses the quantize kernels unchanged on the gathered values.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from fastml_strategy.kernels import quantize, resolve_backend
from fastml_strategy.kernels.reference import dequantize_reference

__all__ = ["TopK", "topk_encode", "topk_decode_add", "topk_select"]


class TopK(NamedTuple):
    """One encoded tensor: ``indices`` (int32, or int64 past 2**31 elements), and either ``values``
    (fp32) or the quantized ``packed`` / ``meta`` of the values (``bits`` per value)."""

    indices: torch.Tensor
    values: torch.Tensor | None
    packed: torch.Tensor | None
    meta: torch.Tensor | None
    numel: int
    bits: int | None
    block_size: int


def topk_select(acc: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, ascending) of the ``k`` largest ``|acc|``."""
    idx = torch.topk(acc.abs(), k, sorted=False).indices
    return idx.sort().values


def topk_encode(
    x: torch.Tensor,
    k: int,
    bits: int | None = None,
    block_size: int = 512,
    stochastic: bool = False,
    seed: int = 0,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    backend: str | None = None,
) -> TopK:
    """Top-``k`` of ``x + residual`` by magnitude; see the module docstring.

    ``residual`` (fp32, same length as ``x``): error feedback; the new residual goes to
    ``residual_out`` (default: ``residual`` in place). ``bits`` (1-8): quantize the values, with
    ``block_size``, ``stochastic`` and ``seed`` as in :func:`fastml_strategy.kernels.quantize`.
    """
    x = x.reshape(-1)
    n = x.numel()
    if not 0 < k <= n:
        raise ValueError(f"topk_encode: k={k} must be in [1, {n}] (the tensor's size)")
    acc = torch.add(x, residual.reshape(-1)) if residual is not None else x.to(torch.float32)
    idx = topk_select(acc, k)
    values = acc.index_select(0, idx)
    packed = meta = None
    err = None
    if bits is not None:
        err = torch.zeros(k, dtype=torch.float32, device=x.device)
        packed, meta = quantize(values, bits, block_size, stochastic, seed, residual=err, backend=backend)
    if residual is not None:
        new = acc.index_fill_(0, idx, 0.0) if err is None else acc.index_copy_(0, idx, err)
        dst = (residual if residual_out is None else residual_out).reshape(-1)
        ok = torch.isfinite(values).all()
        if meta is not None:  # quantized values: a block spanning more than fp32's range decodes to NaN
            ok = ok & torch.isfinite(meta).all()
        if x.is_cuda:
            dst.copy_(torch.where(ok, new, residual.reshape(-1)))  # no host sync
        elif bool(ok):
            dst.copy_(new)
        elif dst.data_ptr() != residual.data_ptr():
            dst.copy_(residual.reshape(-1))
    ind = idx.to(torch.int32) if n < 2**31 else idx
    return TopK(ind, values if bits is None else None, packed, meta, n, bits, block_size)


def topk_decode_add(
    out: torch.Tensor,
    indices: torch.Tensor,
    values: torch.Tensor | None = None,
    *,
    packed: torch.Tensor | None = None,
    meta: torch.Tensor | None = None,
    bits: int | None = None,
    block_size: int = 512,
    backend: str | None = None,
) -> torch.Tensor:
    """``out[indices] += values`` (fp32 ``out``, flat), with ``values`` given, or decoded from
    ``packed`` / ``meta`` / ``bits`` / ``block_size``. ``indices`` must be unique (one message).

    Accepts a :class:`TopK` spread as ``topk_decode_add(out, t.indices, t.values, packed=t.packed,
    meta=t.meta, bits=t.bits, block_size=t.block_size)``.
    """
    if out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("topk_decode_add: out must be a contiguous float32 tensor")
    flat = out.view(-1)
    k = indices.numel()
    if k == 0:
        return out
    be = resolve_backend(out, backend)
    if values is None:
        if packed is None or meta is None or bits is None:
            raise ValueError("topk_decode_add: give values, or packed, meta and bits")
        if be == "triton":
            from fastml_strategy.kernels import quantize_triton

            quantize_triton.dequantize_scatter_add(flat, indices, packed, meta, bits, block_size)
            return out
        if be == "cpu":
            from fastml_strategy.kernels import cpu

            cpu.dequantize_scatter_add(flat, indices, packed, meta, bits, block_size)
            return out
        values = dequantize_reference(packed, meta, k, bits, block_size)
    if be == "triton":
        from fastml_strategy.kernels import quantize_triton

        quantize_triton.scatter_add(flat, indices, values.to(torch.float32))
        return out
    flat.index_add_(0, indices.reshape(-1), values.reshape(-1).to(torch.float32))
    return out
