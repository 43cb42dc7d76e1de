"""What every part of the cost model reads: the codec candidates the search picks from, the records
of what was measured (:class:`Profile`, :class:`LayerProfile`) and fitted (:class:`Convergence`,
:class:`LocalCalibration`), how the model is trained (:class:`Sharding`), a predicted step
(:class:`StepBreakdown`), and a plan's gradient error ``e(p)``: the gradient-energy-weighted root mean
square of the per-layer relative errors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from fastml_strategy.autotune.catalog import Link
from fastml_strategy import codecs
from fastml_strategy.config import CodecConfig

# Local steps: the sync periods H calibrated and searched by default (per-step compression is H = 1,
# always searched), and the fragment counts F searched (Streaming DiLoCo uses a few to a few tens).
DEFAULT_LOCAL_EVERY: tuple[int, ...] = (10, 50)
DEFAULT_LOCAL_FRAGMENTS: tuple[int, ...] = (1, 2, 4, 8)
# The outer plan of the local-steps calibration runs (LocalSGD's default).
LOCAL_CALIBRATION_OPTION = "int4"


# The per-layer choices the search considers, cheapest error first: every registered codec's
# ``candidates`` (fastml_strategy.codecs: each codec module lists its own, e.g. quantize's int8..int2
# and int4-noef, top-k's topk10/topk1/topk1-int4; fp32's "none" keeps every plan with error 0
# reachable), in registration order. "-noef" options drop error feedback, saving the residual memory
# at the price of bias (profiled like every other option).
_BASE_CANDIDATES: dict[str, CodecConfig] = codecs.candidates()
# The options DDP searches (its hook keeps two fp32 residual buffers; its memory is not modelled).
BASE_OPTIONS: tuple[str, ...] = tuple(_BASE_CANDIDATES)
# Under FSDP a residual is as large as the unsharded gradient, so sharded runs also search each
# error-fed option with a bf16 residual (half the memory; "int4-rbf16", as CodecConfig.describe()
# names it), derived here rather than listed. Codecs that FSDP/HSDP do not run (``WireCodec.sharded``
# False: low-rank, a shard is no matrix) have no -rbf16 variant and sharded runs do not search them.
CANDIDATES: dict[str, CodecConfig] = {
    **_BASE_CANDIDATES,
    **{f"{k}-rbf16": dataclasses.replace(v, residual_dtype="bf16")
       for k, v in _BASE_CANDIDATES.items() if v.uses_residual and v.wire.sharded},
}


def default_options(sharding: "str | Sharding | None" = None) -> list[str]:
    """The codec options searched by default: :data:`BASE_OPTIONS` for DDP, every candidate (the
    ``-rbf16`` variants too) for FSDP/HSDP."""
    kind = sharding.kind if isinstance(sharding, Sharding) else (sharding or "ddp")
    return list(BASE_OPTIONS) if kind == "ddp" else [k for k, v in CANDIDATES.items() if v.wire.sharded]


SHARDINGS = ("ddp", "fsdp", "hsdp")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# The intra-node link of sharded clusters when nothing else is known: PCIe 4.0 x16 class (about
# 25 GB/s per direction), 5 us per message. NVLink machines are ~10x faster: pass --intra-node-link.
DEFAULT_INTRA_LINK = Link(200e9 / 8, 5e-6, "given")


@dataclass(frozen=True)
class Sharding:
    """How the model is trained: ``ddp`` (replicated: the DDP model of this module), ``fsdp`` (FSDP2
    over every rank) or ``hsdp`` (FSDP2 over the ranks of one node, replicas across nodes).

    ``param_dtype``: what FSDP all-gathers (``MixedPrecisionPolicy(param_dtype=...)``);
    ``reduce_dtype``: what its own reduce-scatter / all-reduce send (None: the param dtype, as FSDP2
    does); ``reshard_after_forward``: FSDP2's default True all-gathers every non-root unit again in
    backward; ``intra_link``: the link between ranks of one node; ``all_gather_bits``: FastML's
    quantized parameter all-gather (``fastml_strategy.fsdp.register(all_gather_bits=...)``; None:
    FSDP's own, in the param dtype)."""

    kind: str = "ddp"
    param_dtype: str = "fp32"
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    intra_link: Link = DEFAULT_INTRA_LINK
    all_gather_bits: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SHARDINGS:
            raise ValueError(f"--sharding {self.kind!r} is not a sharding; use one of {', '.join(SHARDINGS)}")
        for name, v in (("--param-dtype", self.param_dtype), ("--reduce-dtype", self.reduce_dtype)):
            if v is not None and v not in DTYPE_BYTES:
                raise ValueError(f"{name} {v!r} is not a dtype FSDP2 communicates in here; use fp32 or bf16")

    @property
    def sharded(self) -> bool:
        return self.kind != "ddp"

    @property
    def reduce(self) -> str:
        return self.reduce_dtype or self.param_dtype

    def describe(self) -> str:
        if not self.sharded:
            return "ddp"
        return (f"{self.kind}, params {self.param_dtype}, reduce {self.reduce}, "
                f"{'reshard' if self.reshard_after_forward else 'keep'} after forward")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["intra_link"] = asdict(self.intra_link)
        if self.all_gather_bits is None:  # (results written before the field read the same)
            del d["all_gather_bits"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Sharding":
        d = dict(d)
        if isinstance(d.get("intra_link"), Mapping):
            d["intra_link"] = Link(**d["intra_link"])
        return cls(**d)


@dataclass
class LayerProfile:
    """What the profiler measured for one parameter."""

    name: str
    numel: int
    index: int  # position in model.parameters()
    ready_s: float  # gradient ready, seconds after the backward pass started
    grad_sq: float  # mean squared L2 norm of its gradient (weights the plan error)
    tunable: bool  # numel >= plan.min_numel: small tensors travel fp32 and are not searched
    rel_error: dict[str, float] = field(default_factory=dict)  # option -> relative error per step
    codec_s: dict[str, float] = field(default_factory=dict)  # option -> one round trip, seconds
    shape: list[int] | None = None  # FSDP2 shards dim 0 (None, in older profiles: (numel,))
    unit: str | None = None  # module path of its FSDP unit ("" the root; None: from the name)
    # "embedding" for an nn.Embedding's weight (a row-sparse gradient: only the rows of the batch's
    # tokens are non-zero, so top-k pays there): kept in a search group of its own; "" otherwise
    kind: str = ""


@dataclass
class Profile:
    """Everything measured before the search: compute, per-layer errors and codec speed, the link."""

    layers: list[LayerProfile]
    forward_s: float
    backward_s: float
    optimizer_s: float
    world_size: int  # W_ref: the world the workload's per-rank batch is written for
    min_numel: int
    options: list[str]
    link: Link | None = None  # measured (distributed launch) or given (--link); None: catalog only
    link_samples: list[tuple[float, float, float]] = field(default_factory=list)  # rounds, bytes, s
    # Codec family -> multiplier of the modelled codec time, fitted to the measured step times of
    # the uniform recipes when launched distributed (fit_codec_scale); 1.0 when not measured. It
    # absorbs what the round trips do not show: the hook's flattening, padding, residual updates,
    # and its communication thread competing with backward for the processor.
    codec_scale: dict[str, float] = field(default_factory=dict)
    # Bytes of optimizer state after one step (Adam: 8 per parameter); None: not measured (8 assumed).
    optimizer_state_bytes: int | None = None
    # Sharded training: seconds each FSDP collective costs beyond its alpha-beta time (FSDP2's
    # copy-in/out and per-unit bookkeeping), fitted to FSDP's own measured step time when launched
    # distributed (fit_collective_overhead); 0.0 when not measured.
    collective_overhead_s: float = 0.0
    # Threads the compute was timed with (torch.get_num_threads during profiling) and why that many:
    # "--threads-per-rank", "cores / world size" (one process standing in for W ranks) or
    # "as launched" (torchrun: each rank as it will run). 0: not recorded (older profiles).
    threads: int = 0
    threads_source: str = ""

    @property
    def compute_s(self) -> float:
        return self.forward_s + self.backward_s + self.optimizer_s

    def layer(self, name: str) -> LayerProfile:
        for lp in self.layers:
            if lp.name == name:
                return lp
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["link"] = None if self.link is None else asdict(self.link)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Profile":
        d = dict(d)
        d["layers"] = [LayerProfile(**lp) for lp in d["layers"]]
        d["link"] = None if d.get("link") is None else Link(**d["link"])
        d["link_samples"] = [tuple(s) for s in d.get("link_samples", [])]
        return cls(**d)


@dataclass(frozen=True)
class Convergence:
    """``g(e) = 1 + k * e**gamma``: how many times the reference steps a plan of error ``e`` needs;
    ``e_max`` is the largest error whose calibration trials stayed within the accuracy-loss limit."""

    k: float
    gamma: float
    e_max: float

    def g(self, e: float) -> float:
        return 1.0 + self.k * (max(e, 0.0) ** self.gamma)


@dataclass
class LocalCalibration:
    """What the local-steps calibration measured, per sync period H (see ``calibrate.run_local_calibration``).

    ``stretch[H]``: steps local steps need to reach the per-step run's loss levels over the steps the
    per-step run needs (>= 1: noise never makes local steps look faster than synchronising every
    step); ``accuracy_loss[H]``: by the same rule as the plans' calibration; ``e_cal``: the plan
    error of the outer plan the runs used (uniform int4)."""

    stretch: dict[int, float]
    accuracy_loss: dict[int, float]
    censored: dict[int, bool]
    e_cal: float
    max_accuracy_loss: float
    steps: int = 0  # length of each calibration run
    world_size: int = 2  # replicas simulated
    outer: str = "nesterov"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def feasible(self, every: int) -> bool:
        return every in self.stretch and self.accuracy_loss[every] <= self.max_accuracy_loss + 1e-12

    @property
    def every(self) -> list[int]:
        return sorted(self.stretch)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("stretch", "accuracy_loss", "censored"):
            d[k] = {str(h): v for h, v in d[k].items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "LocalCalibration":
        d = dict(d)
        for k in ("stretch", "accuracy_loss", "censored"):
            d[k] = {int(h): v for h, v in d[k].items()}
        return cls(**d)


@dataclass(frozen=True)
class StepBreakdown:
    compute_s: float
    codec_s: float
    wire_s: float  # total wire time of all buckets
    exposed_s: float  # the part of wire_s that does not overlap the backward pass
    step_s: float
    bytes_per_rank: int  # everything this rank sends per step
    # sharded training only (0 under DDP): bytes per rank per step by collective, memory per rank
    allgather_bytes: int = 0  # parameter all-gathers, forward and backward
    reduce_scatter_bytes: int = 0  # FSDP: the (compressed) reduce-scatter; HSDP: FSDP's, in the node
    allreduce_bytes: int = 0  # HSDP: the cross-node all-reduce of the shard
    residual_bytes: int = 0  # FastML's error-feedback residuals
    state_bytes: int = 0  # FSDP's own: parameter, gradient and optimizer-state shards
    # DDP: bytes leaving each machine per step, and the schedule priced ("hierarchical" | "flat")
    node_net_bytes: int = 0
    topology: str = "flat"
    # DDP: the all-reduce schedule of the step's buckets, as the runtime picks it ("ring", "halving",
    # "ring 2 + halving 3", "plain"; fastml_strategy.wire.schedule.choose_schedule)
    schedules: str = ""


def _cfg(choice: Mapping[str, str], lp: LayerProfile) -> tuple[str, CodecConfig]:
    name = choice.get(lp.name, "none") if lp.tunable else "none"
    return name, CANDIDATES[name]


def plan_error(profile: Profile, choice: Mapping[str, str], intra_node: str | None = None) -> float:
    """Relative error of the whole gradient: sqrt(sum_l |g_l|^2 e_l^2 / sum_l |g_l|^2); with a 16-bit
    hop inside the machine (``intra_node``, :func:`intra_node_error`), that rounding's error added in
    quadrature (it is independent of the codecs' and applies to every layer alike)."""
    num = den = 0.0
    for lp in profile.layers:
        den += lp.grad_sq
        name, _ = _cfg(choice, lp)
        if name != "none":
            num += lp.grad_sq * lp.rel_error[name] ** 2
    e = math.sqrt(num / den) if den > 0 else 0.0
    return math.hypot(e, intra_node_error(profile, intra_node)) if intra_node not in (None, "none") else e


# The hop inside a machine of the hierarchical all-reduce (``Plan.intra_node``): each choice the search
# may make -> the relative error of its rounding of the machine's reduced gradient, the format's unit
# roundoff (8 significand bits for bf16, 11 for fp16). That rounding comes after error feedback, which
# therefore never corrects it: it is priced as an error of its own, added to the plan's in quadrature
# (the reduce-scatter's rounding of each rank's copy, averaged over the machine's ranks, is smaller and
# not counted). "none" (exact fp32) is 0.
INTRA_NODE_ERROR: dict[str, float] = {"none": 0.0, "bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
# Bytes per element on that hop.
INTRA_NODE_BYTES: dict[str, int] = {"none": 4, "bf16": 2, "fp16": 2}


def measured_fp16_error(profile: Profile) -> float | None:
    """The gradient-weighted relative error the profile measured for the fp16 cast over the tunable
    layers (overflow and underflow included), or None when it was not profiled."""
    layers = [lp for lp in profile.layers if lp.tunable]
    if "fp16" not in profile.options or not layers or any("fp16" not in lp.rel_error for lp in layers):
        return None
    den = sum(lp.grad_sq for lp in layers)
    if not den > 0:
        return None
    return math.sqrt(sum(lp.grad_sq * lp.rel_error["fp16"] ** 2 for lp in layers) / den)


def intra_node_error(profile: Profile, intra_node: str | None) -> float:
    """The relative error a hop inside the machine in ``intra_node`` (:data:`INTRA_NODE_ERROR`; None
    or "none": exact) adds to the gradient. fp16 takes the larger of its unit roundoff and the fp16
    error the profile measured on the real gradients (its narrow range may flush small gradients);
    unprofiled, it is not offered (:func:`fastml_strategy.autotune.costmodel.intra_node_choices`)."""
    key = "none" if intra_node is None else intra_node
    if key not in INTRA_NODE_ERROR:
        raise ValueError(f"intra_node {intra_node!r} is not a hop the autotuner prices; use one of "
                         f"{sorted(INTRA_NODE_ERROR)}")
    e = INTRA_NODE_ERROR[key]
    if key == "fp16":
        measured = measured_fp16_error(profile)
        e = max(e, measured) if measured is not None else e
    return e


def codec_registry() -> Any:
    """The codec registry the wire layouts (:mod:`fastml_strategy.wire`) take their sizes from:
    :mod:`fastml_strategy.codecs`, imported on first use (it imports torch)."""
    from fastml_strategy import codecs

    return codecs


def _codec_factor(cfg: CodecConfig, nodes: int) -> float:
    """Codec round trips per layer and step over ``nodes``, in units of the profiled one: a sparse
    message is encoded once and its W-1 peers' decoded (one round trip's worth); a dense one goes
    through scatter-reduce-allgather, (3 + 1/W) / 2 of them."""
    from fastml_strategy.codecs import is_sparse

    if nodes <= 1:
        return 0.0
    if is_sparse(cfg):
        return 1.0
    if cfg.wire.lowrank:
        return LOWRANK_CODEC_FACTOR
    return (3.0 + 1.0 / nodes) / 2.0


# The low-rank codec's work per step against its profiled round trip: a step orthogonalises Q and P
# (Gram-Schmidt, (m + n) r^2) and multiplies three times (P = M Q, Q = M^T P, M_hat = P Q^T: 6 m n r
# flops); the round trip (fastml_strategy.codecs.lowrank.low_rank_roundtrip) runs two power steps and the
# reconstruction (10 m n r flops): 0.6 of it, whatever the world size (the factors' all-reduce sums
# small vectors).
LOWRANK_CODEC_FACTOR = 0.6


def family(cfg: CodecConfig) -> str:
    """The codec family whose time scale applies: the codec class's ``family`` (fp32, cast for
    fp16/bf16, quantize, topk)."""
    from fastml_strategy.codecs import codec_for

    return codec_for(cfg).family


def _candidate_name(cfg: CodecConfig) -> str:
    """The candidate that is ``cfg`` (a top-k layer's dense fall-back, whose codec time is that
    candidate's); a codec no candidate is has no profiled time, which is an error."""
    for name, c in CANDIDATES.items():
        if c == cfg:
            return name
    raise ValueError(f"the codec {cfg.describe()} is none of the autotuner's candidates "
                     f"({', '.join(CANDIDATES)}), so its time was not profiled; add it to its codec's "
                     f"candidates (fastml_strategy.codecs)")
