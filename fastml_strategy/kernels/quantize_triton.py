"""Triton kernels of the quantization codec: fused quantize + bit-pack + error feedback, and unpack +
dequantize (+ accumulate). The wire format is the one :mod:`fastml_strategy.kernels.reference` defines;
these kernels reproduce its bytes exactly.

How the encoder works, per program (``G`` blocks of ``BS`` elements, held as a ``[G, BS/8, 8]`` tile so
that every group of 8 codes fills exactly ``bits`` bytes):

1. load ``x`` (any float dtype, converted to fp32 at once: the interpreter's bf16 arithmetic is wrong)
   and the residual, ``v = x + r``;
2. per block: ``min`` and ``max`` (a NaN counts as +inf for the max: ``tl.max`` skips NaN), so a
   NaN or an inf leaves them non-finite: the block's non-finite flag; then the scale and its inverse
   with correctly rounded division (``div_rn``: Triton's ``/`` may lower to an approximate one);
3. per element: ``q = trunc(clamp((v - mn) * inv + u, 0, L))`` (equal to the reference's
   clamp-after-floor for these non-negative values; ``u`` = 0.5, or the reference's counter-based
   hash in uint32 arithmetic), then ``y = mn + q * scale`` and the new residual ``v - y``;
4. 8 codes are OR-ed into one word (``bits * 8`` <= 64 bits) and its low ``bits`` bytes stored.

One pass reads ``x`` and the residual and writes the payload, the metadata and the new residual: for
int4 with error feedback 12.5 bytes per element, against 8 for a copy. The decoder mirrors it: load
``bits`` bytes per 8 codes, split, ``y = mn + q * scale``, store or add into ``out``.

Bit-exactness needs IEEE fp32 with one rounding per operation: kernels are launched with
``enable_fp_fusion=False`` (Triton contracts ``a * b + c`` into an FMA by default) and divide with
``tl.math.div_rn``.

Full tiles and the tail are two launches: the first has no masks at all (and stores 1/2/4/8-bit
groups as one word), the second covers the last partial tile with masks. Launch parameters are
picked by hand (``@triton.autotune`` needs a driver, so it fails in the interpreter); see
``_CUDA_ELEMS_PER_PROGRAM``. Under the interpreter (about 1.4 ms per program, numpy doing the work)
programs are as large as 64 Ki elements.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from fastml_strategy.kernels.reference import FLT_MAX, check_out, chunk_layout, num_blocks, packed_nbytes, seed_word

__all__ = ["quantize", "dequantize", "encode_table", "decode_table", "seed_column", "quantize_segments",
           "dequantize_segments"]

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# CUDA launch shape: 1024 elements per program on 1 warp (32 per thread). Read from the sm_90 PTX and
# ptxas -v (int4, block 512; see benchmarks/RESULTS.md): 19.9 PTX instructions per element to encode,
# 28.7 with error feedback, 10.2 to decode-and-add, 61/96/64 registers, no spills; 2048 elements on 4
# warps (the usual shape) take 31.1/39.5/11.9, because every thread recomputes the per-block scale
# and inverse (two correctly rounded divisions) of all the program's blocks and the reductions cross
# warps; 2048 on 1 warp spills with error feedback. Override with FASTML_TRITON_ELEMS and
# FASTML_TRITON_WARPS; `benchmarks/bench_codecs.py --device cuda --sweep` measures the alternatives.
_CUDA_ELEMS_PER_PROGRAM = int(os.environ.get("FASTML_TRITON_ELEMS", "1024"))
_CUDA_NUM_WARPS = int(os.environ.get("FASTML_TRITON_WARPS", "1"))
_INTERP_ELEMS_PER_PROGRAM = 1 << 16

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_FMAX = tl.constexpr(FLT_MAX)  # a kernel may read a module global only when it is a constexpr


@triton.jit
def _hash_uniform(idx, seed_s):
    # The reference's uniform(seed, idx): lowbias32 of (idx + seed * golden) mod 2**32, top 24 bits.
    h = idx.to(tl.uint32) + seed_s.to(tl.uint32, bitcast=True)
    h = h ^ (h >> 16)
    h = h * tl.full([1], 0x7FEB352D, tl.uint32)
    h = h ^ (h >> 15)
    h = h * tl.full([1], 0x846CA68B, tl.uint32)
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


@triton.jit
def _block_codes(v, vlo, vhi, idx, seed_s, BITS: tl.constexpr, G: tl.constexpr, STOCH: tl.constexpr):
    """The format's steps 1-3 for G blocks of v ([G, BS/8, 8]; vlo/vhi: v with padding and NaN
    already mapped for the min and the max): (codes as floats in [0, L], min, scale, bad, min used),
    ``bad`` marking blocks that cannot be encoded (non-finite, or a range past fp32's)."""
    LF: tl.constexpr = (1 << BITS) - 1
    # Block statistics. tl.min/tl.max skip NaN, hence the NaN -> +inf in vhi: a NaN or an inf leaves
    # mn or mx non-finite. (A NaN-propagating tl.reduce would save that select on a GPU, but the
    # interpreter runs custom combiners element by element in Python: 6x slower tests.)
    mn = tl.min(tl.min(vlo, axis=2), axis=1)  # [G]
    mx = tl.max(tl.max(vhi, axis=2), axis=1)
    bad = ~(tl.abs(mn) <= _FMAX) | ~(tl.abs(mx) <= _FMAX)
    diff = mx - mn
    wide = ~(tl.abs(diff) <= _FMAX) & ~bad  # finite block whose range overflows
    scale = tl.math.div_rn(tl.where(wide, mx * 0.5 - mn * 0.5, diff), LF * 1.0)
    scale = tl.where(wide, tl.minimum(scale * 2.0, _FMAX), scale)
    # Representable (format step 2): a finite range and a top code that decodes to a finite number
    # (launched without FP fusion: a multiply, then an add).
    bad = bad | wide | ~(tl.abs(mn + (LF * 1.0) * scale) <= _FMAX)
    pos = scale > 0
    inv = tl.where(pos, tl.math.div_rn(tl.full([G], 1.0, tl.float32), tl.where(pos, scale, 1.0)), 0.0)
    mn_q = tl.where(bad, 0.0, mn)
    inv = tl.where(bad, 0.0, inv)

    t = (v - mn_q[:, None, None]) * inv[:, None, None]
    if STOCH:
        t = t + _hash_uniform(idx, seed_s)
    else:
        t = t + 0.5
    # For t >= 0, clamp(floor(t), 0, L) == trunc(min(t, L)): clamp first (NaN fails both tests -> 0),
    # then the float -> int conversion truncates. A non-finite block has inv = 0, so t < 1: code 0.
    t = tl.where(t >= 0.0, tl.where(t <= LF, t, LF * 1.0), 0.0)
    return t, mn, scale, bad, mn_q


@triton.jit(do_not_specialize=["n", "nbytes", "base", "seed_s"])
def _quantize_kernel(
    x_ptr, r_ptr, rout_ptr, packed_ptr, meta_ptr,
    n, nbytes, base, seed_s,
    BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr, WORDS: tl.constexpr,
    HAS_RES: tl.constexpr, STOCH: tl.constexpr,
):
    # EVEN: every block of this launch is full (no masks; 1/2/4/8-bit groups stored as one word when
    # WORDS). Otherwise (the tail launch): n elements, masked, byte stores.
    WORD: tl.constexpr = tl.uint32 if BITS <= 4 else tl.uint64
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * G + tl.arange(0, G)  # [G]
    grp = tl.arange(0, BS // 8)
    lane = tl.arange(0, 8)
    offs = blk[:, None, None] * BS + grp[None, :, None] * 8 + lane[None, None, :]  # [G, BS/8, 8]

    if EVEN:
        v = tl.load(x_ptr + offs).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptr + offs)
            v = v + r
        vlo = v
        vhi = tl.where(v == v, v, float("inf"))  # a NaN counts as +inf for the max
    else:
        mask = offs < n
        v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(r_ptr + offs, mask=mask, other=0.0)
            v = v + r
        vlo = tl.where(mask, v, float("inf"))
        vhi = tl.where(mask, tl.where(v == v, v, float("inf")), float("-inf"))

    t, mn, scale, bad, mn_q = _block_codes(v, vlo, vhi, offs + base, seed_s, BITS, G, STOCH)
    qi = t.to(tl.int32)
    if not EVEN:
        qi = tl.where(mask, qi, 0)  # padding codes are 0

    bad3 = bad[:, None, None]
    if HAS_RES:
        y = mn_q[:, None, None] + qi.to(tl.float32) * scale[:, None, None]
        new_r = tl.where(bad3, r, v - y)  # a non-finite block keeps its residual
        if EVEN:
            tl.store(rout_ptr + offs, new_r)
        else:
            tl.store(rout_ptr + offs, new_r, mask=mask)

    nan = float("nan")
    if EVEN:
        tl.store(meta_ptr + blk * 2, tl.where(bad, nan, mn))
        tl.store(meta_ptr + blk * 2 + 1, tl.where(bad, nan, scale))
    else:
        bmask = blk * BS < n
        tl.store(meta_ptr + blk * 2, tl.where(bad, nan, mn), mask=bmask)
        tl.store(meta_ptr + blk * 2 + 1, tl.where(bad, nan, scale), mask=bmask)

    # Pack: 8 codes -> one word of 8*BITS bits (disjoint fields, so the sum is an OR).
    word = tl.sum(qi.to(WORD) << (lane * BITS).to(WORD)[None, None, :], axis=2)  # [G, BS/8]
    if EVEN and WORDS:
        ST: tl.constexpr = tl.uint8 if BITS == 1 else (tl.uint16 if BITS == 2 else (
            tl.uint32 if BITS == 4 else tl.uint64))
        wptr = packed_ptr.to(tl.pointer_type(ST))
        tl.store(wptr + blk[:, None] * (BS // 8) + grp[None, :], word.to(ST))
    else:
        shift = tl.where(lane < BITS, lane * 8, 0).to(WORD)
        byte = ((word[:, :, None] >> shift[None, None, :]) & 0xFF).to(tl.uint8)
        boffs = blk[:, None, None] * (BS * BITS // 8) + grp[None, :, None] * BITS + lane[None, None, :]
        bm = (lane < BITS)[None, None, :]
        if not EVEN:
            bm = bm & (boffs < nbytes)
        tl.store(packed_ptr + boffs, byte, mask=bm)


@triton.jit(do_not_specialize=["n", "nbytes"])
def _dequantize_kernel(
    packed_ptr, meta_ptr, out_ptr,
    n, nbytes,
    BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, EVEN: tl.constexpr, WORDS: tl.constexpr,
    ACC: tl.constexpr,
):
    LF: tl.constexpr = (1 << BITS) - 1
    WORD: tl.constexpr = tl.uint32 if BITS <= 4 else tl.uint64
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * G + tl.arange(0, G)
    grp = tl.arange(0, BS // 8)
    lane = tl.arange(0, 8)
    if EVEN and WORDS:
        ST: tl.constexpr = tl.uint8 if BITS == 1 else (tl.uint16 if BITS == 2 else (
            tl.uint32 if BITS == 4 else tl.uint64))
        wptr = packed_ptr.to(tl.pointer_type(ST))
        word = tl.load(wptr + blk[:, None] * (BS // 8) + grp[None, :]).to(WORD)  # [G, BS/8]
    else:
        boffs = blk[:, None, None] * (BS * BITS // 8) + grp[None, :, None] * BITS + lane[None, None, :]
        bm = (lane < BITS)[None, None, :]
        if not EVEN:
            bm = bm & (boffs < nbytes)
        b = tl.load(packed_ptr + boffs, mask=bm, other=0)
        shift = tl.where(lane < BITS, lane * 8, 0).to(WORD)
        word = tl.sum(b.to(WORD) << shift[None, None, :], axis=2)
    q = (word[:, :, None] >> (lane * BITS).to(WORD)[None, None, :]) & LF
    offs = blk[:, None, None] * BS + grp[None, :, None] * 8 + lane[None, None, :]
    if EVEN:
        mn = tl.load(meta_ptr + blk * 2)
        sc = tl.load(meta_ptr + blk * 2 + 1)
        y = mn[:, None, None] + q.to(tl.float32) * sc[:, None, None]
        if ACC:
            tl.store(out_ptr + offs, tl.load(out_ptr + offs) + y)
        else:
            tl.store(out_ptr + offs, y)
    else:
        bmask = blk * BS < n
        mn = tl.load(meta_ptr + blk * 2, mask=bmask, other=0.0)
        sc = tl.load(meta_ptr + blk * 2 + 1, mask=bmask, other=0.0)
        y = mn[:, None, None] + q.to(tl.float32) * sc[:, None, None]
        mask = offs < n
        if ACC:
            tl.store(out_ptr + offs, tl.load(out_ptr + offs, mask=mask, other=0.0) + y, mask=mask)
        else:
            tl.store(out_ptr + offs, y, mask=mask)


def _plan(numel: int, block_size: int) -> tuple[int, int, dict]:
    """Blocks per program ``G`` (a power of two), elements covered by full tiles, launch options."""
    nb = num_blocks(numel, block_size)
    if _INTERPRET:
        # No compiling there: few programs; G <= nb/1 so that tests cover both the full-tile launch
        # and the tail launch.
        g = max(1, min(_INTERP_ELEMS_PER_PROGRAM // block_size, 1 << (max(nb, 1).bit_length() - 1)))
        opts = {}
    else:
        g = max(1, _CUDA_ELEMS_PER_PROGRAM // block_size)
        # a block larger than a program's worth gets proportionally more warps (same work per thread)
        warps = _CUDA_NUM_WARPS * max(1, block_size // _CUDA_ELEMS_PER_PROGRAM)
        opts = {"num_warps": min(warps, 32), "enable_fp_fusion": False}
    tile = g * block_size
    return g, (numel // tile) * tile, opts


def _words_ok(bits: int, packed: torch.Tensor) -> bool:
    # 1/2/4/8-bit groups of 8 codes are 1/2/4/8 bytes: store them as one word when aligned.
    return bits in (1, 2, 4, 8) and packed.data_ptr() % bits == 0


def quantize_into(x, bits, block_size, stochastic, seed, residual, residual_out, packed, meta) -> None:
    """Triton twin of :func:`~fastml_strategy.kernels.reference.quantize_into` (the protocol of
    :func:`fastml_strategy.kernels._backend`: ``x`` flat and contiguous, the outputs checked there)."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"quantize: x is {x.dtype}; the codec takes float32, float16 or bfloat16")
    n = x.numel()
    nbytes = packed_nbytes(n, bits)
    has_res = residual is not None
    if has_res:
        r = residual.reshape(-1)
        check_out(r, n, torch.float32, "residual")
        rout = r if residual_out is None else residual_out.reshape(-1)
        check_out(rout, n, torch.float32, "residual_out")
    else:
        r = rout = x  # unused
    g, nfull, opts = _plan(n, block_size)
    seed_s = seed_word(seed)
    consts = dict(BITS=bits, BS=block_size, G=g, HAS_RES=has_res, STOCH=bool(stochastic), **opts)
    if nfull:
        _quantize_kernel[(nfull // (g * block_size),)](
            x, r, rout, packed, meta, nfull, nfull * bits // 8, 0, seed_s,
            EVEN=True, WORDS=_words_ok(bits, packed), **consts)
    if n > nfull:
        b, pb = nfull, nfull * bits // 8
        ntail_blocks = num_blocks(n - b, block_size)
        _quantize_kernel[(triton.cdiv(ntail_blocks, g),)](
            x[b:], r[b:], rout[b:], packed[pb:], meta.view(-1)[2 * (b // block_size):], n - b, nbytes - pb, b,
            seed_s, EVEN=False, WORDS=False, **consts)


def dequantize_into(packed, meta, numel, bits, block_size, out, accumulate) -> None:
    """Triton twin of :func:`~fastml_strategy.kernels.reference.dequantize_into`."""
    _decode(packed, meta, numel, bits, block_size, out, accumulate)


def _decode(packed, meta, numel, bits, block_size, out, accumulate):
    packed = packed.reshape(-1).contiguous()
    meta = meta.reshape(-1).contiguous()
    nb = num_blocks(numel, block_size)
    nbytes = packed_nbytes(numel, bits)
    if meta.numel() != 2 * nb or packed.numel() < nbytes:
        raise ValueError(
            f"dequantize: {numel} elements of {bits} bits in blocks of {block_size} need "
            f"{nbytes} payload bytes and {nb}x2 metadata; got {packed.numel()} "
            f"bytes and {meta.numel()} metadata values")
    g, nfull, opts = _plan(numel, block_size)
    consts = dict(BITS=bits, BS=block_size, G=g, ACC=bool(accumulate), **opts)
    if nfull:
        _dequantize_kernel[(nfull // (g * block_size),)](
            packed, meta, out, nfull, nfull * bits // 8, EVEN=True, WORDS=_words_ok(bits, packed), **consts)
    if numel > nfull:
        b, pb = nfull, nfull * bits // 8
        _dequantize_kernel[(triton.cdiv(num_blocks(numel - b, block_size), g),)](
            packed[pb:], meta[2 * (b // block_size):], out[b:],
            numel - b, nbytes - pb, EVEN=False, WORDS=False, **consts)


# -- segment tables: one launch for many chunks ------------------------------------------------------
# A bucket's message holds W chunks of every compressed layer, each encoded on its own (its own
# blocks, metadata and seed). Launching the kernels above once per chunk costs W x layers launches per
# stage; a segment table lets one launch cover them all. Every program of the launch reads one row of
# the table: where its G blocks lie in the input, the residuals, the message, and how many elements of
# its chunk remain from its first block (the mask), built once per layout on the host and kept on the
# device. Within a chunk, program i covers blocks [i*G, i*G + G): the same blocks, the same
# arithmetic and the same bytes as the per-chunk launches (tests/kernels/test_segment_table.py).

# encode rows: x offset, residual offset, new-residual offset, packed byte offset, meta fp32 index,
# elements left in the chunk, element index of the first block in its chunk (stochastic rounding's
# counter), seed word
_ENC_COLS = 8
# decode rows: meta fp32 index, packed byte offset, out offset, elements left in the chunk
_DEC_COLS = 4


@triton.jit
def _packed_layout(n, BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr):
    # The index tensors of a program's G blocks of BS elements (element e of block b sits at lane
    # e % 8 of group e // 8), packed BITS bits each in groups of 8 elements = BITS bytes: the blocks,
    # the lanes, the elements' offsets [G, BS/8, 8], the packed bytes' offsets and mask (of a chunk of
    # n elements), and the byte shifts that assemble a group's BITS bytes into one word.
    WORD: tl.constexpr = tl.uint32 if BITS <= 4 else tl.uint64
    nbytes = (n * BITS + 7) // 8
    blk = tl.arange(0, G).to(tl.int64)  # [G], local to this program
    grp = tl.arange(0, BS // 8)
    lane = tl.arange(0, 8)
    offs = blk[:, None, None] * BS + grp[None, :, None] * 8 + lane[None, None, :]  # [G, BS/8, 8]
    boffs = blk[:, None, None] * (BS * BITS // 8) + grp[None, :, None] * BITS + lane[None, None, :]
    bm = (lane < BITS)[None, None, :] & (boffs < nbytes)
    shift = tl.where(lane < BITS, lane * 8, 0).to(WORD)
    return blk, lane, offs, boffs, bm, shift


@triton.jit
def _quantize_seg_kernel(
    x_ptr, r_ptr, rout_ptr, msg_ptr, msgf_ptr, table_ptr,
    BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, HAS_RES: tl.constexpr, STOCH: tl.constexpr,
):
    WORD: tl.constexpr = tl.uint32 if BITS <= 4 else tl.uint64
    pid = tl.program_id(0)
    row = table_ptr + pid.to(tl.int64) * 8
    x_off = tl.load(row)
    r_off = tl.load(row + 1)
    rout_off = tl.load(row + 2)
    p_off = tl.load(row + 3)
    m_off = tl.load(row + 4)
    n = tl.load(row + 5)
    base = tl.load(row + 6)
    seed_s = tl.load(row + 7).to(tl.int32)
    blk, lane, offs, boffs, bm, shift = _packed_layout(n, BITS, BS, G)
    mask = offs < n
    v = tl.load(x_ptr + x_off + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + r_off + offs, mask=mask, other=0.0)
        v = v + r
    vlo = tl.where(mask, v, float("inf"))
    vhi = tl.where(mask, tl.where(v == v, v, float("inf")), float("-inf"))
    t, mn, scale, bad, mn_q = _block_codes(v, vlo, vhi, offs + base, seed_s, BITS, G, STOCH)
    qi = tl.where(mask, t.to(tl.int32), 0)
    bad3 = bad[:, None, None]
    if HAS_RES:
        y = mn_q[:, None, None] + qi.to(tl.float32) * scale[:, None, None]
        tl.store(rout_ptr + rout_off + offs, tl.where(bad3, r, v - y), mask=mask)
    nan = float("nan")
    bmask = blk * BS < n
    tl.store(msgf_ptr + m_off + blk * 2, tl.where(bad, nan, mn), mask=bmask)
    tl.store(msgf_ptr + m_off + blk * 2 + 1, tl.where(bad, nan, scale), mask=bmask)
    word = tl.sum(qi.to(WORD) << (lane * BITS).to(WORD)[None, None, :], axis=2)  # [G, BS/8]
    byte = ((word[:, :, None] >> shift[None, None, :]) & 0xFF).to(tl.uint8)
    tl.store(msg_ptr + p_off + boffs, byte, mask=bm)


@triton.jit
def _dequantize_seg_kernel(
    msg_ptr, msgf_ptr, out_ptr, ok_ptr, table_ptr, src_stride,
    BITS: tl.constexpr, BS: tl.constexpr, G: tl.constexpr, NSRC: tl.constexpr, ACC: tl.constexpr,
):
    # Decodes NSRC copies of a chunk (source s at s * src_stride bytes after the first) and sums them
    # in source order (as decode, then decode-and-add, per source would), then stores or adds into
    # out. ok[pid]: 1 if every block's metadata of every source is finite (the chunk decodes to
    # finite values), else 0.
    LF: tl.constexpr = (1 << BITS) - 1
    WORD: tl.constexpr = tl.uint32 if BITS <= 4 else tl.uint64
    pid = tl.program_id(0)
    row = table_ptr + pid.to(tl.int64) * 4
    m_off = tl.load(row)
    p_off = tl.load(row + 1)
    o_off = tl.load(row + 2)
    n = tl.load(row + 3)
    blk, lane, offs, boffs, bm, shift = _packed_layout(n, BITS, BS, G)
    mask = offs < n
    bmask = blk * BS < n
    ok = tl.full([G], 1, tl.int32)
    tot = tl.zeros([G, BS // 8, 8], tl.float32)
    for s in tl.static_range(NSRC):
        b = tl.load(msg_ptr + p_off + s * src_stride + boffs, mask=bm, other=0)
        word = tl.sum(b.to(WORD) << shift[None, None, :], axis=2)
        q = (word[:, :, None] >> (lane * BITS).to(WORD)[None, None, :]) & LF
        mf = m_off + s * (src_stride // 4)
        mn = tl.load(msgf_ptr + mf + blk * 2, mask=bmask, other=0.0)
        sc = tl.load(msgf_ptr + mf + blk * 2 + 1, mask=bmask, other=0.0)
        fin = (tl.abs(mn) <= _FMAX) & (tl.abs(sc) <= _FMAX)
        ok = tl.where(fin | ~bmask, ok, 0)
        y = mn[:, None, None] + q.to(tl.float32) * sc[:, None, None]
        if s == 0:
            tot = y
        else:
            tot = tot + y
    if ACC:
        tot = tl.load(out_ptr + o_off + offs, mask=mask, other=0.0) + tot
    tl.store(out_ptr + o_off + offs, tot, mask=mask)
    tl.store(ok_ptr + pid, tl.min(ok, axis=0))


def segment_programs(block_size: int) -> int:
    """Blocks per program ``G`` of a segment-table launch."""
    if _INTERPRET:
        return max(1, _INTERP_ELEMS_PER_PROGRAM // 4 // block_size)
    return max(1, _CUDA_ELEMS_PER_PROGRAM // block_size)


def _program_starts(numel: int, block_size: int, g: int) -> range:
    """The first block of each program of a chunk of ``numel`` elements (one row of a table each;
    none for an empty chunk)."""
    return range(0, num_blocks(numel, block_size), g) if numel > 0 else range(0)


def encode_table(segments, bits: int, block_size: int, device) -> tuple[torch.Tensor, int]:
    """The table of a :func:`quantize_segments` launch. ``segments``: one tuple per chunk, ``(x_off,
    r_off, rout_off, msg_off, numel, seed)``: offsets in elements of the input, the residual and the
    new residual, and the byte offset (a multiple of 4) of the chunk's encoding in the message, laid
    out as :func:`~fastml_strategy.kernels.reference.chunk_layout` says. Returns ``(int64 table on
    device, G)``; :func:`seed_column` gives the seed column for other seeds."""
    g = segment_programs(block_size)
    rows = []
    for x_off, r_off, rout_off, msg_off, n, seed in segments:
        if n <= 0:
            continue
        if msg_off % 4:
            raise ValueError(f"encode_table: chunk encoding at byte {msg_off}, not a multiple of 4")
        codes = msg_off + chunk_layout(n, bits, block_size).meta
        seed_s = seed_word(seed)
        for b in _program_starts(n, block_size, g):
            e = b * block_size
            rows.append((x_off + e, r_off + e, rout_off + e, codes + e * bits // 8,
                         msg_off // 4 + 2 * b, n - e, e, seed_s))
    return _upload(torch.tensor(rows, dtype=torch.int64).reshape(-1, _ENC_COLS), device), g


def seed_column(numels, seeds, block_size: int) -> torch.Tensor:
    """The seed column (``table[:, 7]``, on the host) of an :func:`encode_table` table whose chunks
    have ``numels`` elements, for the per-chunk ``seeds`` (stochastic rounding draws other numbers
    every step; the offsets stay)."""
    g = segment_programs(block_size)
    return torch.tensor([seed_word(s) for n, s in zip(numels, seeds) for _ in _program_starts(n, block_size, g)],
                        dtype=torch.int64)


def decode_table(segments, bits: int, block_size: int, device) -> tuple[torch.Tensor, int]:
    """The table of a :func:`dequantize_segments` launch. ``segments``: ``(msg_off, out_off, numel)``
    per chunk: the byte offset (a multiple of 4) of the chunk's encoding (of its first source) in the
    message and the element offset of its values in ``out``. Returns ``(int64 table on device, G)``."""
    g = segment_programs(block_size)
    rows = []
    for msg_off, out_off, n in segments:
        if n <= 0:
            continue
        if msg_off % 4:
            raise ValueError(f"decode_table: chunk encoding at byte {msg_off}, not a multiple of 4")
        codes = msg_off + chunk_layout(n, bits, block_size).meta
        for b in _program_starts(n, block_size, g):
            e = b * block_size
            rows.append((msg_off // 4 + 2 * b, codes + e * bits // 8, out_off + e, n - e))
    return _upload(torch.tensor(rows, dtype=torch.int64).reshape(-1, _DEC_COLS), device), g


def _upload(table: torch.Tensor, device) -> torch.Tensor:
    """The table on ``device``; to a GPU from pinned memory without blocking the host (a pageable
    copy would synchronise: see tests/integrations/test_gpu.py)."""
    device = torch.device(device)
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


def _opts() -> dict:
    return {} if _INTERPRET else {"num_warps": _CUDA_NUM_WARPS, "enable_fp_fusion": False}


def quantize_segments(x: torch.Tensor, msg: torch.Tensor, table: torch.Tensor, g: int, bits: int,
                      block_size: int, stochastic: bool = False, residual: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None) -> None:
    """Encode every chunk of an :func:`encode_table` in one launch: chunk ``i`` of ``x`` (flat, fp32,
    fp16 or bf16) plus its residual (flat fp32, with ``residual``) into the uint8 message ``msg``
    (4-byte aligned, a multiple of 4 long), the new residual into ``residual_out`` (default
    ``residual``). Bit for bit what :func:`quantize` gives chunk by chunk."""
    if not len(table):
        return
    if msg.dtype != torch.uint8 or msg.numel() % 4 or msg.data_ptr() % 4 or not msg.is_contiguous():
        raise ValueError("quantize_segments: msg must be a contiguous, 4-aligned uint8 tensor of 4k bytes")
    has_res = residual is not None
    r = residual if has_res else x
    rout = (residual_out if residual_out is not None else residual) if has_res else x
    _quantize_seg_kernel[(len(table),)](
        x, r, rout, msg, msg.view(torch.float32), table,
        BITS=bits, BS=block_size, G=g, HAS_RES=has_res, STOCH=bool(stochastic), **_opts())


def dequantize_segments(msg: torch.Tensor, out: torch.Tensor, table: torch.Tensor, g: int, bits: int,
                        block_size: int, sources: int = 1, src_stride: int = 0,
                        accumulate: bool = False) -> torch.Tensor:
    """Decode every chunk of a :func:`decode_table` in one launch into fp32 ``out``: the sum, in source
    order, of ``sources`` copies of each chunk (copy s at ``s * src_stride`` bytes, a multiple of 4,
    after the first), stored or (``accumulate``) added. Bit for bit what :func:`dequantize` gives
    source by source (the first stored, the others added). Returns a 0-d bool tensor: whether every
    chunk decodes to finite values (no host read)."""
    if not len(table):
        return torch.ones((), dtype=torch.bool, device=out.device)
    if msg.dtype != torch.uint8 or msg.numel() % 4 or msg.data_ptr() % 4 or src_stride % 4:
        raise ValueError("dequantize_segments: msg must be a 4-aligned uint8 tensor of 4k bytes, "
                         "src_stride a multiple of 4")
    ok = torch.empty(len(table), dtype=torch.int32, device=out.device)
    _dequantize_seg_kernel[(len(table),)](
        msg, msg.view(torch.float32), out, ok, table, src_stride,
        BITS=bits, BS=block_size, G=g, NSRC=int(sources), ACC=bool(accumulate), **_opts())
    return ok.min() > 0
