"""torch's PowerSGD DDP hook, priced: the low-rank baseline the autotuner's check compares against.

``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` (Vogels et al., NeurIPS 2019) is what a
user who knows gradient compression reaches for first, so the check before plan.json is written
trains it beside the tuned plan (:func:`fastml_strategy.autotune.calibrate.powersgd_curve`) and this
module predicts its step time. What the hook does with one DDP bucket, and so what is priced:

1. For the first ``start_powerSGD_iter`` steps (torch's default 1000) nothing is compressed: the
   bucket is one plain fp32 all-reduce, plain DDP's price.
2. After that, each gradient is viewed as a matrix ``(shape[0], numel / shape[0])`` (a 1-D tensor as
   ``(n, 1)``) and, with ``r' = min(n, m, r)``, compressed only when ``(n + m) r' * min_compression_rate
   < n m`` (``min_compression_rate`` 2 by default): biases, norms and small matrices never are.
3. The uncompressed tensors of the bucket are concatenated and all-reduced in fp32 (one all-reduce,
   issued even when empty); then ``P = M Q`` for every compressed matrix of the bucket in one flat
   fp32 buffer (sum of ``n r'``), all-reduced; ``P`` orthogonalised, ``Q = M^T P`` (sum of ``m r'``),
   all-reduced; ``M = P Q^T / W``. The hook batches all tensors of a bucket, so a bucket costs three
   all-reduces whatever its number of tensors, one after the other (each is issued from the previous
   one's future callback), each ``2(W-1)/W`` of its fp32 bytes per rank over a ring and ``2(W-1)``
   latency rounds.
4. Its compute (three batched matmuls of ``2 n m r'`` flops per matrix, the orthogonalisations, the
   error-feedback copies) is given as ``codec_s``: seconds per compressing step, measured by the check
   on torch's own hook (one rank, so no wire), split over buckets by their share of ``n m r'``. It
   runs on the processor backward uses, so backward ends that much later, as FastML's codec time does
   in :func:`~fastml_strategy.autotune.costmodel.ddp.step_time`.

gloo matches collectives by order of issue, and torch's hook issues its second and third all-reduce
from future callbacks, so on gloo it aborts as soon as DDP has two buckets ("Received data size
doesn't match expected size", DESIGN.md): the check and ``bench_autotune`` run it with one bucket
(:func:`one_bucket_mb`). This is also why it cannot be written as a FastML plan.json: it is a
different hook, which the report names ("torch PowerSGD rank r was faster") instead of replacing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

from fastml_strategy.autotune.catalog import HardwareOption
from fastml_strategy.autotune.costmodel.base import DEFAULT_INTRA_LINK, LayerProfile, Profile
from fastml_strategy.autotune.costmodel.ddp import ddp_buckets, step_time

# torch's PowerSGDState defaults (torch 2.13): compression deferred for 1000 steps, a tensor
# compressed only where it shrinks more than 2x
TORCH_START_ITER = 1000
TORCH_MIN_COMPRESSION_RATE = 2.0
# torch's own advice for start_powerSGD_iter ("start with 10% of total training steps"), and its
# minimum with error feedback or warm start (PowerSGDState raises below 2)
START_FRACTION = 0.1
MIN_START_ITER = 2


@dataclass(frozen=True)
class PowerSGDBucket:
    """Elements one bucket all-reduces once the hook compresses: the uncompressed tensors batched,
    then the P and Q factors of the compressed ones (each all-reduce in fp32); ``flops``: ``n m r'``
    summed over the compressed matrices (its share of the compute)."""

    uncompressed: int
    p: int
    q: int
    flops: int

    @property
    def elements(self) -> int:
        return self.uncompressed + self.p + self.q


def matrix_of(shape: Sequence[int] | None, numel: int) -> tuple[int, int]:
    """``(n, m)``: the hook's view ``tensor.view(tensor.shape[0], -1)`` of a gradient."""
    shape = list(shape) if shape else [numel]
    n = int(shape[0]) if shape else 1
    return n, (numel // n if n else 0)


def powersgd_bucket(shapes: Iterable[tuple[Sequence[int] | None, int]], rank: int,
                    min_compression_rate: float = TORCH_MIN_COMPRESSION_RATE) -> PowerSGDBucket:
    """What torch's hook all-reduces for one bucket of tensors ``(shape, numel)`` at ``rank``."""
    unc = p = q = flops = 0
    for shape, numel in shapes:
        n, m = matrix_of(shape, numel)
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            p, q, flops = p + n * r, q + m * r, flops + n * m * r
        else:
            unc += numel
    return PowerSGDBucket(unc, p, q, flops)


def one_bucket_mb(numel: int) -> float:
    """A DDP ``bucket_cap_mb`` that puts ``numel`` fp32 gradient elements in one bucket (torch's
    hook on gloo needs that; module docstring)."""
    return float(math.ceil(4 * numel / (1 << 20)) + 1)


def _layers_of(bucket: Sequence[LayerProfile]) -> list[tuple[Sequence[int] | None, int]]:
    return [(lp.shape, lp.numel) for lp in bucket]


def powersgd_bytes_per_rank(profile: Profile, rank: int, world_size: int, bucket_mb: float | None = None,
                            compressing: bool = True,
                            min_compression_rate: float = TORCH_MIN_COMPRESSION_RATE) -> int:
    """Bytes one rank sends per step with torch's hook over ``world_size`` ranks: the ring's
    ``2(W-1)/W`` of every all-reduced fp32 element (the bucket's before ``start_powerSGD_iter``,
    ``compressing=False``)."""
    if world_size <= 1:
        return 0
    total = 0
    for bucket in ddp_buckets(profile, bucket_mb):
        total += (powersgd_bucket(_layers_of(bucket), rank, min_compression_rate).elements if compressing
                  else sum(lp.numel for lp in bucket))
    return int(round(2.0 * (world_size - 1) / world_size * 4 * total))


@dataclass(frozen=True)
class PowerSGDStep:
    """torch's hook on one option: the step once it compresses, the plain DDP step before, and
    their mean over a run of ``steps`` steps that compresses from ``start`` on."""

    rank: int
    start: int
    steps: int
    step_s: float  # compressing
    plain_step_s: float  # the first ``start`` steps (vanilla all-reduce)
    codec_s: float
    wire_s: float
    bytes_per_rank: int  # compressing
    plain_bytes_per_rank: int

    @property
    def mean_step_s(self) -> float:
        k = min(self.start, self.steps)
        return (k * self.plain_step_s + (self.steps - k) * self.step_s) / max(self.steps, 1)


def powersgd_step_time(profile: Profile, option: HardwareOption, rank: int, codec_s: float,
                       start: int = TORCH_START_ITER, steps: int = TORCH_START_ITER,
                       bucket_mb: float | None = None,
                       min_compression_rate: float = TORCH_MIN_COMPRESSION_RATE) -> PowerSGDStep:
    """Predicted step of torch's PowerSGD hook at ``rank`` (module docstring) on ``option``: flat
    over its ``W`` ranks (the hook knows no machines), ``codec_s`` its compute per compressing step."""
    W = option.nodes * option.accelerators_per_node
    link = option.link if option.nodes > 1 else (option.intra_link or DEFAULT_INTRA_LINK)
    scale = profile.world_size / (W * option.compute_speed)
    fwd, bwd, opt = profile.forward_s * scale, profile.backward_s * scale, profile.optimizer_s * scale
    buckets = ddp_buckets(profile, bucket_mb)
    parts = [powersgd_bucket(_layers_of(b), rank, min_compression_rate) for b in buckets]
    flops = sum(p.flops for p in parts) or 1
    ring = 2.0 * (W - 1) / W if W > 1 else 0.0
    cpu_total = wire_total = end = 0.0
    nbytes = 0
    for bucket, part in zip(buckets, parts):
        c = codec_s * part.flops / flops / option.compute_speed
        b = int(round(ring * 4 * part.elements))
        w = (3 * 2 * (W - 1) * link.latency_s + b / link.bandwidth_Bps) if W > 1 else 0.0
        ready = max(lp.ready_s for lp in bucket) * scale
        end = max(end, ready) + c + w  # the bucket's three all-reduces wait on its own matmuls
        cpu_total, wire_total, nbytes = cpu_total + c, wire_total + w, nbytes + b
    step = fwd + max(bwd + cpu_total, end) + opt
    plain = step_time(profile, {}, option, hook=False, bucket_mb=bucket_mb, topology="flat")
    return PowerSGDStep(rank=rank, start=start, steps=steps, step_s=step, plain_step_s=plain.step_s,
                        codec_s=cpu_total, wire_s=wire_total, bytes_per_rank=nbytes,
                        plain_bytes_per_rank=plain.bytes_per_rank)


def calibration_start_iter(steps: int) -> int:
    """``start_powerSGD_iter`` for a run of ``steps`` steps: torch's own advice, 10% of the run, and
    at least 2 (its minimum with error feedback). torch's default, 1000, is longer than a calibration
    run: the hook would never compress in it, and its curve and time would be plain DDP's."""
    return max(MIN_START_ITER, int(round(START_FRACTION * steps)))


def words(st: PowerSGDStep) -> str:
    """``compressing from step 6: predicted 305 ms per step (2.34 s before, uncompressed), ...``."""
    def ms(s: float) -> str:
        return f"{1e3 * s:.4g} ms" if s < 1 else f"{s:.3g} s"

    return (f"compressing from step {st.start}: predicted {ms(st.step_s)} per step "
            f"({ms(st.plain_step_s)} before, uncompressed), {ms(st.mean_step_s)} on average over "
            f"{st.steps} steps; {st.bytes_per_rank / 1e6:.3g} MB per rank and step")


__all__ = ["TORCH_START_ITER", "TORCH_MIN_COMPRESSION_RATE", "PowerSGDBucket", "PowerSGDStep", "matrix_of",
           "powersgd_bucket", "powersgd_bytes_per_rank", "powersgd_step_time", "one_bucket_mb",
           "calibration_start_iter", "words"]

