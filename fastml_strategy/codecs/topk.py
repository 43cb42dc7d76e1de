"""The top-k codec: the ``k`` largest-magnitude entries of a tensor (a fraction ``topk`` or a count
``topk_count``), their values in fp32 or quantized to ``bits``, then their int32 indices; with error
feedback (without it top-k does not converge).

Top-k messages are not summed and re-encoded (a sum of sparse vectors is not sparse): every rank
all-gathers them and scatter-adds in rank order (:mod:`fastml_strategy.collective`). That traffic
grows with the world size, so the codec's fallback rule (:meth:`TopkCodec.effective`) switches a layer
to a dense codec where the all_gather would send more: quantize at ``fallback_bits``, or fp32. In a
reduce-scatter (nothing re-encoded) a chunk's message is the top-k of that chunk.

The selection (:func:`select_topk`) is its kernel: a sampled threshold, then ``torch.topk`` of the
candidates; the decode is ``index_add_``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fastml_strategy.codecs._base import (DEFAULT_BLOCK_SIZE, CodecConfig, ResidualConfig, WireCodec, all_finite,
                                          check_bits, check_block_size, check_bool, codec_for, register_codec,
                                          ring_bytes)
from fastml_strategy._validate import _is_int, type_problem
from fastml_strategy.codecs.plain import Fp32Config
from fastml_strategy.codecs.quantize import QuantizeCodec, QuantizeConfig

__all__ = ["TopkConfig", "TopkCodec", "select_topk"]


@dataclass(frozen=True)
class TopkConfig(ResidualConfig):
    """Top-k sparsification of one tensor (``CodecConfig(codec="topk", topk=0.01)``)."""

    legacy = True
    # fraction of entries kept, in (0, 1]; or an exact count (topk_count wins if both are set)
    topk: float | None = None
    topk_count: int | None = None
    # bits of the selected values (None = fp32 values), quantized in one block layout of k elements
    bits: int | None = None
    # the values' quantization block, and the fallback's
    block_size: int = DEFAULT_BLOCK_SIZE
    stochastic: bool = False
    # Sparse all_gather traffic grows with the world size (each rank receives W-1 sparse messages).
    # At the world size where top-k would send more than a scatter-reduce-allgather quantized to
    # ``fallback_bits`` (None: fp32 ring all-reduce), the layer falls back to that dense codec.
    fallback_bits: int | None = 8

    def check(self, fail) -> None:
        if self.topk_count is None and self.topk is None:
            fail("topk", "is not set", "give a fraction in (0, 1] (topk=0.01 keeps 1%) or topk_count")
        if self.topk_count is not None and (not _is_int(self.topk_count) or self.topk_count < 1):
            fail("topk_count", type_problem(self.topk_count) or f"is {self.topk_count!r}", "give a whole number >= 1")
        if self.topk is not None and (
            isinstance(self.topk, bool) or not isinstance(self.topk, (int, float))
            or not 0.0 < float(self.topk) <= 1.0
        ):
            fail("topk", type_problem(self.topk, number=True) or f"is {self.topk!r}, outside (0, 1]",
                 "give the kept fraction, e.g. topk=0.01 for 1%")
        check_bits(self.bits, fail, "quantized top-k values take 1 to 8 bits (None: fp32)", optional=True)
        check_bits(self.fallback_bits, fail, "use 1-8, or None for fp32", name="fallback_bits", optional=True)
        check_block_size(self, fail)
        check_bool(self, "stochastic", fail)
        super().check(fail)

    def label(self) -> str:
        amount = f"{self.topk_count}" if self.topk_count is not None else f"{self.topk * 100:g}%"
        return f"topk{amount}" + (f"-int{self.bits}" if self.bits else "")

    def topk_k(self, numel: int) -> int:
        """How many entries top-k keeps of a tensor of ``numel`` elements (at least 1, unless the
        tensor is empty)."""
        if numel <= 0:
            return 0
        if self.topk_count is not None:
            return max(1, min(int(self.topk_count), numel))
        return max(1, min(numel, int(-(-numel * float(self.topk) // 1))))


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


@register_codec("topk")
class TopkCodec(WireCodec):
    """The ``k`` largest-magnitude entries: a message is their values (fp32, or quantized with
    ``bits`` in one block layout of ``k`` elements) then their int32 indices. All-gathered and
    scatter-added in rank order; in a reduce-scatter (nothing re-encoded) a chunk's message is the
    top-k of that chunk."""

    settings = TopkConfig
    family = "topk"
    error_feedback = True
    sparse = True
    recipes = {"topk1": TopkConfig(topk=0.01), "topk1-int4": TopkConfig(topk=0.01, bits=4)}
    candidates = {"topk10": TopkConfig(topk=0.10), **recipes}
    uniform = ("topk1",)
    check = "topk1"
    __slots__ = ("values",)

    def __init__(self, cfg: TopkConfig) -> None:
        super().__init__(cfg)
        # the codec of the selected values (None: fp32 values)
        self.values: QuantizeCodec | None = None if cfg.bits is None else codec_for(
            QuantizeConfig(bits=cfg.bits, block_size=cfg.block_size, stochastic=cfg.stochastic))

    def _value_nbytes(self, k: int) -> int:
        return 4 * k if self.values is None else self.values.nbytes(k)

    def effective(self, numel: int, world_size: int, shape=None) -> CodecConfig:
        """The fallback rule: at the world size where this layer's all_gather ((W-1) messages per
        rank) would send more than a scatter-reduce-allgather of the dense codec ``fallback_bits``
        names (quantize at those bits; None: fp32), the layer takes that dense codec."""
        cfg = self.cfg
        if world_size <= 1:
            return cfg
        if cfg.fallback_bits is None:
            dense: CodecConfig = Fp32Config()
        else:
            dense = QuantizeConfig(bits=cfg.fallback_bits, block_size=cfg.block_size, stochastic=cfg.stochastic,
                                   error_feedback=cfg.error_feedback, residual_dtype=cfg.residual_dtype)
        sparse_bytes = (world_size - 1) * self.nbytes(numel)
        if sparse_bytes > ring_bytes(codec_for(dense).nbytes(numel), world_size):
            return dense
        return cfg

    def rank_bytes(self, numel: int, world_size: int, shape=None) -> float:
        return (world_size - 1) * self.nbytes(numel)  # one message to each peer (all_gather)

    def density(self, numel: int) -> float:
        return self.cfg.topk_k(numel) / numel if numel > 0 else 0.0

    def part_unit(self) -> int:
        # a part may take the dense fallback (effective_config): its quantization block
        return int(self.cfg.block_size)

    def nbytes(self, numel: int) -> int:
        k = self.cfg.topk_k(numel)
        return self._value_nbytes(k) + 4 * k

    def split(self, buf, numel) -> tuple[torch.Tensor, torch.Tensor]:
        # metadata: the quantized values' block metadata; codes: the values' codes, then the indices
        meta = buf[:0] if self.values is None else self.values.split(buf, self.cfg.topk_k(numel))[0]
        return meta, buf[meta.numel(): self.nbytes(numel)]

    def select(self, v: torch.Tensor, out: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Select the ``k`` largest-magnitude entries of fp32 ``v``; write values + int32 indices to
        ``out``. Returns ``(indices, decoded values)``: what the message decodes to at the selected
        indices (the values as the receiver sees them), so the caller can form the error-feedback
        residual ``v - decoded`` in place. A non-finite ``v`` poisons the first value with NaN, so
        every rank sees it (one max-reduction of ``|v|`` tells: it is NaN or inf exactly when ``v``
        is not finite)."""
        n = v.numel()
        k = self.cfg.topk_k(n)
        a = v.abs()
        idx = select_topk(a, k)
        vals = v[idx]
        if n:  # on the device: no host read
            vals[:1].masked_fill_(~torch.isfinite(a.max()), float("nan"))
        vbytes = self._value_nbytes(k)
        if self.values is None:
            out[:vbytes].view(torch.float32).copy_(vals)
            sent = vals
        else:
            self.values.encode(vals, out[:vbytes], seed=seed)
            sent = torch.empty(k, dtype=torch.float32, device=v.device)
            self.values.decode(out[:vbytes], k, sent)
        out[vbytes: vbytes + 4 * k].view(torch.int32).copy_(idx)
        return idx, sent

    def encode_rest(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode the message of ``x + residual`` (``x`` alone without one) into ``out``. Returns
        ``(rest, finite)``: ``rest`` a fresh fp32 tensor, the input minus what the message decodes to
        (the new residual under error feedback; the compression error otherwise), ``finite`` a 0-d bool
        tensor, whether the message decodes to finite values (when not, the step is skipped on every
        rank and ``rest`` must not become the residual)."""
        if residual is not None and x.dtype == residual.dtype == torch.float32:
            v = torch.add(x, residual)  # one pass
        else:
            v = x.to(torch.float32, copy=True)
            if residual is not None:
                v += residual
        idx, sent = self.select(v, out, seed=seed)
        v[idx] -= sent
        return v, all_finite(sent)

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        if x.numel() == 0:
            return
        if residual is None:
            self.select(x.to(torch.float32), out, seed=seed)
            return
        r32 = residual.to(torch.float32)  # itself when fp32
        rest, finite = self.encode_rest(x, out, r32, seed)
        # decided on the device: a non-finite message leaves the residual as it was
        (residual if residual_out is None else residual_out).copy_(torch.where(finite, rest, r32))

    def add_to(self, buf: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
        """Scatter-add one rank's message into fp32 ``out``; returns whether its values are all finite
        (a 0-d bool tensor: checking k values is cheaper than checking the dense result)."""
        k = self.cfg.topk_k(numel)
        vbytes = self._value_nbytes(k)
        if self.values is None:
            vals = buf[:vbytes].view(torch.float32)
        else:
            vals = torch.empty(k, dtype=torch.float32, device=out.device)
            self.values.decode(buf[:vbytes], k, vals)
        # Clamped: a rank that failed sends whatever its buffer held (the error travels in the header
        # and every rank raises at the end of the step), and an index out of range must not reach
        # index_add_ (a device-side assert on CUDA). A valid message's indices are all below numel.
        idx = buf[vbytes: vbytes + 4 * k].view(torch.int32).to(torch.int64).clamp_(0, max(numel - 1, 0))
        out.index_add_(0, idx, vals)
        return all_finite(vals)

    def decode(self, buf, numel, out, accumulate=False) -> None:
        if not accumulate:
            out.zero_()
        if numel:
            self.add_to(buf, numel, out)

    def finite(self, buf, numel) -> torch.Tensor:
        if numel == 0:
            return torch.ones((), dtype=torch.bool, device=buf.device)
        k = self.cfg.topk_k(numel)
        if self.values is None:
            return all_finite(buf[: 4 * k].view(torch.float32))
        return self.values.finite(buf, k)
