"""The wire interface: one chunk of any codec, reached through its settings.

The collectives (:mod:`fastml_strategy.collective`, :mod:`fastml_strategy.fsdp`) reach a codec through
the functions below, one per method (``encode_chunk`` is ``codec_for(cfg).encode``, and so on), always
as attributes of the package (``codecs.encode_chunk``): a chunk's bytes are only ever read or written
here, and a test can replace one function of :mod:`fastml_strategy.codecs` to make every collective fail
at that point. ``roundtrip`` and ``wire_bytes`` serve the autotuner: the first applies a codec to one
tensor locally (no communication), the second predicts a layer's codec bytes on the wire per step
(without the 64-byte message headers, which ``state.stats()['bytes_sent']`` counts too).

A reduce-scatter never re-encodes a sum, so top-k works there like a dense codec: each rank encodes
the chunk it sends to rank j (top-k of that chunk), and rank j adds the W messages it receives.
"""

from __future__ import annotations

import torch

from fastml_strategy.codecs._base import CodecConfig, WireCodec, codec_for
from fastml_strategy.codecs.topk import TopkCodec

__all__ = [
    "is_sparse", "wire_config", "chunk_unit", "chunk_nbytes", "encode_chunk", "decode_chunk", "reduce_chunk",
    "chunk_finite", "encode_topk_ef", "dense_nbytes", "encode_dense", "decode_dense", "topk_nbytes",
    "encode_topk", "decode_topk_add", "effective_config", "wire_bytes", "reduce_scatter_bytes", "roundtrip",
]


def is_sparse(cfg: CodecConfig) -> bool:
    """Whether messages of ``cfg`` are all-gathered and scatter-added by every rank (top-k: a sum of
    sparse vectors is not sparse), rather than scatter-reduced with the chunk sum re-encoded."""
    return codec_for(cfg).sparse


def wire_config(cfg: CodecConfig, dtype: torch.dtype) -> CodecConfig:
    """The codec that carries ``cfg`` for gradients of ``dtype`` (:meth:`WireCodec.wire_config`: an
    uncompressed (fp32) layer whose gradients are already fp16/bf16 travels in that dtype, exactly and
    in half the bytes)."""
    return codec_for(cfg).wire_config(dtype)


def chunk_unit(cfg: CodecConfig) -> int:
    """:meth:`WireCodec.chunk_unit` of ``cfg``'s codec."""
    return codec_for(cfg).chunk_unit()


def chunk_nbytes(numel: int, cfg: CodecConfig) -> int:
    """:meth:`WireCodec.nbytes`: encoded bytes of one chunk (or one whole top-k message) of ``numel``
    elements, a multiple of 4."""
    return codec_for(cfg).nbytes(numel)


def encode_chunk(x: torch.Tensor, cfg: CodecConfig, out: torch.Tensor, residual: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None, seed: int = 0) -> None:
    """:meth:`WireCodec.encode`: one chunk ``x`` into ``out`` (``chunk_nbytes`` long), with error
    feedback when ``residual`` is given."""
    codec_for(cfg).encode(x, out, residual, residual_out, seed)


def decode_chunk(buf: torch.Tensor, numel: int, cfg: CodecConfig, out: torch.Tensor,
                 accumulate: bool = False) -> None:
    """:meth:`WireCodec.decode`: one chunk into fp32 ``out`` (``+=`` when accumulating)."""
    codec_for(cfg).decode(buf, numel, out, accumulate)


def reduce_chunk(bufs: list[torch.Tensor], numel: int, cfg: CodecConfig, out: torch.Tensor, divisor: float,
                 acc: torch.Tensor, seed: int = 0) -> None:
    """:meth:`WireCodec.reduce`: decode ``bufs``, sum in order, divide by ``divisor``, encode into
    ``out``."""
    codec_for(cfg).reduce(bufs, numel, out, divisor, acc, seed)


def chunk_finite(buf: torch.Tensor, numel: int, cfg: CodecConfig) -> torch.Tensor:
    """:meth:`WireCodec.finite`: whether an encoded chunk decodes to finite values (a 0-d bool tensor;
    no sync)."""
    return codec_for(cfg).finite(buf, numel)


# -- one family (the functions before the codec classes; kept for callers that name a family) ----------
def _dense(cfg: CodecConfig) -> WireCodec:
    codec = codec_for(cfg)
    if codec.sparse:
        raise ValueError(f"{cfg.codec} is not a dense codec")
    return codec


def dense_nbytes(numel: int, cfg: CodecConfig) -> int:
    """Encoded size in bytes of ``numel`` elements under a dense codec."""
    return _dense(cfg).nbytes(numel)


def encode_dense(x: torch.Tensor, cfg: CodecConfig, out: torch.Tensor, residual: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None, seed: int = 0) -> None:
    """:meth:`WireCodec.encode` of a dense codec."""
    _dense(cfg).encode(x, out, residual, residual_out, seed)


def decode_dense(buf: torch.Tensor, numel: int, cfg: CodecConfig, out: torch.Tensor,
                 accumulate: bool = False) -> None:
    """:meth:`WireCodec.decode` of a dense codec."""
    _dense(cfg).decode(buf, numel, out, accumulate)


def _topk(cfg: CodecConfig) -> TopkCodec:
    codec = codec_for(cfg)
    if not isinstance(codec, TopkCodec):
        raise ValueError(f"{cfg.codec} is not top-k")
    return codec


def topk_nbytes(numel: int, cfg: CodecConfig) -> int:
    """Bytes of one rank's top-k message for a tensor of ``numel`` elements: values then indices."""
    return _topk(cfg).nbytes(numel)


def encode_topk(v: torch.Tensor, cfg: CodecConfig, out: torch.Tensor,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`TopkCodec.select`."""
    return _topk(cfg).select(v, out, seed)


def decode_topk_add(buf: torch.Tensor, numel: int, cfg: CodecConfig, out: torch.Tensor) -> torch.Tensor:
    """:meth:`TopkCodec.add_to`."""
    return _topk(cfg).add_to(buf, numel, out)


def encode_topk_ef(x: torch.Tensor, cfg: CodecConfig, out: torch.Tensor, residual: torch.Tensor | None = None,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`TopkCodec.encode_rest`: the message of ``x + residual``, and ``(rest, finite)``."""
    return _topk(cfg).encode_rest(x, out, residual, seed)


# -- planning helpers -------------------------------------------------------------------------------
def effective_config(cfg: CodecConfig, numel: int, world_size: int, shape=None) -> CodecConfig:
    """The codec a layer really uses at ``world_size`` (:meth:`WireCodec.effective`, each codec's
    fallback rule): top-k falls back to its dense codec where its all_gather traffic ((W-1) messages per
    rank) would exceed a scatter-reduce-allgather's; low-rank to fp32 for a tensor whose ``shape``
    (None: unknown, a flat vector) it cannot compress with gain."""
    return codec_for(cfg).effective(numel, world_size, shape)


def wire_bytes(numel: int, cfg: CodecConfig, world_size: int, shape=None) -> int:
    """Codec bytes this rank sends per step for one tensor (``state.stats()['bytes_sent']`` counts
    these plus the 64-byte header of each message), after the codec's fallback rule
    (:meth:`WireCodec.rank_bytes`). A low-rank layer's (``shape`` given): its factors' share of the
    bucket's two factor rounds."""
    if world_size <= 1:
        return 0
    cfg = effective_config(cfg, numel, world_size, shape)
    return int(round(codec_for(cfg).rank_bytes(numel, world_size, shape)))


def reduce_scatter_bytes(chunk_numels: list[int], cfg: CodecConfig, rank: int | None = None) -> int:
    """Bytes one rank sends for one tensor in a compressed reduce-scatter whose chunk ``j`` (the part
    rank ``j`` owns) has ``chunk_numels[j]`` elements: every chunk but its own (``rank``; None: the
    mean over ranks), each encoded on its own."""
    sizes = [chunk_nbytes(n, cfg) for n in chunk_numels]
    if rank is not None:
        return sum(sizes) - sizes[rank]
    W = len(sizes)
    return int(round(sum(sizes) * (W - 1) / W)) if W else 0


def roundtrip(x: torch.Tensor, cfg: CodecConfig, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Encode and decode one tensor locally (:meth:`WireCodec.roundtrip`): ``(decoded fp32 tensor
    shaped like x, encoded bytes)``. No error feedback and no communication: this measures the codec's
    own error on a real gradient. A low-rank codec approximates ``x`` viewed as a matrix; a tensor it
    does not compress takes its fallback, fp32."""
    return codec_for(cfg).roundtrip(x, seed)
