"""Triton kernels of the quantization codec: fused quantize + bit-pack + error feedback, and unpack +
dequantize (+ accumulate). The wire format is the one :mod:`fastml_strategy.kernels.reference` defines;
these kernels reproduce its bytes exactly.

How the encoder works, per program (``G`` blocks of ``BS`` elements, held as a ``[G, BS/8, 8]`` tile so
that every group of 8 codes fills exactly ``bits`` bytes):

1. load ``x`` (any float dtype, converted to fp32 at once: the interpreter's bf16 arithmetic is wrong)
   and the residual, ``v = x + r``;
2. per block: ``min``, ``max`` and a non-finite flag (a NaN slips through ``tl.min``/``tl.max``, so it is
   counted separately), the scale and its inverse with correctly rounded division (``div_rn``: Triton's
   ``/`` may lower to an approximate division);
3. per element: ``q = clamp(floor((v - mn) * inv + u), 0, L)`` (``u`` = 0.5, or the reference's
   counter-based hash in uint32 arithmetic), then ``y = mn + q * scale`` and the new residual ``v - y``;
4. 8 codes are OR-ed into one word (``bits * 8`` <= 64 bits) and its low ``bits`` bytes stored.

One pass reads ``x`` and the residual and writes the payload, the metadata and the new residual: for
int4 with error feedback 12.5 bytes per element, against 8 for a copy. The decoder mirrors it: load
``bits`` bytes per 8 codes, split, ``y = mn + q * scale``, store or add into ``out``.

Bit-exactness needs IEEE fp32 with one rounding per operation: kernels are launched with
``enable_fp_fusion=False`` (Triton contracts ``a * b + c`` into an FMA by default) and divide with
``tl.math.div_rn``.

Launch parameters (no ``@triton.autotune``: it needs a driver, so it fails in the interpreter): on
CUDA, ``G * BS`` = 2048 elements per program and 4 warps (16 fp32 per thread: a few 16-byte loads
in flight per thread, enough programs to fill an H200's 132 SMs from 10 MB up); under the
interpreter (about 1.4 ms per program whatever its size, numpy doing the work) 64 Ki elements per
program. ``benchmarks/bench_codecs.py --device cuda --sweep`` measures the alternatives.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastml_strategy.kernels.reference import HASH_GOLDEN, HASH_M1, HASH_M2, FLT_MAX, num_blocks, packed_nbytes

__all__ = ["quantize", "dequantize", "dequantize_scatter_add", "scatter_add", "is_available"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Elements per program. CUDA: 2048 (see module docstring); interpreter: as few programs as possible.
_CUDA_ELEMS_PER_PROGRAM = int(os.environ.get("FASTML_TRITON_ELEMS", "2048"))
_CUDA_NUM_WARPS = int(os.environ.get("FASTML_TRITON_WARPS", "4"))
_INTERP_ELEMS_PER_PROGRAM = 1 << 16

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def is_available(t: torch.Tensor | None = None) -> bool:
    """Whether the kernels can run on ``t``'s device: CUDA with a working driver, or the interpreter."""
    if _INTERPRET:
        return True
    return t is not None and t.is_cuda


@triton.jit
def _hash_uniform(idx, seed_s):
    # The reference's uniform(seed, idx): lowbias32 of (idx + seed * golden) mod 2**32, top 24 bits.
    h = idx.to(tl.uint32) + seed_s
    h = h ^ (h >> 16)
    h = h * tl.full([1], 0x7FEB352D, tl.uint32)
    h = h ^ (h >> 15)
    h = h * tl.full([1], 0x846CA68B, tl.uint32)
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _quantize_kernel(
    x_ptr, r_ptr, rout_ptr, packed_ptr, meta_ptr,
    n, nblocks, nbytes, seed_s,
    BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
    HAS_RES: tl.constexpr, RES_INPLACE: tl.constexpr, STOCH: tl.constexpr,
):
    LF: tl.constexpr = (1 << BITS) - 1
    WORD: tl.constexpr = tl.uint32 if BITS <= 4 else tl.uint64
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * G + tl.arange(0, G)  # [G]
    grp = tl.arange(0, BS // 8)
    lane = tl.arange(0, 8)
    offs = blk[:, None, None] * BS + grp[None, :, None] * 8 + lane[None, None, :]  # [G, BS/8, 8]
    mask = offs < n

    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + offs, mask=mask, other=0.0)
        v = v + r

    # Block statistics. NaN is invisible to min/max here, so count non-finite elements apart.
    bad_el = mask & ~(tl.abs(v) <= FLT_MAX)
    bad = tl.max(tl.max(bad_el.to(tl.int32), axis=2), axis=1) > 0  # [G]
    mn = tl.min(tl.min(tl.where(mask, v, float("inf")), axis=2), axis=1)
    mx = tl.max(tl.max(tl.where(mask, v, float("-inf")), axis=2), axis=1)
    scale = tl.math.div_rn(mx - mn, LF * 1.0)
    # Representable (format step 2): the top code decodes to a finite number (not so when max - min
    # exceeds fp32's range). Launched without FP fusion, so this is a multiply then an add.
    top = mn + (LF * 1.0) * scale
    bad = bad | ~(tl.abs(top) <= FLT_MAX)
    pos = scale > 0
    inv = tl.where(pos, tl.math.div_rn(tl.full([G], 1.0, tl.float32), tl.where(pos, scale, 1.0)), 0.0)
    mn_q = tl.where(bad, 0.0, mn)
    inv = tl.where(bad, 0.0, inv)

    t = (v - mn_q[:, None, None]) * inv[:, None, None]
    if STOCH:
        t = t + _hash_uniform(offs, seed_s)
    else:
        t = t + 0.5
    t = tl.floor(t)
    q = tl.where(t >= 0.0, tl.where(t <= LF, t, LF * 1.0), 0.0)  # clamp; NaN -> 0
    keep = mask & ~bad[:, None, None]
    q = tl.where(keep, q, 0.0)

    if HAS_RES:
        y = mn_q[:, None, None] + q * scale[:, None, None]
        tl.store(rout_ptr + offs, v - y, mask=keep)
        if not RES_INPLACE:  # non-finite blocks keep their old residual
            tl.store(rout_ptr + offs, r, mask=mask & bad[:, None, None])

    bmask = blk < nblocks
    nan = float("nan")
    tl.store(meta_ptr + blk * 2, tl.where(bad, nan, mn), mask=bmask)
    tl.store(meta_ptr + blk * 2 + 1, tl.where(bad, nan, scale), mask=bmask)

    # Pack: 8 codes -> one word of 8*BITS bits -> its low BITS bytes.
    qi = q.to(WORD)
    word = tl.sum(qi << (lane * BITS).to(WORD)[None, None, :], axis=2)  # [G, BS/8], disjoint bits
    shift = tl.where(lane < BITS, lane * 8, 0).to(WORD)
    byte = ((word[:, :, None] >> shift[None, None, :]) & 0xFF).to(tl.uint8)
    boffs = blk[:, None, None] * (BS * BITS // 8) + grp[None, :, None] * BITS + lane[None, None, :]
    tl.store(packed_ptr + boffs, byte, mask=(lane < BITS)[None, None, :] & (boffs < nbytes))


@triton.jit
def _dequantize_kernel(
    packed_ptr, meta_ptr, out_ptr, idx_ptr,
    n, nblocks, nbytes,
    BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr,
    ACC: tl.constexpr, INDEXED: tl.constexpr,
):
    LF: tl.constexpr = (1 << BITS) - 1
    WORD: tl.constexpr = tl.uint32 if BITS <= 4 else tl.uint64
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * G + tl.arange(0, G)
    grp = tl.arange(0, BS // 8)
    lane = tl.arange(0, 8)
    boffs = blk[:, None, None] * (BS * BITS // 8) + grp[None, :, None] * BITS + lane[None, None, :]
    b = tl.load(packed_ptr + boffs, mask=(lane < BITS)[None, None, :] & (boffs < nbytes), other=0)
    shift = tl.where(lane < BITS, lane * 8, 0).to(WORD)
    word = tl.sum(b.to(WORD) << shift[None, None, :], axis=2)  # [G, BS/8]
    q = (word[:, :, None] >> (lane * BITS).to(WORD)[None, None, :]) & LF
    bmask = blk < nblocks
    mn = tl.load(meta_ptr + blk * 2, mask=bmask, other=0.0)
    sc = tl.load(meta_ptr + blk * 2 + 1, mask=bmask, other=0.0)
    y = mn[:, None, None] + q.to(tl.float32) * sc[:, None, None]
    offs = blk[:, None, None] * BS + grp[None, :, None] * 8 + lane[None, None, :]
    mask = offs < n
    if INDEXED:
        # Scatter-add at unique indices (top-k): one atomic per element, so the sum is exact and
        # deterministic whatever the order the programs run in.
        dst = tl.load(idx_ptr + offs, mask=mask, other=0)
        tl.atomic_add(out_ptr + dst, y, mask=mask, sem="relaxed")
    elif ACC:
        acc = tl.load(out_ptr + offs, mask=mask, other=0.0)
        tl.store(out_ptr + offs, acc + y, mask=mask)
    else:
        tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def _scatter_add_kernel(out_ptr, idx_ptr, val_ptr, k, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < k
    dst = tl.load(idx_ptr + offs, mask=mask, other=0)
    val = tl.load(val_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.atomic_add(out_ptr + dst, val, mask=mask, sem="relaxed")


def _launch_shape(numel: int, block_size: int) -> tuple[int, int, dict]:
    """Blocks per program ``G`` (a power of two), the grid size and the launch options."""
    elems = _INTERP_ELEMS_PER_PROGRAM if _INTERPRET else _CUDA_ELEMS_PER_PROGRAM
    nb = num_blocks(numel, block_size)
    g = max(1, elems // block_size)
    g = min(g, triton.next_power_of_2(nb))
    opts = {} if _INTERPRET else {"num_warps": _CUDA_NUM_WARPS, "enable_fp_fusion": False}
    return g, triton.cdiv(nb, g), opts


def _seed_word(seed: int) -> int:
    s = (int(seed) * HASH_GOLDEN) & 0xFFFFFFFF
    return s


def quantize(
    x: torch.Tensor,
    bits: int,
    block_size: int = 512,
    stochastic: bool = False,
    seed: int = 0,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    packed_out: torch.Tensor | None = None,
    meta_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of :func:`~fastml_strategy.kernels.reference.quantize_reference` (same arguments)."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"quantize: x is {x.dtype}; the codec takes float32, float16 or bfloat16")
    x = x.reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.numel()
    nb = num_blocks(n, block_size)
    nbytes = packed_nbytes(n, bits)
    packed = packed_out if packed_out is not None else torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    meta = meta_out if meta_out is not None else torch.empty(nb, 2, dtype=torch.float32, device=x.device)
    if n == 0:
        return packed, meta
    _check_out(packed, nbytes, torch.uint8, "packed_out")
    _check_out(meta, 2 * nb, torch.float32, "meta_out")
    has_res = residual is not None
    if has_res:
        r = residual.reshape(-1)
        _check_out(r, n, torch.float32, "residual")
        rout = r if residual_out is None else residual_out.reshape(-1)
        _check_out(rout, n, torch.float32, "residual_out")
        inplace = rout.data_ptr() == r.data_ptr()
    else:
        r = rout = x  # unused
        inplace = True
    g, grid, opts = _launch_shape(n, block_size)
    seed_s = _seed_word(seed)
    if seed_s >= 1 << 31:  # pass as a signed 32-bit value; the kernel works on its bits as uint32
        seed_s -= 1 << 32
    _quantize_kernel[(grid,)](
        x, r, rout, packed, meta, n, nb, nbytes, seed_s,
        BITS=bits, BS=block_size, G=g, HAS_RES=has_res, RES_INPLACE=inplace, STOCH=bool(stochastic),
        **opts,
    )
    return packed, meta


def dequantize(
    packed: torch.Tensor,
    meta: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int = 512,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Triton twin of :func:`~fastml_strategy.kernels.reference.dequantize_reference`."""
    if out is None:
        out = (torch.zeros if accumulate else torch.empty)(numel, dtype=torch.float32, device=packed.device)
    if numel == 0:
        return out
    _check_out(out, numel, torch.float32, "out")
    _decode(packed, meta, numel, bits, block_size, out, accumulate, None)
    return out


def dequantize_scatter_add(
    out: torch.Tensor, indices: torch.Tensor, packed: torch.Tensor, meta: torch.Tensor, bits: int,
    block_size: int = 512,
) -> torch.Tensor:
    """``out[indices] += dequantize(packed, meta)`` in one pass (``indices`` unique, int32 or int64)."""
    k = indices.numel()
    if k:
        _decode(packed, meta, k, bits, block_size, out, True, indices.reshape(-1).contiguous())
    return out


def _decode(packed, meta, numel, bits, block_size, out, accumulate, indices):
    packed = packed.reshape(-1).contiguous()
    meta = meta.reshape(-1).contiguous()
    nb = num_blocks(numel, block_size)
    if meta.numel() != 2 * nb or packed.numel() < packed_nbytes(numel, bits):
        raise ValueError(
            f"dequantize: {numel} elements of {bits} bits in blocks of {block_size} need "
            f"{packed_nbytes(numel, bits)} payload bytes and {nb}x2 metadata; got {packed.numel()} "
            f"bytes and {meta.numel()} metadata values")
    g, grid, opts = _launch_shape(numel, block_size)
    _dequantize_kernel[(grid,)](
        packed, meta, out, indices if indices is not None else out, numel, nb, packed.numel(),
        BITS=bits, BS=block_size, G=g, ACC=bool(accumulate), INDEXED=indices is not None, **opts,
    )


def scatter_add(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``out[indices] += values`` with atomics (``indices`` unique within the call: deterministic)."""
    k = indices.numel()
    if k:
        block = 1024 if not _INTERPRET else max(1024, triton.next_power_of_2(k))
        opts = {} if _INTERPRET else {"num_warps": 4}
        _scatter_add_kernel[(triton.cdiv(k, block),)](
            out, indices.reshape(-1).contiguous(), values.reshape(-1).contiguous(), k, BLOCK=block, **opts)
    return out


def _check_out(t: torch.Tensor, numel: int, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous {dtype} tensor of {numel} elements, got {t.dtype} "
            f"{tuple(t.shape)} (contiguous={t.is_contiguous()})")
