"""The plain codecs: a chunk is the values themselves. ``fp32`` as it is (exact: a plan's ``none``,
and the batched small tensors of every plan), ``fp16`` and ``bf16`` cast for the wire and summed in
fp32 (half the bytes; no residual: the error of a cast is tiny). They have no settings.

These three may carry the hop inside a machine of the hierarchical all-reduce (``Plan.intra_node``),
and an uncompressed layer whose gradients are already fp16/bf16 travels in that dtype
(:meth:`Fp32Codec.wire_config`), exactly and in half the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fastml_strategy.codecs._base import CodecConfig, WireCodec, align4, all_finite, register_codec, store

__all__ = ["Fp32Config", "Fp16Config", "Bf16Config", "Fp32Codec", "Fp16Codec", "Bf16Codec"]


@dataclass(frozen=True)
class Fp32Config(CodecConfig):
    """fp32 as it is (no settings)."""

    legacy = True


@dataclass(frozen=True)
class Fp16Config(CodecConfig):
    """Cast to fp16 (no settings)."""

    legacy = True


@dataclass(frozen=True)
class Bf16Config(CodecConfig):
    """Cast to bf16 (no settings)."""

    legacy = True


class _PlainCodec(WireCodec):
    """The chunk is the values themselves, in ``dtype`` (4-byte aligned)."""

    dtype: ClassVar[torch.dtype]
    intra_node = True
    __slots__ = ()

    def nbytes(self, numel: int) -> int:
        return align4(numel * self.dtype.itemsize)

    def split(self, buf: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        return buf[:0], buf[: numel * self.dtype.itemsize]

    def _values(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        return buf[: numel * self.dtype.itemsize].view(self.dtype)

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        self._values(out, x.numel()).copy_(x)

    def decode(self, buf, numel, out, accumulate=False) -> None:
        store(out, self._values(buf, numel), accumulate)

    def finite(self, buf, numel) -> torch.Tensor:
        if numel == 0:
            return torch.ones((), dtype=torch.bool, device=buf.device)
        return all_finite(self._values(buf, numel))


# Named recipes: "none" compresses nothing: every bucket is all-reduced the way DDP's own hook does it
# (divide by W, one all-reduce in the gradients' dtype), so the result is DDP's, bit for bit; FastML
# adds one 64-byte status all_gather per step (fail-fast on a decode error).
@register_codec("fp32")
class Fp32Codec(_PlainCodec):
    """fp32 as it is: exact (a plan's ``none``; the batched small tensors)."""

    settings = Fp32Config
    family = "fp32"
    lossy = False
    dtype = torch.float32
    recipes = {"none": Fp32Config()}
    # "none" keeps every plan with error 0 reachable (uncompressed is always feasible)
    candidates = recipes
    uniform = ("none",)
    __slots__ = ()

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        out.view(torch.float32).copy_(x)  # ``out`` is exactly 4 bytes per element: no slice to take

    def wire_config(self, dtype: torch.dtype) -> CodecConfig:
        if dtype == torch.float16:
            return Fp16Config()
        return Bf16Config() if dtype == torch.bfloat16 else self.cfg


@register_codec("fp16")
class Fp16Codec(_PlainCodec):
    """Cast to fp16 for the wire, summed in fp32; no residual (the error of a cast is tiny)."""

    settings = Fp16Config
    family = "cast"
    dtype = torch.float16
    recipes = {"fp16": Fp16Config()}
    candidates = recipes
    uniform = ("fp16",)
    __slots__ = ()


@register_codec("bf16")
class Bf16Codec(_PlainCodec):
    """Cast to bf16 for the wire, summed in fp32; no residual. Not searched by the autotuner: fp16
    already spans its error and bytes."""

    settings = Bf16Config
    family = "cast"
    dtype = torch.bfloat16
    recipes = {"bf16": Bf16Config()}
    __slots__ = ()
