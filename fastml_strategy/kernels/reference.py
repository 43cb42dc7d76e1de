"""Pure-torch reference of the quantization codec: the CPU fallback and the test oracle of every kernel.

The wire format (every backend must produce and read exactly these bytes)
------------------------------------------------------------------------
A 1-D tensor ``x`` of ``n`` elements (fp32, fp16 or bf16; computed in fp32) is cut into blocks of
``block_size`` elements (a power of two >= 8; the last block may be partial). With ``L = 2**bits - 1``:

1. ``v = x + residual`` (fp32) when a residual is given, else ``v = x``.
2. Per block: ``mn = min(v)``, ``mx = max(v)``; ``scale = (mx - mn) / L``. If ``mx - mn`` overflows
   to inf while ``mn`` and ``mx`` are finite, ``scale = min(2 * ((mx * 0.5 - mn * 0.5) / L), FLT_MAX)``
   (halving is exact there; the cap only bites for ``bits = 1``). ``inv = 1 / scale`` if
   ``scale > 0`` else ``0``. (One division for the scale in either case: kernels compute
   ``(overflow ? mx * 0.5 - mn * 0.5 : mx - mn) / L``.) The block is *representable* when
   ``mx - mn`` and ``mn + L * scale`` (fp32, a multiply then an add, as in step 7) are both finite.
   A block whose range exceeds fp32 (``max - min > FLT_MAX``, as in ``[-3e38, 3e38]``) is not: step 7
   cannot decode its largest values to finite numbers (they became inf, or for ``bits = 1`` a value
   far below ``mx``), so it is non-finite (step 4) whatever its scale.
3. ``q = clamp(floor((v - mn) * inv + u), 0, L)`` with ``u = 0.5`` (round to nearest) or, for
   stochastic rounding, ``u = uniform(seed, i)`` of the element's index ``i`` in ``x`` (see
   :func:`uniform`), so the same seed gives the same bytes on every backend. A NaN there (``0 * inf``
   when ``scale`` is subnormal and ``inv`` overflows) gives ``q = 0``.
4. A block holding a NaN or an inf, or not representable (step 2), is *non-finite*: its metadata is
   ``(nan, nan)``, its codes are 0, and it decodes to NaN everywhere, so a non-finite gradient reaches
   every rank (GradScaler then skips the step on all of them). Its residual is left unchanged.
5. Metadata: fp32 tensor of shape ``(nblocks, 2)``: ``[:, 0] = mn``, ``[:, 1] = scale``.
6. Packing: the codes form a little-endian bit stream: element ``i`` occupies stream bits
   ``[i*bits, (i+1)*bits)``, byte ``k`` holds stream bits ``[8k, 8k+8)`` (bit 0 = least significant).
   The payload is ``ceil(n * bits / 8)`` uint8 bytes; the bits after element ``n - 1`` are 0.
   Each block starts on a byte boundary (``block_size * bits`` is a multiple of 8).
7. Decoding: ``y = mn + q * scale`` in fp32 (a multiply, then an add: no fused multiply-add).
8. Error feedback: ``residual_new = v - y`` for finite blocks.
9. A chunk of a message (what :class:`fastml_strategy.codecs.QuantizeCodec` sends, and what the
   Triton segment tables write in place): ``[metadata: nblocks x (mn, scale) fp32 | codes]``, the
   codes padded with zero bytes to a multiple of 4 (:func:`chunk_layout`), so that the metadata of
   the next chunk in a shared message stays 4-byte aligned.

Round to nearest errs by at most ``scale / 2`` per element (plus fp32 rounding of the subtraction);
stochastic rounding by less than ``scale`` and is unbiased.

Every step is IEEE fp32 with one rounding per operation, so the kernels (Triton, the compiled CPU
path) reproduce these bytes exactly: they must not contract ``a * b + c`` into a fused multiply-add,
and must divide with correct rounding (Triton's ``div_rn``, not its approximate ``/``).

This module favours clarity over speed, but avoids needless passes (in-place chains, no per-element
masks unless a block is non-finite): about 2x the naive version's speed; the compiled path
(:mod:`fastml_strategy.kernels.cpu`) is the fast one on CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = [
    "quantize_into",
    "dequantize_into",
    "check_args",
    "check_out",
    "uniform",
    "seed_word",
    "packed_nbytes",
    "num_blocks",
    "ChunkLayout",
    "chunk_layout",
    "pack_bits",
    "unpack_bits",
]

_M32 = 0xFFFFFFFF
# Constants of the integer hash behind stochastic rounding (a 32-bit "lowbias" mixer).
HASH_GOLDEN = 0x9E3779B9
HASH_M1 = 0x7FEB352D
HASH_M2 = 0x846CA68B
FLT_MAX = 3.4028234663852886e38


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes of the bit-packed payload of ``numel`` codes of ``bits`` bits."""
    return (numel * bits + 7) // 8


def num_blocks(numel: int, block_size: int) -> int:
    return (numel + block_size - 1) // block_size


class ChunkLayout(NamedTuple):
    """Where the parts of one quantized chunk lie in a message (format step 9), in bytes from the
    chunk's start: the metadata at ``[0, meta)``, the codes at ``[meta, meta + codes)``; ``nbytes``
    (a multiple of 4) is what the chunk takes, padding included."""

    meta: int
    codes: int
    nbytes: int


@functools.lru_cache(maxsize=1 << 12)  # asked per chunk and stage; a model has few distinct chunk sizes
def chunk_layout(numel: int, bits: int, block_size: int) -> ChunkLayout:
    """The layout of a quantized chunk of ``numel`` elements (format step 9)."""
    meta = 8 * num_blocks(numel, block_size)
    codes = packed_nbytes(numel, bits)
    return ChunkLayout(meta, codes, meta + ((codes + 3) & ~3))


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    # (h * c) mod 2**32 for h < 2**32 in int64 without overflowing int64: split c in 16-bit halves.
    lo = h * (c & 0xFFFF)
    hi = ((h * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def seed_word(seed: int) -> int:
    """``seed * 0x9E3779B9 mod 2**32`` (the hash's seed term in :func:`uniform`) as a signed 32-bit
    value, the form the kernels take it in (they reinterpret it as unsigned)."""
    s = (int(seed) * HASH_GOLDEN) & _M32
    return s - (1 << 32) if s >= 1 << 31 else s


def uniform(seed: int, index: torch.Tensor) -> torch.Tensor:
    """Counter-based uniform numbers in [0, 1): a 32-bit hash of ``(seed, index)``, top 24 bits.

    ``h = (index + seed * 0x9E3779B9) mod 2**32``, then ``h ^= h >> 16; h *= 0x7FEB352D;
    h ^= h >> 15; h *= 0x846CA68B; h ^= h >> 16`` (mod 2**32), and ``u = (h >> 8) * 2**-24``.
    """
    s = (int(seed) * HASH_GOLDEN) & _M32
    h = (index.to(torch.int64) + s) & _M32
    h = h ^ (h >> 16)
    h = _mul32(h, HASH_M1)
    h = h ^ (h >> 15)
    h = _mul32(h, HASH_M2)
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * (1.0 / 16777216.0)


def pack_bits(q: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Pack uint8 codes (length a multiple of 8) into the little-endian bit stream; keep ``numel``'s bytes."""
    if bits == 8:
        out = q
    elif bits in (1, 2, 4):
        per = 8 // bits
        g = q.view(-1, per)
        out = g[:, 0].clone()
        for i in range(1, per):
            out |= g[:, i] << (bits * i)
    else:
        g = q.view(-1, 8).to(torch.int64)
        shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=q.device)
        word = (g << shifts).sum(dim=1)  # 8 codes -> one 8*bits-bit word (<= 56 bits)
        byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=q.device)
        out = ((word[:, None] >> byte_shifts) & 0xFF).to(torch.uint8).reshape(-1)
    return out[: packed_nbytes(numel, bits)]


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` (a multiple of 8) uint8 codes."""
    need = count * bits // 8
    if packed.numel() < need:
        packed = torch.cat([packed, packed.new_zeros(need - packed.numel())])
    packed = packed[:need]
    mask = (1 << bits) - 1
    if bits == 8:
        return packed
    if bits in (1, 2, 4):
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        return ((packed[:, None] >> shifts) & mask).reshape(-1)
    b = packed.view(-1, bits).to(torch.int64)
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=packed.device)
    word = (b << byte_shifts).sum(dim=1)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=packed.device)
    return ((word[:, None] >> shifts) & mask).to(torch.uint8).reshape(-1)


def _padded_blocks(
    x: torch.Tensor, residual: torch.Tensor | None, block_size: int
) -> tuple[torch.Tensor, bool]:
    """``v = x + residual`` in fp32 as a (nblocks, block_size) tensor, and whether it is a fresh buffer.

    A partial last block is padded with its first element (so min and max are unchanged).
    """
    n = x.numel()
    nb = num_blocks(n, block_size)
    if n == nb * block_size:
        if residual is not None:
            return torch.add(x, residual.reshape(-1)).view(nb, block_size), True  # fp32 out
        v = x.to(torch.float32)
        return v.view(nb, block_size), v.data_ptr() != x.data_ptr()
    vp = torch.empty(nb * block_size, dtype=torch.float32, device=x.device)
    vp[:n] = x
    if residual is not None:
        vp[:n] += residual.reshape(-1)
    vp[n:] = vp[(nb - 1) * block_size]
    return vp.view(nb, block_size), True


def _block_meta(v2: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    mn, mx = torch.aminmax(v2, dim=1)
    finite = torch.isfinite(mn) & torch.isfinite(mx)
    diff = mx - mn
    # Divide by a tensor, not a Python number: CUDA torch turns division by a CPU scalar into a
    # multiplication by its reciprocal, which rounds differently from the IEEE division of the format.
    lv = torch.full((), float(levels), dtype=torch.float32, device=v2.device)
    scale = diff / lv
    overflow = torch.isinf(diff) & finite
    if bool(overflow.any()):
        wide = ((mx * 0.5 - mn * 0.5) / lv * 2).clamp_(max=FLT_MAX)
        scale = torch.where(overflow, wide, scale)
    # Representable (step 2). Without this, a block spanning more than fp32's range kept finite
    # metadata but decoded its largest values to inf, and error feedback stored -inf residuals.
    finite = finite & torch.isfinite(diff) & torch.isfinite(mn + scale * float(levels))
    return mn, scale, finite


def quantize_into(x: torch.Tensor, bits: int, block_size: int, stochastic: bool, seed: int,
                  residual: torch.Tensor | None, residual_out: torch.Tensor | None, packed: torch.Tensor,
                  meta: torch.Tensor) -> None:
    """The reference encoder (the test oracle, and the path of any device): ``x`` (flat, contiguous,
    not empty; with ``residual``, ``x + residual``) into ``packed`` / ``meta``, the new residual into
    ``residual_out`` (default ``residual``). :func:`fastml_strategy.kernels.quantize` checks the
    arguments and allocates the outputs; see the module docstring for the format."""
    n = x.numel()
    levels = (1 << bits) - 1
    v2, _ = _padded_blocks(x, residual, block_size)
    mn, scale, finite = _block_meta(v2, levels)
    all_finite = bool(finite.all())
    inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
    if all_finite:
        mn_q = mn
    else:
        mn_q = torch.where(finite, mn, torch.zeros_like(mn))
        inv = torch.where(finite, inv, torch.zeros_like(inv))
    qf = torch.sub(v2, mn_q[:, None]).mul_(inv[:, None])
    if stochastic:
        qf += uniform(seed, torch.arange(v2.numel(), device=x.device)).view_as(qf)
    else:
        qf += 0.5
    qf.floor_().clamp_(0, levels).nan_to_num_(0.0)
    if not all_finite:
        qf.mul_(finite[:, None])  # codes of non-finite blocks are 0 (qf is finite here)
    qf.view(-1)[n:] = 0  # padding codes: the bits after element n - 1 are 0
    q = qf.to(torch.uint8).reshape(-1)
    if all_finite:
        meta[:, 0] = mn
        meta[:, 1] = scale
    else:
        meta[:, 0] = torch.where(finite, mn, float("nan"))
        meta[:, 1] = torch.where(finite, scale, float("nan"))
    packed.copy_(pack_bits(q, bits, n))
    if residual is not None:
        y = qf.mul_(scale[:, None]).add_(mn_q[:, None]).view(-1)[:n]  # mn + q * scale
        dst = (residual if residual_out is None else residual_out).reshape(-1)
        if all_finite:
            torch.sub(v2.view(-1)[:n], y, out=dst)
        else:
            fin_el = finite.repeat_interleave(block_size)[:n]
            dst.copy_(torch.where(fin_el, v2.view(-1)[:n] - y, residual.reshape(-1)))


def check_out(t: torch.Tensor, numel: int, dtype: torch.dtype, name: str) -> None:
    """Raise ValueError unless ``t`` is a contiguous ``dtype`` tensor of ``numel`` elements (an output
    or a residual given to a kernel)."""
    if t.dtype != dtype or t.numel() != numel or not t.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous {dtype} tensor of {numel} elements, got {t.dtype} "
            f"{tuple(t.shape)} (contiguous={t.is_contiguous()})")


def check_args(bits: int, block_size: int) -> None:
    """The one check of the codec's parameters, for every entry point and backend."""
    if not 1 <= bits <= 8:
        raise ValueError(f"bits={bits}: the codec packs 1 to 8 bits per element")
    if block_size < 8 or block_size & (block_size - 1):
        raise ValueError(
            f"block_size={block_size}: must be a power of two >= 8, so every block starts on a byte")


def dequantize_into(packed: torch.Tensor, meta: torch.Tensor, numel: int, bits: int, block_size: int,
                    out: torch.Tensor, accumulate: bool) -> None:
    """The reference decoder: ``numel`` (> 0) fp32 values into ``out`` (fp32, 1-D), added to it when
    ``accumulate``."""
    nb = num_blocks(numel, block_size)
    q = unpack_bits(packed.reshape(-1), bits, nb * block_size).view(nb, block_size)
    meta = meta.reshape(nb, 2)
    y = q.to(torch.float32).mul_(meta[:, 1:2]).add_(meta[:, 0:1]).view(-1)[:numel]  # mn + q * scale
    dst = out.view(-1)
    if accumulate:
        dst.add_(y)
    else:
        dst.copy_(y)
