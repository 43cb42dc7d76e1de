"""Encode/decode of one flat gradient tensor, as a :class:`~fastml_strategy.config.CodecConfig` says.

Two families, because they reduce differently (see :mod:`fastml_strategy.collective`):

- *dense* codecs (fp32, fp16, bf16, quantize) encode every element; a chunk of a dense message can be
  decoded, summed with other ranks' chunks, and re-encoded, so they use scatter-reduce-allgather.
  ``dense_nbytes`` gives a chunk's encoded size (always a multiple of 4 bytes, so the metadata of the
  next chunk stays aligned in a shared byte buffer).
- *sparse* top-k sends values (fp32, or quantized) and int32 indices; sums of sparse vectors are not
  sparse, so top-k messages are all-gathered and scatter-added by every rank in rank order.

The quantized byte layout of one chunk is ``[meta: nblocks x (min, scale) fp32][packed codes]``; the
codes follow the wire format of :mod:`fastml_strategy.kernels.reference`.

The wire interface
------------------
Callers (:mod:`fastml_strategy.collective`, :mod:`fastml_strategy.fsdp`) never read a message's
bytes themselves; they ask this module, for any codec:

- ``is_sparse(cfg)``: whether messages are all-gathered and scatter-added (top-k) rather than
  scatter-reduced (a chunk's sum re-encoded);
- ``chunk_unit(cfg)`` and ``chunk_nbytes(numel, cfg)``: where a chunk may end and how many bytes it
  takes (always a multiple of 4, so the next part of a shared buffer stays aligned);
- ``encode_chunk`` / ``decode_chunk``: one chunk, with error feedback when a residual is given
  (``cfg.uses_residual`` says whether the codec keeps one); ``encode_topk_ef`` for a top-k message
  whose new residual the caller commits later;
- ``chunk_finite(buf, numel, cfg)``: whether an encoded chunk decodes to finite values (from the
  metadata where there is some, so a receiver need not scan the decoded tensor).

``roundtrip`` and ``wire_bytes`` serve the autotuner: the first applies a codec to one tensor locally
(no communication), the second predicts a layer's bytes on the wire per step.
"""

from __future__ import annotations

import torch

from fastml_strategy import kernels
from fastml_strategy.config import Codec, CodecConfig, RECIPES

__all__ = [
    # the wire interface (any codec)
    "is_sparse",
    "wire_config",
    "chunk_unit",
    "chunk_nbytes",
    "encode_chunk",
    "decode_chunk",
    "chunk_finite",
    "encode_topk_ef",
    # one family
    "dense_nbytes",
    "encode_dense",
    "decode_dense",
    "topk_nbytes",
    "encode_topk",
    "decode_topk_add",
    "select_topk",
    # planning
    "effective_config",
    "wire_bytes",
    "reduce_scatter_bytes",
    "roundtrip",
]


def _align4(n: int) -> int:
    return (n + 3) & ~3


# -- dense --------------------------------------------------------------------------------------------
def dense_nbytes(numel: int, cfg: CodecConfig) -> int:
    """Encoded size in bytes of ``numel`` elements under a dense codec."""
    c = cfg.codec
    if c is Codec.FP32:
        return 4 * numel
    if c in (Codec.FP16, Codec.BF16):
        return _align4(2 * numel)
    if c is Codec.QUANTIZE:
        nb = kernels.num_blocks(numel, cfg.block_size)
        return 8 * nb + _align4(kernels.packed_nbytes(numel, cfg.bits))
    raise ValueError(f"{c} is not a dense codec")


def encode_dense(
    x: torch.Tensor,
    cfg: CodecConfig,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    seed: int = 0,
) -> None:
    """Encode flat ``x`` into the uint8 tensor ``out`` (exactly ``dense_nbytes`` long).

    With ``residual`` (quantize only), encodes ``x + residual`` and writes the new residual to
    ``residual_out`` (error feedback). fp16/bf16 casts are not error-fed: their error is tiny.
    """
    n = x.numel()
    c = cfg.codec
    if c is Codec.FP32:
        out.view(torch.float32).copy_(x)
    elif c in (Codec.FP16, Codec.BF16):
        dt = torch.float16 if c is Codec.FP16 else torch.bfloat16
        out[: 2 * n].view(dt).copy_(x)
    else:
        # The encoder writes metadata and codes straight into the message (offsets are 4-aligned).
        nb = kernels.num_blocks(n, cfg.block_size)
        kernels.quantize(
            x, cfg.bits, cfg.block_size, cfg.stochastic, seed, residual, residual_out,
            packed_out=out[8 * nb: 8 * nb + kernels.packed_nbytes(n, cfg.bits)],
            meta_out=out[: 8 * nb].view(torch.float32).view(nb, 2),
        )


def decode_dense(
    buf: torch.Tensor, numel: int, cfg: CodecConfig, out: torch.Tensor, accumulate: bool = False
) -> None:
    """Decode ``numel`` elements from the uint8 ``buf`` into fp32 ``out`` (``+=`` when accumulating)."""
    c = cfg.codec
    if c is Codec.QUANTIZE:
        nb = kernels.num_blocks(numel, cfg.block_size)
        meta = buf[: 8 * nb].view(torch.float32).view(nb, 2)
        packed = buf[8 * nb: 8 * nb + kernels.packed_nbytes(numel, cfg.bits)]
        kernels.dequantize(packed, meta, numel, cfg.bits, cfg.block_size, out=out, accumulate=accumulate)
        return
    if c is Codec.FP32:
        y = buf[: 4 * numel].view(torch.float32)
    else:
        y = buf[: 2 * numel].view(torch.float16 if c is Codec.FP16 else torch.bfloat16)
    if accumulate:
        out.add_(y)
    else:
        out.copy_(y)


# -- sparse (top-k) ---------------------------------------------------------------------------------
def _topk_value_cfg(cfg: CodecConfig) -> CodecConfig | None:
    if cfg.bits is None:
        return None
    return CodecConfig(codec=Codec.QUANTIZE, bits=cfg.bits, block_size=cfg.block_size,
                       stochastic=cfg.stochastic)


# Below this size, or for a dense k, plain torch.topk is cheap enough.
_SAMPLED_TOPK_MIN = 1 << 16
_SAMPLE = 1 << 18


def select_topk(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of ``k`` largest entries of the magnitudes ``a`` (no particular order).

    ``torch.topk`` of 1% of a 16.8M-element layer costs about a second on one CPU thread. Instead: take
    a strided sample of 256K entries, pick the threshold that about 1.5k entries of ``a`` should pass,
    keep the candidates at or above it (one compare pass), and run ``torch.topk`` on those only. If
    the sample's guess leaves fewer than ``k`` candidates, retry once with a lower quantile,
    then fall back to the full ``torch.topk`` (42 ms instead of 367 ms for 1% of 16.8M elements, one
    thread). Tensors of at most 65,536 elements, and k over 1/8 of the tensor, take ``torch.topk``.

    The contract (tests/test_codecs.py checks it past 65,536 elements): exactly ``k`` distinct
    indices; every selected non-NaN magnitude is >= every unselected non-NaN magnitude (a true top-k;
    among ties at the k-th magnitude any may be chosen); deterministic for the same input. A NaN
    entry may or may not be selected (it fails the threshold compare): :func:`encode_topk` marks a
    non-finite input in the message itself, so this does not matter on the wire.
    """
    n = a.numel()
    # On a GPU, torch.topk is fast, and the sampled path would read the host (nonzero, numel).
    if n <= _SAMPLED_TOPK_MIN or 8 * k > n or a.is_cuda:
        return torch.topk(a, k, sorted=False).indices
    stride = max(1, n // _SAMPLE)
    sample = a[::stride]
    s = sample.numel()
    for factor in (1.5, 4.0):
        ks = min(s, max(1, int(factor * k * s / n) + 1))
        t = torch.topk(sample, ks, sorted=False).values.min()
        cand = torch.nonzero(a >= t).squeeze(1)
        if cand.numel() >= k:
            return cand[torch.topk(a[cand], k, sorted=False).indices]
    return torch.topk(a, k, sorted=False).indices


def topk_nbytes(numel: int, cfg: CodecConfig) -> int:
    """Bytes of one rank's top-k message for a tensor of ``numel`` elements: values then indices."""
    k = cfg.topk_k(numel)
    vcfg = _topk_value_cfg(cfg)
    vbytes = 4 * k if vcfg is None else dense_nbytes(k, vcfg)
    return vbytes + 4 * k


def encode_topk(
    v: torch.Tensor, cfg: CodecConfig, out: torch.Tensor, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select the ``k`` largest-magnitude entries of fp32 ``v``; write values + int32 indices to ``out``.

    Returns ``(indices, decoded values)``: what the message decodes to at the selected indices (the
    values as the receiver sees them), so the caller can form the error-feedback residual
    ``v - decoded`` in place. A non-finite ``v`` poisons the first value with NaN, so every rank sees
    it (one max-reduction of ``|v|`` tells: it is NaN or inf exactly when ``v`` is not finite).
    """
    n = v.numel()
    k = cfg.topk_k(n)
    a = v.abs()
    idx = select_topk(a, k)
    vals = v[idx]
    if n:  # on the device: no host read
        vals[:1].masked_fill_(~torch.isfinite(a.max()), float("nan"))
    vcfg = _topk_value_cfg(cfg)
    if vcfg is None:
        vbytes = 4 * k
        out[:vbytes].view(torch.float32).copy_(vals)
        sent = vals
    else:
        vbytes = dense_nbytes(k, vcfg)
        encode_dense(vals, vcfg, out[:vbytes], seed=seed)
        sent = torch.empty(k, dtype=torch.float32, device=v.device)
        decode_dense(out[:vbytes], k, vcfg, sent)
    out[vbytes: vbytes + 4 * k].view(torch.int32).copy_(idx)
    return idx, sent


def decode_topk_add(buf: torch.Tensor, numel: int, cfg: CodecConfig, out: torch.Tensor) -> torch.Tensor:
    """Scatter-add one rank's top-k message into fp32 ``out``; returns whether its values are all
    finite (a 0-d bool tensor: checking k values is cheaper than checking the dense result)."""
    k = cfg.topk_k(numel)
    vcfg = _topk_value_cfg(cfg)
    if vcfg is None:
        vbytes = 4 * k
        vals = buf[:vbytes].view(torch.float32)
    else:
        vbytes = dense_nbytes(k, vcfg)
        vals = torch.empty(k, dtype=torch.float32, device=out.device)
        decode_dense(buf[:vbytes], k, vcfg, vals)
    # Clamped: a rank that failed sends whatever its buffer held (the error travels in the header and
    # every rank raises at the end of the step), and an index out of range must not reach index_add_
    # (a device-side assert on CUDA). A valid message's indices are all below numel.
    idx = buf[vbytes: vbytes + 4 * k].view(torch.int32).to(torch.int64).clamp_(0, max(numel - 1, 0))
    out.index_add_(0, idx, vals)
    return torch.isfinite(vals).all()


def encode_topk_ef(
    x: torch.Tensor, cfg: CodecConfig, out: torch.Tensor, residual: torch.Tensor | None = None, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode the top-k message of ``x + residual`` (``x`` alone without a residual) into ``out``
    (``chunk_nbytes`` long).

    Returns ``(rest, finite)``: ``rest`` is a fresh fp32 tensor, the input minus what the message
    decodes to (the new residual under error feedback; the compression error otherwise), and
    ``finite`` a 0-d bool tensor, whether the message decodes to finite values. When it does not, the
    step is skipped on every rank and ``rest`` must not become the residual."""
    if residual is not None and x.dtype == residual.dtype == torch.float32:
        v = torch.add(x, residual)  # one pass
    else:
        v = x.to(torch.float32, copy=True)
        if residual is not None:
            v += residual
    idx, sent = encode_topk(v, cfg, out, seed=seed)
    v[idx] -= sent
    return v, torch.isfinite(sent).all()


# -- the wire interface: one chunk of any codec ---------------------------------------------------------
# A reduce-scatter never re-encodes a sum, so top-k works there like a dense codec: each rank encodes
# the chunk it sends to rank j (top-k of that chunk), and rank j adds the W messages it receives.

# Chunk boundaries of the unquantized codecs fall on multiples of 16 elements: 64 bytes of fp32
# (a cache line) and a multiple of 4 bytes for fp16/bf16, so every chunk's encoding stays aligned.
_CHUNK_UNIT = 16


def is_sparse(cfg: CodecConfig) -> bool:
    """Whether messages of ``cfg`` are all-gathered and scatter-added by every rank (top-k: a sum of
    sparse vectors is not sparse), rather than scatter-reduced with the chunk sum re-encoded."""
    return cfg.codec is Codec.TOPK


def wire_config(cfg: CodecConfig, dtype: torch.dtype) -> CodecConfig:
    """The codec that carries ``cfg`` for gradients of ``dtype``: an uncompressed (fp32) layer whose
    gradients are already fp16/bf16 travels in that dtype, exactly and in half the bytes."""
    if cfg.codec is Codec.FP32 and dtype in (torch.float16, torch.bfloat16):
        return CodecConfig(codec=Codec.FP16 if dtype == torch.float16 else Codec.BF16)
    return cfg


def chunk_unit(cfg: CodecConfig) -> int:
    """Elements a chunk boundary must be a multiple of, so that no quantization block spans two
    chunks and every chunk's encoding stays 4-byte aligned."""
    return cfg.block_size if cfg.codec is Codec.QUANTIZE else _CHUNK_UNIT


def chunk_nbytes(numel: int, cfg: CodecConfig) -> int:
    """Encoded bytes of one chunk (or one whole top-k message) of ``numel`` elements: a multiple of 4
    (top-k: 4-byte values or 4-aligned quantized values, then int32 indices)."""
    if cfg.codec is Codec.TOPK:
        return topk_nbytes(numel, cfg)
    return dense_nbytes(numel, cfg)


def encode_chunk(
    x: torch.Tensor,
    cfg: CodecConfig,
    out: torch.Tensor,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    seed: int = 0,
) -> None:
    """Encode one chunk ``x`` into ``out`` (``chunk_nbytes`` long), with error feedback when
    ``residual`` is given: the encoder reads ``x + residual`` and writes the new residual to
    ``residual_out`` (default: ``residual``, in place). A residual may be fp32 or bf16; a non-finite
    input leaves it unchanged (quantize: per block; top-k: the whole chunk)."""
    if residual is not None and residual.dtype != torch.float32 and cfg.codec is not Codec.QUANTIZE:
        r32 = residual.to(torch.float32)
        encode_chunk(x, cfg, out, r32, None, seed)
        (residual if residual_out is None else residual_out).copy_(r32)
        return
    if cfg.codec is not Codec.TOPK:
        encode_dense(x, cfg, out, residual if cfg.codec is Codec.QUANTIZE else None, residual_out, seed)
        return
    if x.numel() == 0:
        return
    rest, finite = encode_topk_ef(x, cfg, out, residual, seed)
    if residual is not None:  # decided on the device: no host read
        (residual if residual_out is None else residual_out).copy_(torch.where(finite, rest, residual))


def reduce_chunk(bufs: list[torch.Tensor], numel: int, cfg: CodecConfig, out: torch.Tensor, divisor: float,
                 acc: torch.Tensor, seed: int = 0) -> None:
    """The reduce step of a dense chunk: decode the messages ``bufs`` (``numel`` elements each), sum
    them in order, divide by ``divisor`` and encode the result into ``out`` (no error feedback).
    Byte for byte ``decode_chunk`` of each (the first stored, the rest added) into the fp32 scratch
    ``acc``, ``acc.div_(divisor)`` and ``encode_chunk(acc)``; the quantize codec on the compiled CPU
    path does it in one pass (:func:`fastml_strategy.kernels.reduce_quantize`), and then leaves
    ``acc`` unwritten."""
    if cfg.codec is Codec.QUANTIZE:
        nb = kernels.num_blocks(numel, cfg.block_size)
        pn = kernels.packed_nbytes(numel, cfg.bits)

        def split(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return b[8 * nb: 8 * nb + pn], b[: 8 * nb].view(torch.float32).view(nb, 2)

        packed_out, meta_out = split(out)
        kernels.reduce_quantize([split(b) for b in bufs], numel, cfg.bits, cfg.block_size, divisor,
                                cfg.stochastic, seed, packed_out=packed_out, meta_out=meta_out, acc=acc)
        return
    for i, b in enumerate(bufs):
        decode_chunk(b, numel, cfg, acc, accumulate=i > 0)
    acc.div_(divisor)
    encode_chunk(acc, cfg, out, seed=seed)


def decode_chunk(buf: torch.Tensor, numel: int, cfg: CodecConfig, out: torch.Tensor,
                 accumulate: bool = False) -> None:
    """Decode one chunk into fp32 ``out`` (``+=`` when accumulating)."""
    if cfg.codec is not Codec.TOPK:
        decode_dense(buf, numel, cfg, out, accumulate=accumulate)
        return
    if not accumulate:
        out.zero_()
    if numel:
        decode_topk_add(buf, numel, cfg, out)


def chunk_finite(buf: torch.Tensor, numel: int, cfg: CodecConfig) -> torch.Tensor:
    """Whether an encoded chunk decodes to finite values (a 0-d bool tensor; no sync): read from the
    quantization metadata or the top-k values, or from the fp32/fp16/bf16 values themselves."""
    if numel == 0:
        return torch.ones((), dtype=torch.bool, device=buf.device)
    c = cfg.codec
    if c is Codec.QUANTIZE:
        nb = kernels.num_blocks(numel, cfg.block_size)
        return torch.isfinite(buf[: 8 * nb].view(torch.float32)).all()
    if c is Codec.TOPK:
        k = cfg.topk_k(numel)
        vcfg = _topk_value_cfg(cfg)
        if vcfg is None:
            return torch.isfinite(buf[: 4 * k].view(torch.float32)).all()
        return chunk_finite(buf, k, vcfg)
    if c is Codec.FP32:
        return torch.isfinite(buf[: 4 * numel].view(torch.float32)).all()
    return torch.isfinite(buf[: 2 * numel].view(torch.float16 if c is Codec.FP16 else torch.bfloat16)).all()


# -- planning helpers -------------------------------------------------------------------------------
def _dense_rank_bytes(numel: int, cfg: CodecConfig, world_size: int) -> float:
    return 2.0 * (world_size - 1) / world_size * dense_nbytes(numel, cfg)


def effective_config(cfg: CodecConfig, numel: int, world_size: int) -> CodecConfig:
    """The codec a layer really uses at ``world_size``: top-k falls back to its dense codec where its
    all_gather traffic ((W-1) messages per rank) would exceed a scatter-reduce-allgather's."""
    if cfg.codec is not Codec.TOPK or world_size <= 1:
        return cfg
    if cfg.fallback_bits is None:
        dense = RECIPES["none"]
    else:
        dense = CodecConfig(codec=Codec.QUANTIZE, bits=cfg.fallback_bits, block_size=cfg.block_size,
                            stochastic=cfg.stochastic, error_feedback=cfg.error_feedback,
                            residual_dtype=cfg.residual_dtype)
    sparse_bytes = (world_size - 1) * topk_nbytes(numel, cfg)
    if sparse_bytes > _dense_rank_bytes(numel, dense, world_size):
        return dense
    return cfg


def wire_bytes(numel: int, cfg: CodecConfig, world_size: int) -> int:
    """Bytes this rank sends per step for one tensor (as counted in ``state.stats()['bytes_sent']``)."""
    if world_size <= 1:
        return 0
    cfg = effective_config(cfg, numel, world_size)
    if cfg.codec is Codec.TOPK:
        return (world_size - 1) * topk_nbytes(numel, cfg)
    return int(round(_dense_rank_bytes(numel, cfg, world_size)))


def reduce_scatter_bytes(chunk_numels: list[int], cfg: CodecConfig, rank: int | None = None) -> int:
    """Bytes one rank sends for one tensor in a compressed reduce-scatter whose chunk ``j`` (the part
    rank ``j`` owns) has ``chunk_numels[j]`` elements: every chunk but its own (``rank``; None: the
    mean over ranks), each encoded on its own."""
    sizes = [chunk_nbytes(n, cfg) for n in chunk_numels]
    if rank is not None:
        return sum(sizes) - sizes[rank]
    W = len(sizes)
    return int(round(sum(sizes) * (W - 1) / W)) if W else 0


@torch.no_grad()
def roundtrip(x: torch.Tensor, cfg: CodecConfig, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Encode and decode one tensor locally: ``(decoded fp32 tensor shaped like x, encoded bytes)``.

    No error feedback and no communication: this measures the codec's own error on a real gradient.
    """
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    out = torch.zeros(n, dtype=torch.float32, device=flat.device)
    if cfg.codec is Codec.TOPK:
        nbytes = topk_nbytes(n, cfg)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
        encode_topk(flat, cfg, buf, seed=seed)
        decode_topk_add(buf, n, cfg, out)
    else:
        nbytes = dense_nbytes(n, cfg)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
        encode_dense(flat, cfg, buf, seed=seed)
        decode_dense(buf, n, cfg, out)
    return out.view_as(x), nbytes
