"""The fp8 codec: each element as one float8 e4m3 byte, scaled per block so that the block's largest
magnitude lands on e4m3's largest finite value (448), with error feedback. Added as the registry's
example: this module (and the example settings in tests/test_codec_contract.py, and its digests) is all
it took; plans take ``{"codec": "fp8"}`` or the recipe ``fp8``, and the autotuner searches it.

Algorithm (one chunk of ``n`` elements, blocks of ``block_size``)
--------------------------------------------------------------------
1. ``v = x + residual`` in fp32 (error feedback; ``x`` alone without a residual).
2. Per block: ``amax = max |v|`` and ``scale = amax / 448`` (a division by a tensor, so CUDA and CPU
   round it alike); a zero block has scale 0 and codes 0.
3. ``code = e4m3(v / scale)`` (round to nearest even; ``|v / scale| <= 448``, clamped against the
   division's last bit). The chunk is ``[scales: fp32 per block | codes: one byte per element]``,
   padded to 4 bytes.
4. Decode: ``y = fp32(code) * scale``; the new residual is ``v - y``.
A block holding a NaN or inf sends scale NaN (codes 0): it decodes to NaN on every rank (GradScaler
skips the step everywhere) and its residual stays as it was.

Trade-off against int8 quantization (the same 8 bits plus 4 bytes per block): e4m3 keeps about 2
significant decimal digits at every magnitude (a floating-point code: relative error <= 2^-4 per
element), where max-min int8 spends its 255 levels evenly between the block's minimum and maximum, so
small entries of a block with one large outlier fare better under fp8, and a block of similar
magnitudes better under int8. The kernel is the pure-torch code below (it is also the reference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastml_strategy.codecs._base import (DEFAULT_BLOCK_SIZE, ResidualConfig, WireCodec, align4, all_finite,
                                          check_block_size, register_codec, store)

__all__ = ["Fp8Config", "Fp8Codec", "E4M3_MAX"]

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448


@dataclass(frozen=True)
class Fp8Config(ResidualConfig):
    """fp8 e4m3 with a scale per block (``CodecConfig(codec="fp8")``): 8 bits per element plus 32 bits
    per block (8.0625 bits per element with the default block of 512)."""

    # Elements per scaling block (power of two, 8..65536): smaller blocks follow the gradient's
    # magnitude more closely, at 4 bytes of scale each.
    block_size: int = DEFAULT_BLOCK_SIZE

    def check(self, fail) -> None:
        check_block_size(self, fail)
        super().check(fail)


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


@register_codec("fp8")
class Fp8Codec(WireCodec):
    """fp8 e4m3 codes with an fp32 scale per block: ``[scales | codes]`` (see the module docstring)."""

    settings = Fp8Config
    family = "fp8"
    error_feedback = True
    recipes = {"fp8": Fp8Config()}
    candidates = recipes  # searched per layer; no uniform baseline of its own (int8 is that point)
    __slots__ = ()

    # -- the wire format ---------------------------------------------------------------------------------
    def chunk_unit(self) -> int:
        return self.cfg.block_size

    def _meta_nbytes(self, numel: int) -> int:
        return 4 * _blocks(numel, self.cfg.block_size)

    def nbytes(self, numel: int) -> int:
        return self._meta_nbytes(numel) + align4(numel)

    def split(self, buf, numel) -> tuple[torch.Tensor, torch.Tensor]:
        m = self._meta_nbytes(numel)
        return buf[:m], buf[m: m + numel]

    def _views(self, buf: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta, codes = self.split(buf, numel)
        return meta.view(torch.float32), codes.view(E4M3)

    def _padded(self, v: torch.Tensor) -> torch.Tensor:
        """``v`` as ``[blocks, block_size]``, the last block padded with zeros."""
        bs, n = self.cfg.block_size, v.numel()
        nb = _blocks(n, bs)
        if n == nb * bs:
            return v.view(nb, bs)
        out = torch.zeros(nb * bs, dtype=torch.float32, device=v.device)
        out[:n] = v
        return out.view(nb, bs)

    # -- the work -------------------------------------------------------------------------------------------
    def _quantize(self, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the chunk of fp32 ``v`` into ``out``; returns what it decodes to (fp32, n)."""
        n = v.numel()
        scales, codes = self._views(out, n)
        if n == 0:
            return v
        blocks = self._padded(v)
        amax = blocks.abs().amax(dim=1)
        finite = torch.isfinite(blocks).all(dim=1)
        scale = amax / torch.full((), E4M3_MAX, dtype=torch.float32, device=v.device)
        inv = torch.where((scale > 0) & finite, 1.0 / scale, torch.zeros_like(scale))
        q = (blocks.nan_to_num(0.0, 0.0, 0.0) * inv[:, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
        scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
        scales.copy_(scale)
        codes.copy_(q.view(-1)[:n])
        return (q.to(torch.float32) * scale[:, None]).view(-1)[:n]

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        v = x.to(torch.float32, copy=residual is not None)
        if residual is not None:
            v += residual
        y = self._quantize(v, out)
        if residual is not None and v.numel():
            # a block that is not finite keeps its residual (y is NaN there)
            keep = torch.isnan(y)
            (residual if residual_out is None else residual_out).copy_(torch.where(keep, residual.float(), v - y))

    def decode(self, buf, numel, out, accumulate=False) -> None:
        if numel == 0:
            return
        scales, codes = self._views(buf, numel)
        bs = self.cfg.block_size
        store(out, codes.to(torch.float32) * scales.repeat_interleave(bs)[:numel], accumulate)

    def finite(self, buf, numel) -> torch.Tensor:
        if numel == 0:
            return torch.ones((), dtype=torch.bool, device=buf.device)
        return all_finite(self._views(buf, numel)[0])
