"""The quantize codec: max-min per block of ``block_size`` elements, ``bits`` (1-8) per element,
bit-packed, round to nearest or stochastic, with error feedback; scatter-reduce-allgather.

A chunk is laid out as :func:`fastml_strategy.kernels.reference.chunk_layout` says (``[metadata |
codes]``: each block's fp32 ``(min, scale)``, then the packed codes, in the format of
:mod:`fastml_strategy.kernels.reference`). Its kernels (:mod:`fastml_strategy.kernels`: Triton, the
compiled CPU path and the pure-torch reference, byte for byte alike) encode, decode and fuse the
reduce step; on a GPU, segment tables encode or decode every chunk of many layers in one launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastml_strategy import kernels
from fastml_strategy.codecs._base import (DEFAULT_BLOCK_SIZE, ResidualConfig, WireCodec, all_finite, check_bits,
                                          check_block_size, check_bool, register_codec)

__all__ = ["QuantizeConfig", "QuantizeCodec"]


@dataclass(frozen=True)
class QuantizeConfig(ResidualConfig):
    """Max-min quantization of one tensor (``CodecConfig(codec="quantize", bits=4)``)."""

    legacy = True
    # bits per element (1-8): int4 sends 4.125 bits per element with the default block
    bits: int | None = None
    # Elements per max-min block (power of two, 8..65536). Smaller: more accurate, more metadata
    # (8 bytes per block).
    block_size: int = DEFAULT_BLOCK_SIZE
    # Stochastic rounding: unbiased, noisier; seeded by (seed, rank, step), so runs are reproducible.
    stochastic: bool = False

    def check(self, fail) -> None:
        check_bits(self.bits, fail, "quantization takes 1 to 8 bits per element")
        check_block_size(self, fail)
        check_bool(self, "stochastic", fail)
        super().check(fail)

    def label(self) -> str:
        return f"int{self.bits}" + ("-sr" if self.stochastic else "")


def _q(bits: int, **kw) -> QuantizeConfig:
    return QuantizeConfig(bits=bits, **kw)


@register_codec("quantize")
class QuantizeCodec(WireCodec):
    """Max-min per block of ``block_size`` elements, ``bits`` per element, bit-packed, optionally
    with stochastic rounding; a chunk is laid out as
    :func:`fastml_strategy.kernels.reference.chunk_layout` says (``[metadata | codes]``), the codes in
    the format of :mod:`fastml_strategy.kernels.reference`."""

    settings = QuantizeConfig
    family = "quantize"
    error_feedback = True
    segment_tables = True
    recipes = {"int8": _q(8), "int4": _q(4), "int2": _q(2), "int4-sr": _q(4, stochastic=True)}
    # int4-sr is left out of the search (int4 spans its error and bytes); int6 and int3 lie between the
    # recipes; "-noef" drops error feedback, saving the residual memory at the price of bias.
    candidates = {"int8": _q(8), "int6": _q(6), "int4": _q(4), "int3": _q(3), "int2": _q(2),
                  "int4-noef": _q(4, error_feedback=False)}
    uniform = ("int8", "int4", "int2")
    check = "int4"  # the library's default recipe
    __slots__ = ()
    def chunk_unit(self) -> int:
        return self.cfg.block_size

    def layout(self, numel: int) -> kernels.ChunkLayout:
        return kernels.chunk_layout(numel, self.cfg.bits, self.cfg.block_size)

    def nbytes(self, numel: int) -> int:
        return self.layout(numel).nbytes

    def split(self, buf, numel) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.layout(numel)
        return buf[: lay.meta], buf[lay.meta: lay.meta + lay.codes]

    def _views(self, buf: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(metadata as fp32 [nblocks, 2], packed codes)``: what the kernels read and write."""
        meta, codes = self.split(buf, numel)
        return meta.view(torch.float32).view(-1, 2), codes

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        # The encoder writes metadata and codes straight into the message (offsets are 4-aligned);
        # the kernels take a bf16 residual themselves.
        c = self.cfg
        meta, codes = self._views(out, x.numel())
        kernels.quantize(x, c.bits, c.block_size, c.stochastic, seed, residual, residual_out,
                         packed_out=codes, meta_out=meta)

    def decode(self, buf, numel, out, accumulate=False) -> None:
        c = self.cfg
        meta, codes = self._views(buf, numel)
        kernels.dequantize(codes, meta, numel, c.bits, c.block_size, out=out, accumulate=accumulate)

    def reduce(self, bufs, numel, out, divisor, acc, seed=0) -> None:
        # one pass on the compiled CPU path (kernels.reduce_quantize)
        c = self.cfg
        meta_out, codes_out = self._views(out, numel)
        sources = [self._views(b, numel)[::-1] for b in bufs]  # (codes, meta) per message
        kernels.reduce_quantize(sources, numel, c.bits, c.block_size, divisor, c.stochastic, seed,
                                packed_out=codes_out, meta_out=meta_out, acc=acc)

    def finite(self, buf, numel) -> torch.Tensor:
        if numel == 0:
            return torch.ones((), dtype=torch.bool, device=buf.device)
        return all_finite(buf[: self.layout(numel).meta].view(torch.float32))  # the blocks' (min, scale)

    # -- segment tables: every chunk of many layers of this config in one launch (Triton) ------------
    def table_key(self) -> tuple:
        """Codecs with equal keys share a table: what the launch reads of the config."""
        c = self.cfg
        return (c.bits, c.block_size, c.stochastic, c.uses_residual)

    def encode_table(self, chunks, device) -> tuple[torch.Tensor, int]:
        """The table of an :meth:`encode_segments` launch; ``chunks``: ``(x_off, r_off, rout_off,
        msg_off, numel)`` per chunk (:func:`fastml_strategy.kernels.encode_table`, seeds 0)."""
        c = self.cfg
        return kernels.encode_table([(*ch, 0) for ch in chunks], c.bits, c.block_size, device)

    def decode_table(self, chunks, device) -> tuple[torch.Tensor, int]:
        """The table of a :meth:`decode_segments` launch; ``chunks``: ``(msg_off, out_off, numel)``."""
        return kernels.decode_table(chunks, self.cfg.bits, self.cfg.block_size, device)

    def set_table_seeds(self, table: torch.Tensor, numels, seeds) -> None:
        """Give an encode table's chunks (of ``numels`` elements) the stochastic-rounding ``seeds``
        (a pinned, non-blocking upload of one column on a GPU)."""
        col = kernels.seed_column(numels, seeds, self.cfg.block_size)
        if table.is_cuda:
            col = col.pin_memory()
        table[:, 7].copy_(col, non_blocking=table.is_cuda)

    def encode_segments(self, x: torch.Tensor, msg: torch.Tensor, table: tuple[torch.Tensor, int],
                        residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None) -> None:
        """Encode every chunk of ``table`` from ``x`` into ``msg`` (error feedback with ``residual``)."""
        c = self.cfg
        kernels.quantize_segments(x, msg, table[0], table[1], c.bits, c.block_size, c.stochastic, residual,
                                  residual_out)

    def decode_segments(self, msg: torch.Tensor, out: torch.Tensor, table: tuple[torch.Tensor, int],
                        sources: int = 1, src_stride: int = 0, accumulate: bool = False) -> torch.Tensor:
        """Decode (and sum ``sources`` copies of) every chunk of ``table`` into ``out``; returns whether
        all are finite (a 0-d bool tensor)."""
        c = self.cfg
        return kernels.dequantize_segments(msg, out, table[0], table[1], c.bits, c.block_size, sources,
                                           src_stride, accumulate)
