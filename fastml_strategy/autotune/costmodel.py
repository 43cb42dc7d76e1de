"""The cost model: what a per-layer plan costs in step time, steps, hours and dollars on a cluster.

Everything the search optimises is computed here from measured inputs (a :class:`Profile`), with no
training in the loop, so one Optuna trial costs microseconds and the search can afford thousands.

Step time of plan ``p`` on option ``c`` (``N`` nodes, link bandwidth ``B`` and latency ``a`` per node,
compute speed ``f``, ``R`` ranks)::

    T(p, c) = T_fwd' + max(T_bwd' + T_codec(p), end of communication) + T_opt'

1. Compute. The profile measures forward, backward and optimizer time on the profiling machine, at the
   reference world size ``W_ref``. A cluster runs the same training (same global batch, same number of
   steps), so each of its ``R`` ranks takes ``W_ref / R`` of the reference per-rank batch:
   compute scales by ``W_ref / (R * f)`` (linear in the batch: optimistic when per-rank batches get
   small enough to underuse an accelerator).
2. Buckets. Gradients are grouped the way DDP does (reverse parameter order, a 1 MiB first bucket, then
   25 MiB); a bucket is ready when its last gradient is (measured with post-accumulate-grad hooks).
3. Wire time of a bucket = ``rounds * a + bytes / B``: ``bytes`` sums ``codecs.wire_bytes`` (per-rank
   traffic: ``2(N-1)/N`` of the compressed size for scatter-reduce-allgather and ring all-reduce,
   ``(N-1)`` messages for top-k's all_gather, with the codec's own dense fallback at large ``N``);
   ``rounds = 2(N-1)``: the hook's two collectives per bucket (all_to_all, all_gather), or DDP's ring
   all-reduce. With a measured link, ``a`` and ``1/B`` are the fitted alpha and beta of timed
   collectives (so link sharing between ranks is already in them).
4. Overlap. One communication thread takes buckets in order as they become ready and, per bucket,
   encodes/decodes then transfers. Encoding shares the processor with the backward pass, so backward
   ends ``T_codec`` later; the step's communication ends when the thread finishes its last bucket,
   never before that bucket's own encode and transfer. Exposed = what ends after the (stretched)
   backward pass.
5. Ranks per machine (``A = accelerators_per_node``; :func:`ddp_topology`), as the hook runs them
   (:mod:`fastml_strategy.topology`): with ``N > 1`` machines of ``A > 1`` ranks the hook is
   *hierarchical* (:mod:`fastml_strategy.hierarchical`): per bucket an fp32 reduce-scatter and an
   all-gather inside the machine on the intra-node link (``2(A-1)`` rounds and ``2(A-1)/A x 4 x
   numel`` bytes per rank, at the link's per-rank bandwidth), between them the compressed all-reduce of
   each rank's ``1/A`` part across the ``N`` machines, the machine's ``A`` ranks at once on its one
   network link (``A x`` the part's ``codecs.wire_bytes`` over ``N``; ``2(N-1)`` rounds); codec time
   is that of the part (``1/A`` of the layer). Everything else is *flat*: one machine (``N = 1``: the
   all-reduce over ``A`` ranks on the intra-node link), one rank per machine (the network, as above),
   or flat on request (``topology="flat"``, ``ranks_per_node=1`` in the hook: the scatter-reduce-
   allgather over all ``W`` ranks; a machine's link carries the all_to_all chunks its ``A`` ranks
   send to the other machines, ``A (W-A)/(W-1)`` of one rank's, and the ring all_gather once). Plain DDP (``hook=False``) is gloo's/NCCL's ring over all ``W``
   ranks: every link of the ring, the machines' included, carries ``2(W-1)/W`` of the fp32 gradient.
   The intra-node link is the option's ``intra_link``, else PCIe class (:data:`DEFAULT_INTRA_LINK`).
   ``StepBreakdown.node_net_bytes``: what leaves each machine per step; ``topology``: which schedule.
6. Codec time per layer is the measured round trip (one encode + one decode) scaled by how many of each
   the collective does: scatter-reduce-allgather encodes ``1 + 1/N`` of the tensor and decodes ``2`` of
   it, i.e. ``(3 + 1/N) / 2`` round trips; top-k encodes once and scatter-adds ``N-1`` small messages
   (counted as one round trip).

Steps to the target: ``S(p) = S_ref * g(e(p))``, where ``e(p)`` is the plan's relative gradient error
(the gradient-energy-weighted root mean square of the per-layer relative errors, measured with error
feedback on real gradients) and ``g(e) = 1 + k e^gamma`` is fitted by the calibration (``g(0) = 1``).

Time to accuracy ``TTA = S(p) * T(p, c)``; cost ``= TTA * N * price_per_node_hour / 3600``.

Local steps (:func:`local_step_time`, :func:`evaluate_local`; :class:`~fastml_strategy.LocalSGD`):
no per-step all-reduce; every H inner steps the pseudo-gradient of the whole model is all-reduced with
the same compressed scatter-reduce-allgather, in F fragments synchronised at staggered steps, each
fragment's outer update applied ``d`` inner steps after its all-reduce started (``delay``).

- Per inner step, compute ``c`` is the profile's forward + backward + optimizer time, scaled as in 1.
- One synchronisation of fragment f: ``wire_f = 3(N-1) a + bytes / (F B)`` (``bytes``: the plan's
  ``codecs.wire_bytes`` over every layer, as one DDP step of that plan would send; rounds: the
  all_to_all, the all_gather and the status exchange) and codec time ``T_codec / F``.
- It runs on LocalSGD's communication thread while the next ``d`` inner steps compute; the step that
  applies it waits for what is left: ``max(0, wire_f - d c)``. Fragments are ``H / F`` steps apart and
  ``d < H / F``, so one fragment's wait never overlaps another's.
- Over a period of H inner steps: ``H c + T_codec + F max(0, wire_f - d c)``; the step time is that
  over H. Whole-model sync (``F = 1, d = 0``): ``c + (wire + T_codec) / H``; streaming with a
  delay long enough to hide each fragment: ``c + T_codec / H`` (``max(H c, wire) / H`` when
  ``d = H / F``, the brief's bound). Bytes per inner step: ``bytes / H``.
- Steps to the target: ``S_ref x s(H) x g(e(p)) / g(e_cal) x H / (H - d)``. ``s(H)`` is the stretch
  the calibration measured for H (local steps with the calibrated outer plan against per-step
  synchronisation at the same world size, >= 1); ``g(e(p)) / g(e_cal)`` charges a plan lossier than
  the calibrated one (uniform int4) as per-step compression would be charged; ``H / (H - d)``:
  with ``mix=1`` a fragment's local progress during its delay is dropped (a model, not measured).
  The delay is not searched: for each (plan, H, F) the ``d`` in ``[0, H // F)`` with the lowest
  time to accuracy is taken.

Sharded training (``Sharding(kind="fsdp" | "hsdp")``, :func:`sharded_step_time`) replaces steps 2-5
with FSDP2's schedule over *units* (one ``fully_shard`` module each: see :func:`fsdp_units`):

- W = N x A ranks (A accelerators per node). FSDP shards every unit over all W ranks; HSDP shards it
  over the S = A ranks of a node and keeps R = N replicas.
- Forward: each unit's parameters are all-gathered (``(Ws-1)`` shards of the param dtype per rank,
  Ws the shard group) before its compute; the next unit's all-gather overlaps the current unit's
  compute (FSDP2's one-unit prefetch). Compute is split between units by parameter count.
- Backward, units in the order their gradients become ready: the all-gather again
  (``reshard_after_forward``; never for the root unit, which FSDP2 keeps unsharded), prefetched one
  unit ahead; the unit's backward; then its reduction, overlapping the next units' backward:
  FSDP: FastML's compressed reduce-scatter (one all_to_all; bytes from
  ``codecs.reduce_scatter_bytes`` per tensor on FSDP2's dim-0 chunks, ``fsdp.shard_chunks``, plus a
  64-byte header per destination) or FSDP's own ring reduce-scatter (``(W-1)/W`` of the padded unit
  in the reduce dtype). HSDP: FSDP's own reduce-scatter inside the node (fast link), then the
  cross-node all-reduce of the rank's shard: FastML's scatter-reduce-allgather over the R replicas
  (``codecs.wire_bytes`` of each shard) or FSDP's ring all-reduce (``2(R-1)/R`` of the padded shard).
- Links: a ring collective crosses each node's link once (``bytes / B``); FastML's all_to_all sends
  each remote chunk directly, so the A ranks of a node put ``A x (W-A)/(W-1)`` of their bytes on
  the node's link at once; in HSDP the S ranks of a node all-reduce their shards at once (``S x``).
  Collectives on one link run in the order they are issued; the node link and the intra-node link
  are separate.
- Codec time: a reduce-scatter encodes and decodes every element once (one round trip); the HSDP
  all-reduce works on a shard (``1/S`` of the round trip, times the scatter-reduce-allgather factor).
  The optimizer steps on a shard: ``T_opt / Ws``.
- Memory per rank: error-feedback residuals of the compressed tensors (FSDP: full size; HSDP: the
  shard), beside FSDP's own state (fp32 parameter and gradient shards plus the optimizer state, which
  the profile measures: ``(8 + optimizer bytes per parameter) / Ws`` bytes per parameter).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from fastml_strategy.autotune.catalog import HardwareOption, Link
from fastml_strategy.config import RECIPES, Codec, CodecConfig

__all__ = [
    "CANDIDATES",
    "BASE_OPTIONS",
    "default_options",
    "Sharding",
    "SHARDINGS",
    "fsdp_units",
    "reduce_scatter_unit_bytes",
    "allreduce_unit_bytes",
    "residual_bytes",
    "fsdp_state_bytes",
    "sharded_step_time",
    "fit_collective_overhead",
    "LayerProfile",
    "Profile",
    "Convergence",
    "StepBreakdown",
    "ddp_buckets",
    "plan_error",
    "step_time",
    "ddp_topology",
    "ddp_node_net_bytes",
    "evaluate",
    "objective",
    "cost_usd",
    "fit_alpha_beta",
    "fit_codec_scale",
    "family",
    "fit_convergence",
    "pareto_front",
    "LocalCalibration",
    "local_step_time",
    "evaluate_local",
    "DEFAULT_LOCAL_EVERY",
    "DEFAULT_LOCAL_FRAGMENTS",
]

# Local steps: the sync periods H calibrated and searched by default (per-step compression is H = 1,
# always searched), and the fragment counts F searched (Streaming DiLoCo uses a few to a few tens).
DEFAULT_LOCAL_EVERY: tuple[int, ...] = (10, 50)
DEFAULT_LOCAL_FRAGMENTS: tuple[int, ...] = (1, 2, 4, 8)
# The outer plan of the local-steps calibration runs (LocalSGD's default).
LOCAL_CALIBRATION_OPTION = "int4"

# DDP's bucket sizes (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and
# dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB for the first bucket, the last layers).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20
# Bucket caps (MiB, DDP's bucket_cap_mb) the search tries on each option's chosen plan, beside DDP's
# default (None: 1 MiB first, then 25). A small model fits in one default bucket, so nothing overlaps
# backward; smaller buckets overlap more but pay 2(N-1) latency rounds each.
BUCKET_MB_CHOICES: tuple[int | None, ...] = (None, 1, 2, 4, 8, 16)


# The per-layer choices the search considers, cheapest error first: the named recipes of
# config.RECIPES the tuner uses (bf16 and int4-sr are left out: fp16 and int4 already span their
# error and bytes), and variants of them in between. "none" keeps every plan with error 0 reachable
# (uncompressed is always feasible); "-noef" options drop error feedback, saving the residual memory
# at the price of bias (profiled like every other option).
_BASE_CANDIDATES: dict[str, CodecConfig] = {
    "none": RECIPES["none"],
    "fp16": RECIPES["fp16"],
    "int8": RECIPES["int8"],
    "int6": dataclasses.replace(RECIPES["int8"], bits=6),
    "int4": RECIPES["int4"],
    "int3": dataclasses.replace(RECIPES["int4"], bits=3),
    "int2": RECIPES["int2"],
    "int4-noef": dataclasses.replace(RECIPES["int4"], error_feedback=False),
    "topk10": dataclasses.replace(RECIPES["topk1"], topk=0.10),
    "topk1": RECIPES["topk1"],
    "topk1-int4": RECIPES["topk1-int4"],
}
# The options DDP searches (its hook keeps two fp32 residual buffers; its memory is not modelled).
BASE_OPTIONS: tuple[str, ...] = tuple(_BASE_CANDIDATES)
# Under FSDP a residual is as large as the unsharded gradient, so sharded runs also search each
# error-fed option with a bf16 residual (half the memory; "int4-rbf16", as CodecConfig.describe()
# names it), derived here rather than listed.
CANDIDATES: dict[str, CodecConfig] = {
    **_BASE_CANDIDATES,
    **{f"{k}-rbf16": dataclasses.replace(v, residual_dtype="bf16")
       for k, v in _BASE_CANDIDATES.items() if v.uses_residual},
}


def default_options(sharding: "str | Sharding | None" = None) -> list[str]:
    """The codec options searched by default: :data:`BASE_OPTIONS` for DDP, every candidate (the
    ``-rbf16`` variants too) for FSDP/HSDP."""
    kind = sharding.kind if isinstance(sharding, Sharding) else (sharding or "ddp")
    return list(BASE_OPTIONS) if kind == "ddp" else list(CANDIDATES)


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
    backward; ``intra_link``: the link between ranks of one node."""

    kind: str = "ddp"
    param_dtype: str = "fp32"
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    intra_link: Link = DEFAULT_INTRA_LINK

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


# -- buckets and plan error ------------------------------------------------------------------------
def ddp_buckets(profile: Profile, bucket_mb: float | None = None) -> list[list[LayerProfile]]:
    """Layers grouped as DDP buckets them: reverse registration order; by default (``bucket_mb``
    None) a 1 MiB first bucket, then 25 MiB; with ``bucket_cap_mb=bucket_mb`` given to DDP, every
    bucket (the first too, as torch does) up to that many MiB."""
    buckets: list[list[LayerProfile]] = []
    cur: list[LayerProfile] = []
    size = 0
    cap = FIRST_BUCKET_BYTES if bucket_mb is None else int(bucket_mb * (1 << 20))
    rest = BUCKET_BYTES if bucket_mb is None else cap
    for lp in sorted(profile.layers, key=lambda x: -x.index):
        cur.append(lp)
        size += 4 * lp.numel
        if size >= cap:
            buckets.append(cur)
            cur, size, cap = [], 0, rest
    if cur:
        buckets.append(cur)
    return buckets


def _cfg(choice: Mapping[str, str], lp: LayerProfile) -> tuple[str, CodecConfig]:
    name = choice.get(lp.name, "none") if lp.tunable else "none"
    return name, CANDIDATES[name]


def plan_error(profile: Profile, choice: Mapping[str, str]) -> float:
    """Relative error of the whole gradient: sqrt(sum_l |g_l|^2 e_l^2 / sum_l |g_l|^2)."""
    num = den = 0.0
    for lp in profile.layers:
        den += lp.grad_sq
        name, _ = _cfg(choice, lp)
        if name != "none":
            num += lp.grad_sq * lp.rel_error[name] ** 2
    return math.sqrt(num / den) if den > 0 else 0.0


def _codec_factor(cfg: CodecConfig, nodes: int) -> float:
    """Codec round trips per layer and step over ``nodes``, in units of the profiled one: a sparse
    message is encoded once and its W-1 peers' decoded (one round trip's worth); a dense one goes
    through scatter-reduce-allgather, (3 + 1/W) / 2 of them."""
    from fastml_strategy.codecs import is_sparse

    if nodes <= 1:
        return 0.0
    if is_sparse(cfg):
        return 1.0
    return (3.0 + 1.0 / nodes) / 2.0


def _layer_cost(profile: Profile, lp: LayerProfile, choice: Mapping[str, str], nodes: int,
                speed: float, hook: bool = True, parts: int = 1) -> tuple[int, float]:
    """(bytes one rank sends, codec seconds) of one layer in one compressed all-reduce over
    ``nodes`` (``hook=False``: DDP's fp32 all-reduce, no codec); ``parts``: the hierarchical path's
    ranks per machine, each of which all-reduces ``1/parts`` of the layer."""
    from fastml_strategy.codecs import effective_config, wire_bytes

    if nodes <= 1:
        return 0, 0.0
    name, cfg = _cfg(choice, lp) if hook else ("none", CANDIDATES["none"])
    numel = -(-lp.numel // parts)
    nbytes = wire_bytes(numel, cfg, nodes)
    if not (hook and lp.tunable):
        return nbytes, 0.0
    eff = effective_config(cfg, numel, nodes)
    # a top-k layer past its fallback world size runs its dense fallback codec
    t = lp.codec_s.get(name, 0.0) if eff == cfg else lp.codec_s.get(
        _candidate_name(eff), lp.codec_s.get("int8", 0.0))
    return nbytes, t * _codec_factor(eff, nodes) * profile.codec_scale.get(family(eff), 1.0) / speed / parts


def ddp_topology(nodes: int, ranks_per_node: int, topology: str = "auto") -> str:
    """The schedule the DDP hook runs (and the cost model prices): ``"hierarchical"`` on more than one
    machine of more than one rank, unless ``topology="flat"`` (``register_hook(ranks_per_node=1)``);
    else ``"flat"``."""
    if topology not in ("auto", "flat", "hierarchical"):
        raise ValueError(f"topology={topology!r}; use 'auto' (as the hook detects it), 'flat' or "
                         f"'hierarchical'")
    if topology == "flat" or nodes <= 1 or ranks_per_node <= 1:
        return "flat"
    return "hierarchical"


def _bucket_comm(profile: Profile, bucket: Sequence[LayerProfile], choice: Mapping[str, str], n: int, A: int,
                 option: HardwareOption, intra: Link, hook: bool, topology: str) -> tuple[int, int, float, float]:
    """(bytes one rank sends, bytes leaving each machine, codec seconds, wire seconds) of one DDP
    bucket on ``n`` machines of ``A`` ranks (module docstring, item 5)."""
    W, speed, net = n * A, option.compute_speed, option.link
    numel = sum(lp.numel for lp in bucket)
    if W <= 1:
        return 0, 0, 0.0, 0.0
    if not hook:  # DDP's ring all-reduce over all W ranks, fp32
        nbytes = sum(_layer_cost(profile, lp, choice, W, speed, False)[0] for lp in bucket)
        link = net if n > 1 else intra
        lat = intra.latency_s if n <= 1 else max(net.latency_s, intra.latency_s) if A > 1 else net.latency_s
        return nbytes, nbytes if n > 1 else 0, 0.0, 2 * (W - 1) * lat + nbytes / link.bandwidth_Bps
    if topology == "hierarchical":
        inner = int(round(2.0 * (A - 1) / A * 4 * numel))
        cross = [_layer_cost(profile, lp, choice, n, speed, True, parts=A) for lp in bucket]
        rank_net = sum(b for b, _ in cross)
        node_net = A * rank_net  # the machine's A ranks share its network link
        wire = (2 * (A - 1) * intra.latency_s + inner / intra.bandwidth_Bps
                + 2 * (n - 1) * net.latency_s + node_net / net.bandwidth_Bps)
        return inner + rank_net, node_net, sum(c for _, c in cross), wire
    costs = [_layer_cost(profile, lp, choice, W, speed, True) for lp in bucket]
    nbytes = sum(b for b, _ in costs)
    codec = sum(c for _, c in costs)
    if n <= 1:  # one machine: the intra-node link only
        return nbytes, 0, codec, 2 * (W - 1) * intra.latency_s + nbytes / intra.bandwidth_Bps
    # flat over W ranks. The all_to_all sends each chunk straight to its owner: the machine's A ranks
    # put A (W-A)/(W-1) of their all_to_all bytes on its link; the all_gather (gloo's and NCCL's
    # ring) crosses each machine's link once: one rank's all_gather bytes. Half of a dense layer's
    # bytes are each; a top-k layer's are all all_gather. (Measured, DESIGN.md: 1.76 and 2.89 x S_c
    # per machine at A = 2 and 4 on two machines, against 1.75 and 2.875 here.)
    from fastml_strategy.codecs import effective_config, is_sparse

    node_net = 0.0
    for lp, (b, _) in zip(bucket, costs):
        if is_sparse(effective_config(_cfg(choice, lp)[1], lp.numel, W)):
            node_net += b
        else:
            node_net += b / 2 * (A * (W - A) / (W - 1) + 1)
    node_net = int(round(node_net))
    lat = max(net.latency_s, intra.latency_s) if A > 1 else net.latency_s
    return nbytes, node_net, codec, 2 * (W - 1) * lat + node_net / net.bandwidth_Bps


def ddp_node_net_bytes(profile: Profile, choice: Mapping[str, str], option: HardwareOption,
                       hook: bool = True, topology: str = "auto", bucket_mb: float | None = None) -> int:
    """Bytes leaving each machine per DDP step (what a machine's network counter shows), as
    :func:`step_time` prices them."""
    return step_time(profile, choice, option, hook=hook, bucket_mb=bucket_mb, topology=topology).node_net_bytes


def step_time(profile: Profile, choice: Mapping[str, str], option: HardwareOption,
              nodes: int | None = None, hook: bool = True,
              sharding: Sharding | None = None, bucket_mb: float | None = None,
              topology: str = "auto") -> StepBreakdown:
    """Predicted step time of a plan (``choice``: layer name -> CANDIDATES key) on ``option``
    (with ``nodes`` overriding the option's node count, for scaling predictions). ``hook=False`` is
    plain DDP (fp32 all-reduce, no encode/decode), the uncompressed baseline. With a sharded
    ``sharding``: :func:`sharded_step_time` (``hook=False``: FSDP's own collectives). ``topology``:
    the hook's schedule on several ranks per machine (:func:`ddp_topology`: ``"auto"`` as the hook
    runs it, ``"flat"`` as with ``register_hook(ranks_per_node=1)``)."""
    if sharding is not None and sharding.sharded:
        return sharded_step_time(profile, choice, option, sharding, nodes=nodes, hook=hook)
    n = option.nodes if nodes is None else nodes
    A = option.accelerators_per_node
    topo = ddp_topology(n, A, topology) if hook else "flat"
    intra = option.intra_link or (sharding.intra_link if sharding is not None else DEFAULT_INTRA_LINK)
    ranks = n * A
    scale = profile.world_size / (ranks * option.compute_speed)
    fwd, bwd, opt = (profile.forward_s * scale, profile.backward_s * scale, profile.optimizer_s * scale)
    codec_total = 0.0
    free = 0.0
    wire_total = 0.0
    total_bytes = node_total = 0
    for bucket in ddp_buckets(profile, bucket_mb):
        # the hook issues two collectives per bucket (all_to_all + all_gather), DDP one ring
        # all-reduce; both take 2(W-1) latency rounds (the hierarchical path 2(A-1) + 2(N-1))
        nbytes, node_b, codec_b, wire = _bucket_comm(profile, bucket, choice, n, A, option, intra, hook, topo)
        node_total += node_b
        ready = max(lp.ready_s for lp in bucket) * scale
        free = max(free, ready) + codec_b + wire
        wire_total += wire
        codec_total += codec_b
        total_bytes += nbytes
    # The codec shares the processor with backward, so backward's end moves by the codec time; the
    # communication thread ends after its last bucket's encode and transfer.
    end = max(bwd + codec_total, free)
    exposed = max(0.0, end - bwd - codec_total)
    step = fwd + end + opt
    return StepBreakdown(fwd + bwd + opt, codec_total, wire_total, exposed, step, total_bytes,
                         node_net_bytes=node_total, topology=topo)


# -- sharded training (FSDP2 / HSDP) ---------------------------------------------------------------------
def _unit_of(lp: LayerProfile) -> str:
    if lp.unit is not None:
        return lp.unit
    return lp.name.rsplit(".", 1)[0].split(".")[0] if "." in lp.name else ""


def fsdp_units(profile: Profile) -> list[tuple[str, list[LayerProfile]]]:
    """The model's FSDP units, ``(module path, its parameters)``, the root's own parameters (path
    ``""``) first (FSDP2 all-gathers them in the root's pre-forward), then in registration order.

    Which module is a unit was decided at profiling (``profile.fsdp_unit_modules``): every child of
    the root that holds parameters, looking through containers (``ModuleList``, ``ModuleDict``,
    ``Sequential``), so each block of ``model.layers`` is a unit, as ``fully_shard`` is usually
    applied; parameters outside every unit belong to the root."""
    by: dict[str, list[LayerProfile]] = {}
    for lp in sorted(profile.layers, key=lambda x: x.index):
        by.setdefault(_unit_of(lp), []).append(lp)
    return sorted(by.items(), key=lambda kv: (kv[0] != "", kv[1][0].index))


@functools.lru_cache(maxsize=65536)
def _chunks(shape: tuple[int, ...], world_size: int) -> tuple[tuple[int, ...], int]:
    from fastml_strategy.fsdp import shard_chunks

    return shard_chunks(shape, world_size)


def _layout(lp: LayerProfile, world_size: int) -> tuple[tuple[int, ...], int]:
    """FSDP2's dim-0 chunks of one parameter over ``world_size`` ranks, and the padded chunk size."""
    return _chunks(tuple(lp.shape) if lp.shape else (lp.numel,), world_size)


def _torch_dtype(name: str) -> Any:
    import torch

    return torch.bfloat16 if name == "bf16" else torch.float32


def reduce_scatter_unit_bytes(layers: Sequence[LayerProfile], choice: Mapping[str, str], world_size: int,
                              reduce_dtype: str = "fp32", hook: bool = True,
                              rank: int | None = None) -> int:
    """Bytes one rank sends in one FSDP unit's reduce-scatter over ``world_size`` ranks (``rank``
    None: the mean over ranks), as ``FSDPState.stats()["bytes_sent"]`` counts them.

    FastML (``hook``): each compressed tensor's chunks on their own
    (``codecs.reduce_scatter_bytes``), the uncompressed ones batched per destination in the reduce
    dtype, and a header per destination. FSDP's own: ``(W-1)`` padded rows in the reduce dtype."""
    from fastml_strategy import codecs
    from fastml_strategy.collective import HEADER

    W = world_size
    if W <= 1:
        return 0
    if not hook:
        return (W - 1) * sum(_layout(lp, W)[1] for lp in layers) * DTYPE_BYTES[reduce_dtype]
    dt = _torch_dtype(reduce_dtype)
    total = 0
    batched = [0] * W
    for lp in layers:
        chunks, _ = _layout(lp, W)
        _, cfg = _cfg(choice, lp)
        if cfg.codec is Codec.FP32:
            batched = [a + b for a, b in zip(batched, chunks)]
        else:
            total += codecs.reduce_scatter_bytes(list(chunks), codecs.wire_config(cfg, dt), rank)
    if any(batched):
        total += codecs.reduce_scatter_bytes(batched, codecs.wire_config(CANDIDATES["none"], dt), rank)
    return total + (W - 1) * HEADER


def _shard_cfg(choice: Mapping[str, str], lp: LayerProfile, shard_numel: int,
               replicas: int) -> tuple[str, CodecConfig]:
    """HSDP: the codec the cross-replica all-reduce really uses for one shard: the plan's, looked up
    by the parameter's own size (min_numel is a property of the parameter, not of its shard), with
    top-k's dense fallback at R replicas decided on the shard."""
    from fastml_strategy.codecs import effective_config

    name, cfg = _cfg(choice, lp)
    return name, effective_config(cfg, shard_numel, replicas)


def allreduce_unit_bytes(layers: Sequence[LayerProfile], choice: Mapping[str, str], shard_size: int,
                         replicas: int, reduce_dtype: str = "fp32", hook: bool = True,
                         shard_rank: int | None = None) -> int:
    """HSDP: bytes one rank sends in one unit's cross-replica all-reduce of its shard (``shard_rank``
    None: the mean over the S shard ranks). FastML: ``codecs.wire_bytes`` of each shard tensor at R
    replicas plus the headers of its two collectives; FSDP's own ring all-reduce: ``2(R-1)/R`` of the
    padded shard in the reduce dtype."""
    from fastml_strategy import codecs
    from fastml_strategy.collective import HEADER

    R, S = replicas, shard_size
    if R <= 1:
        return 0
    if not hook:
        return int(round(2.0 * (R - 1) / R * sum(_layout(lp, S)[1] for lp in layers)
                         * DTYPE_BYTES[reduce_dtype]))
    dt = _torch_dtype(reduce_dtype)
    ranks = range(S) if shard_rank is None else (shard_rank,)
    total = 0
    for s in ranks:
        cfgs = [_shard_cfg(choice, lp, _layout(lp, S)[0][s], R)[1] for lp in layers]
        if all(cfg.codec is Codec.FP32 for cfg in cfgs):
            # nothing to compress: the collective runs DDP's own all-reduce of the padded shard
            padded = sum(_layout(lp, S)[1] for lp in layers)
            total += int(round(2.0 * (R - 1) / R * padded * DTYPE_BYTES[reduce_dtype]))
            continue
        total += 2 * (R - 1) * HEADER
        for lp, cfg in zip(layers, cfgs):
            n = _layout(lp, S)[0][s]
            total += codecs.wire_bytes(n, codecs.wire_config(cfg, dt), R)
    return int(round(total / len(ranks)))


def residual_bytes(profile: Profile, choice: Mapping[str, str], sharding: Sharding, shard_size: int,
                   replicas: int) -> int:
    """Error-feedback memory of one rank (the largest over shard ranks). FSDP: every compressed,
    error-fed tensor keeps a residual of its full size (its reduce-scatter sends every chunk); HSDP:
    of the rank's shard only. 4 bytes per element, 2 with ``residual_dtype="bf16"``."""
    if sharding.kind == "fsdp":
        total = 0
        for lp in profile.layers:
            _, cfg = _cfg(choice, lp)
            if cfg.uses_residual:
                total += lp.numel * DTYPE_BYTES[cfg.residual_dtype]
        return total
    best = 0
    for s in range(shard_size):
        total = 0
        for lp in profile.layers:
            n = _layout(lp, shard_size)[0][s]
            _, cfg = _shard_cfg(choice, lp, n, replicas)
            if cfg.uses_residual:
                total += n * DTYPE_BYTES[cfg.residual_dtype]
        best = max(best, total)
    return best


def fsdp_state_bytes(profile: Profile, shard_size: int) -> int:
    """FSDP's own memory per rank: the fp32 parameter shard, the fp32 gradient shard and the
    optimizer state of the shard (measured by the profile; 8 bytes per parameter, Adam, if not)."""
    numel = sum(lp.numel for lp in profile.layers)
    per_param = 8.0 if profile.optimizer_state_bytes is None or numel == 0 else \
        profile.optimizer_state_bytes / numel
    padded = sum(_layout(lp, shard_size)[1] for lp in profile.layers)
    return int(round(padded * (4 + 4 + per_param)))


def sharded_step_time(profile: Profile, choice: Mapping[str, str], option: HardwareOption,
                      sharding: Sharding, nodes: int | None = None, hook: bool = True) -> StepBreakdown:
    """Predicted step time of a plan under FSDP or HSDP (``hook=False``: FSDP's own collectives,
    the baseline). The schedule is described in the module docstring."""
    n = option.nodes if nodes is None else nodes
    f = option.compute_speed
    scale = profile.world_size / (n * option.accelerators_per_node * f)
    fwd_total, bwd_total = profile.forward_s * scale, profile.backward_s * scale
    hsdp = sharding.kind == "hsdp"
    c = _shard_group(option, sharding, n, profile.collective_overhead_s)
    opt_s = profile.optimizer_s / (c.Ws * f)
    total_numel = sum(lp.numel for lp in profile.layers) or 1
    rows = []
    for name, layers in fsdp_units(profile):
        ag, rs, ar = _unit_bytes(layers, choice, sharding, c, hook)
        rs_t, ar_t = (c.ring(rs), c.cross(ar)) if hsdp else (c.all_to_all(rs) if hook else c.ring(rs), 0.0)
        again = sharding.reshard_after_forward and name != "" and c.Ws > 1
        rows.append({"name": name, "ag_t": c.ring(ag), "again": again, "rs_t": rs_t, "ar_t": ar_t,
                     "codec": _unit_codec_s(profile, layers, choice, c, hsdp, hook, f),
                     "fwd": fwd_total * sum(lp.numel for lp in layers) / total_numel,
                     "ready": bwd_total if name == "" else max(lp.ready_s for lp in layers) * scale,
                     "ag": ag * (2 if again else 1), "rs": rs, "ar": ar})
    # Collectives on one link run in the order they are issued.
    links = _LinkQueue()
    ag_link = "intra" if c.gn == 1 else "net"
    t = _forward_end(rows, links, ag_link)
    end = _backward_end(rows, links, ag_link, "intra" if (hsdp or c.gn == 1) else "net", t, bwd_total)
    codec_total = wire_total = 0.0
    for r in rows:
        codec_total += r["codec"]
        wire_total += r["ag_t"] * (2 if r["again"] else 1) + r["rs_t"] + r["ar_t"]
    ag_bytes, rs_bytes, ar_bytes = (sum(r[k] for r in rows) for k in ("ag", "rs", "ar"))
    compute = fwd_total + bwd_total + opt_s
    step = end + opt_s
    exposed = max(0.0, step - compute - codec_total)
    res = residual_bytes(profile, choice, sharding, c.Ws, c.R) if hook else 0
    return StepBreakdown(compute, codec_total, wire_total, exposed, step, int(ag_bytes + rs_bytes + ar_bytes),
                         allgather_bytes=int(ag_bytes), reduce_scatter_bytes=int(rs_bytes),
                         allreduce_bytes=int(ar_bytes), residual_bytes=int(res),
                         state_bytes=fsdp_state_bytes(profile, c.Ws))


@dataclass(frozen=True)
class _ShardGroup:
    """The collectives of one sharded cluster shape and their time on its links."""

    Ws: int  # shard group size
    R: int  # replicas (HSDP; 1 for FSDP)
    gn: int  # nodes of the shard group
    ga: int  # ranks per node of the shard group
    net: Link
    intra: Link
    over: float  # FSDP's own cost per collective beyond the link (fitted; 0 if not)

    def ring(self, b: float) -> float:
        """FSDP's own all-gather / reduce-scatter of ``b`` bytes per rank over the shard group."""
        if self.Ws <= 1:
            return 0.0
        if self.gn == 1:
            return self.over + (self.ga - 1) * self.intra.latency_s + b / self.intra.bandwidth_Bps
        return (self.over + (self.gn - 1) * self.net.latency_s + (self.ga - 1) * self.intra.latency_s
                + b / self.net.bandwidth_Bps)

    def all_to_all(self, b: float) -> float:
        """FastML's reduce-scatter: every chunk straight to its owner."""
        if self.Ws <= 1:
            return 0.0
        if self.gn == 1:
            return self.over + (self.ga - 1) * self.intra.latency_s + b / self.intra.bandwidth_Bps
        node = self.ga * b * (self.Ws - self.ga) / (self.Ws - 1)
        local = b * (self.ga - 1) / (self.Ws - 1)
        return (self.over + (self.gn - 1) * self.net.latency_s + (self.ga - 1) * self.intra.latency_s
                + max(node / self.net.bandwidth_Bps, local / self.intra.bandwidth_Bps))

    def cross(self, b: float) -> float:
        """HSDP: S all-reduces over R replicas share each node's link."""
        return (self.over + 2 * (self.R - 1) * self.net.latency_s + self.ga * b / self.net.bandwidth_Bps
                if self.R > 1 else 0.0)


def _shard_group(option: HardwareOption, sharding: Sharding, nodes: int, over: float) -> _ShardGroup:
    """The shard group of ``nodes`` nodes of ``option``: FSDP shards over every rank, HSDP over the
    ranks of one node and replicates across nodes."""
    A = option.accelerators_per_node
    hsdp = sharding.kind == "hsdp"
    Ws, R = (A, nodes) if hsdp else (nodes * A, 1)
    gn, ga = (1, A) if hsdp else (nodes, A)
    return _ShardGroup(Ws=Ws, R=R, gn=gn, ga=ga, net=option.link, intra=option.intra_link or sharding.intra_link,
                       over=over)


def _unit_bytes(layers: list[LayerProfile], choice: Mapping[str, str], sharding: Sharding, c: _ShardGroup,
                hook: bool) -> tuple[int, int, int]:
    """Bytes one rank sends per step for one FSDP unit: the parameter all-gather (once), the
    reduce-scatter and (HSDP) the cross-node all-reduce."""
    Ws = c.Ws
    ag = (Ws - 1) * sum(_layout(lp, Ws)[1] for lp in layers) * DTYPE_BYTES[sharding.param_dtype] if Ws > 1 else 0
    if sharding.kind == "hsdp":
        rs = (Ws - 1) * sum(_layout(lp, Ws)[1] for lp in layers) * DTYPE_BYTES[sharding.reduce] if Ws > 1 else 0
        return ag, rs, allreduce_unit_bytes(layers, choice, Ws, c.R, sharding.reduce, hook)
    return ag, reduce_scatter_unit_bytes(layers, choice, Ws, sharding.reduce, hook), 0


def _unit_codec_s(profile: Profile, layers: list[LayerProfile], choice: Mapping[str, str], c: _ShardGroup,
                  hsdp: bool, hook: bool, f: float) -> float:
    """Codec seconds per step of one FSDP unit's tunable layers (HSDP: of the rank's shard, for the
    cross-node all-reduce), at compute speed ``f``."""
    codec = 0.0
    if not hook:
        return codec
    for lp in layers:
        if not lp.tunable:
            continue
        cname, cfg = _cfg(choice, lp)
        if hsdp:
            if c.R <= 1:
                continue
            cname, eff = _shard_cfg(choice, lp, max(1, lp.numel // c.Ws), c.R)
            t = lp.codec_s.get(cname, 0.0) if eff == CANDIDATES[cname] else lp.codec_s.get(
                _candidate_name(eff), lp.codec_s.get("int8", 0.0))
            factor = _codec_factor(eff, c.R) / c.Ws
        else:
            if c.Ws <= 1:
                continue
            eff, t, factor = cfg, lp.codec_s.get(cname, 0.0), 1.0
        codec += t * factor * profile.codec_scale.get(family(eff), 1.0) / f
    return codec


class _LinkQueue:
    """When each link ("net", "intra") is next free: collectives on one link run in issue order."""

    def __init__(self) -> None:
        self.free = {"net": 0.0, "intra": 0.0}

    def occupy(self, link: str, ready: float, dur: float) -> float:
        """Run a collective of ``dur`` seconds on ``link`` once it is ``ready``; return its end."""
        if dur <= 0.0:
            return ready
        start = max(ready, self.free[link])
        self.free[link] = start + dur
        return self.free[link]


def _forward_end(rows: list[dict[str, Any]], links: _LinkQueue, ag_link: str) -> float:
    """When the forward pass ends: unit i's all-gather may start once unit i-1 computes (one unit of
    prefetch)."""
    t = 0.0
    issue = 0.0
    for r in rows:
        done = links.occupy(ag_link, issue, r["ag_t"])
        start = max(t, done)
        issue = start
        t = start + r["fwd"]
    return t


def _backward_end(rows: list[dict[str, Any]], links: _LinkQueue, ag_link: str, rs_link: str, t: float,
                  bwd_total: float) -> float:
    """When the backward pass and its last collective end, from the forward's end ``t``: units in
    the order their gradients are ready (the root, never resharded, last), each unit's parameters
    all-gathered again (when resharded) while the previous one computes."""
    order = sorted(rows, key=lambda r: (r["name"] == "", r["ready"]))
    prev_ready = 0.0
    for i, r in enumerate(order):
        r["dur"] = (bwd_total if i == len(order) - 1 else max(r["ready"], prev_ready)) - prev_ready
        prev_ready = max(prev_ready, r["ready"])
    ag_done = {0: links.occupy(ag_link, t, order[0]["ag_t"]) if order and order[0]["again"] else t}
    comm_end = t
    for i, r in enumerate(order):
        start = max(t, ag_done[i])
        if i + 1 < len(order):  # prefetch the next unit's parameters now
            nxt = order[i + 1]
            ag_done[i + 1] = links.occupy(ag_link, start, nxt["ag_t"]) if nxt["again"] else start
        t = start + r["dur"] + r["codec"]
        rs_done = links.occupy(rs_link, t, r["rs_t"])
        comm_end = max(comm_end, rs_done, links.occupy("net", rs_done, r["ar_t"]))
    return max(t, comm_end)


def family(cfg: CodecConfig) -> str:
    """The codec family whose time scale applies: the codec class's ``family`` (fp32, cast for
    fp16/bf16, quantize, topk)."""
    from fastml_strategy.codecs import codec_for

    return codec_for(cfg).family


def fit_codec_scale(profile: Profile, option: HardwareOption, measured: Mapping[str, float],
                    lo: float = 0.25, hi: float = 10.0,
                    sharding: Sharding | None = None) -> dict[str, float]:
    """Per codec family, the codec-time multiplier that makes the model match measured step times.

    ``measured`` maps uniform option names (CANDIDATES keys, every tunable layer on that option) to
    measured seconds per step on ``option``. For each, bisection finds the multiplier (in
    ``[lo, hi]``; the step time grows with it) at which the prediction equals the measurement; a
    family's scale is the geometric mean over its options. Families whose codec time is too small to
    move the step time keep 1.0.
    """
    tunable = [lp.name for lp in profile.layers if lp.tunable]
    per_family: dict[str, list[float]] = {}
    saved = dict(profile.codec_scale)
    try:
        for name, secs in measured.items():
            if name not in CANDIDATES or not tunable:
                continue
            fam = family(CANDIDATES[name])
            choice = {n: name for n in tunable}

            def pred(k: float) -> float:
                profile.codec_scale = {**saved, fam: k}
                return step_time(profile, choice, option, sharding=sharding).step_s

            p_lo, p_hi = pred(lo), pred(hi)
            if p_hi - p_lo < 0.02 * secs:  # the codec barely matters here: nothing to learn
                continue
            if secs <= p_lo:
                k = lo
            elif secs >= p_hi:
                k = hi
            else:
                a, b = lo, hi
                for _ in range(40):
                    m = math.sqrt(a * b)
                    a, b = (m, b) if pred(m) < secs else (a, m)
                k = math.sqrt(a * b)
            per_family.setdefault(fam, []).append(k)
    finally:
        profile.codec_scale = saved
    return {f: float(math.exp(sum(math.log(k) for k in ks) / len(ks))) for f, ks in per_family.items()}


def fit_collective_overhead(profile: Profile, option: HardwareOption, measured_s: float,
                            sharding: Sharding, hi: float = 1.0) -> float:
    """Sharded training: the per-collective overhead (seconds, in ``[0, hi]``) at which the
    predicted step time of FSDP's own collectives on ``option`` equals ``measured_s`` (bisection;
    the prediction grows with it). 0.0 when the model already predicts at least the measurement."""
    saved = profile.collective_overhead_s

    def pred(x: float) -> float:
        profile.collective_overhead_s = x
        return sharded_step_time(profile, {}, option, sharding, hook=False).step_s

    try:
        if pred(0.0) >= measured_s:
            return 0.0
        if pred(hi) <= measured_s:
            return hi
        a, b = 0.0, hi
        for _ in range(60):
            m = (a + b) / 2
            a, b = (m, b) if pred(m) < measured_s else (a, m)
        return (a + b) / 2
    finally:
        profile.collective_overhead_s = saved


def _candidate_name(cfg: CodecConfig) -> str:
    """The candidate that is ``cfg`` (a top-k layer's dense fall-back, whose codec time is that
    candidate's); a codec no candidate is has no profiled time, which is an error."""
    for name, c in CANDIDATES.items():
        if c == cfg:
            return name
    raise ValueError(f"the codec {cfg.describe()} is none of the autotuner's candidates "
                     f"({', '.join(CANDIDATES)}), so its time was not profiled; add it to "
                     f"costmodel._BASE_CANDIDATES")


def cost_usd(tta_s: float, option: HardwareOption) -> float:
    """Dollars of ``tta_s`` seconds on ``option``: every node at its hourly price (0 for your own)."""
    return tta_s * option.nodes * option.price_per_hour / 3600.0


def objective(row: Mapping[str, Any], option: HardwareOption) -> float:
    """What the search minimises on ``option``: the cost where it has a price, else (a cluster you
    already have) the time to accuracy."""
    return row["cost_usd"] if option.price_per_hour > 0 else row["tta_s"]


def evaluate(profile: Profile, choice: Mapping[str, str], option: HardwareOption, conv: Convergence,
             target_steps: float, hook: bool = True, sharding: Sharding | None = None,
             max_residual_bytes: float | None = None, bucket_mb: float | None = None) -> dict[str, float]:
    """All the numbers of one (plan, option) pair: error, steps, step time, time to accuracy, cost.
    Sharded: also the bytes per collective and the memory per rank; a plan whose residuals exceed
    ``max_residual_bytes`` per rank is infeasible."""
    e = plan_error(profile, choice)
    br = step_time(profile, choice, option, hook=hook, sharding=sharding, bucket_mb=bucket_mb)
    steps = target_steps * conv.g(e)
    tta = steps * br.step_s
    cost = cost_usd(tta, option)
    memory_ok = max_residual_bytes is None or br.residual_bytes <= max_residual_bytes
    extra: dict[str, Any] = {}
    if sharding is not None and sharding.sharded:
        extra = {"allgather_bytes": br.allgather_bytes, "reduce_scatter_bytes": br.reduce_scatter_bytes,
                 "allreduce_bytes": br.allreduce_bytes, "residual_bytes": br.residual_bytes,
                 "state_bytes": br.state_bytes, "memory_ok": memory_ok}
    return {
        "error": e,
        "feasible": e <= conv.e_max + 1e-12 and memory_ok,
        "g": conv.g(e),
        "steps": steps,
        "step_s": br.step_s,
        "compute_s": br.compute_s,
        "codec_s": br.codec_s,
        "wire_s": br.wire_s,
        "exposed_s": br.exposed_s,
        "bytes_per_rank": br.bytes_per_rank,
        "node_net_bytes": br.node_net_bytes,  # DDP: bytes leaving each machine per step
        "tta_s": tta,
        "cost_usd": cost,
        **extra,
    }


def local_step_time(profile: Profile, choice: Mapping[str, str], option: HardwareOption, every: int,
                    fragments: int = 1, delay: int = 0, nodes: int | None = None) -> StepBreakdown:
    """Predicted time per inner step of LocalSGD (``every`` = H, ``fragments`` = F, ``delay`` = d) with
    the plan ``choice`` compressing the pseudo-gradients; the model is in the module docstring.
    ``wire_s`` and ``codec_s`` are per inner step (a sync's over H); ``exposed_s`` is the wire time
    not hidden under the delay, per inner step; ``bytes_per_rank`` per inner step."""
    n = option.nodes if nodes is None else nodes
    ranks = n * option.accelerators_per_node
    f = option.compute_speed
    c = profile.compute_s * profile.world_size / (ranks * f)
    nbytes, codec = 0, 0.0
    for lp in profile.layers:
        b, t = _layer_cost(profile, lp, choice, n, f)
        nbytes += b
        codec += t
    link = option.link
    F = max(1, fragments)
    wire_f = (3 * (n - 1) * link.latency_s + nbytes / (F * link.bandwidth_Bps)) if n > 1 else 0.0
    waited = F * max(0.0, wire_f - delay * c)
    period = every * c + codec + waited
    return StepBreakdown(c, codec / every, F * wire_f / every, waited / every, period / every,
                         int(round(nbytes / every)))


def evaluate_local(profile: Profile, choice: Mapping[str, str], option: HardwareOption,
                   conv: Convergence, local: LocalCalibration, target_steps: float, every: int,
                   fragments: int = 1) -> dict[str, Any]:
    """The numbers of one (plan, H, F, option) with local steps, as :func:`evaluate` gives them for
    per-step compression, plus ``every``, ``fragments``, the chosen ``delay``, ``stretch`` and the
    bytes of one whole-model synchronisation. The delay is the one in ``[0, H // F)`` with the lowest
    time to accuracy (``H / (H - d)`` more steps against less waiting). Infeasible when the
    calibration of H lost more accuracy than allowed, when H was not calibrated, or when the plan's
    error is above both the per-step limit and the calibrated outer plan's."""
    e = plan_error(profile, choice)
    stretch = local.stretch.get(every, math.inf)
    g_rel = conv.g(e) / conv.g(local.e_cal) if conv.g(local.e_cal) > 0 else 1.0
    best: tuple[float, int, StepBreakdown] | None = None
    for d in range(max(1, every // fragments) if fragments > 0 else 1):
        br = local_step_time(profile, choice, option, every, fragments, d)
        steps = target_steps * stretch * g_rel * every / (every - d)
        tta = steps * br.step_s
        if best is None or tta < best[0] - 1e-15:
            best = (tta, d, br)
        if br.exposed_s == 0.0:  # the wait is hidden: a longer delay only drops more progress
            break
    tta, d, br = best
    steps = target_steps * stretch * g_rel * every / (every - d)
    feasible = (local.feasible(every) and fragments <= len(profile.layers)
                and e <= max(conv.e_max, local.e_cal) + 1e-12)
    return {
        "error": e,
        "feasible": feasible,
        "g": steps / target_steps if target_steps > 0 else math.nan,
        "steps": steps,
        "step_s": br.step_s,
        "compute_s": br.compute_s,
        "codec_s": br.codec_s,
        "wire_s": br.wire_s,
        "exposed_s": br.exposed_s,
        "bytes_per_rank": br.bytes_per_rank,
        "tta_s": tta,
        "cost_usd": cost_usd(tta, option),
        "every": every,
        "fragments": fragments,
        "delay": d,
        "stretch": stretch,
        "sync_bytes": br.bytes_per_rank * every,
    }


# -- fits ---------------------------------------------------------------------------------------------
def fit_alpha_beta(samples: Sequence[tuple[float, float, float]], source: str = "measured") -> Link:
    """Least-squares fit of ``seconds = alpha * rounds + bytes / B`` to timed collectives
    (``rounds, bytes_per_rank, seconds`` triples), both coefficients kept non-negative."""
    a = np.array([[r, b] for r, b, _ in samples], dtype=float)
    y = np.array([s for _, _, s in samples], dtype=float)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    alpha, beta = float(coef[0]), float(coef[1])
    if alpha < 0:  # noise on a fast link: all of it is bandwidth
        alpha = 0.0
        beta = float(np.dot(a[:, 1], y) / np.dot(a[:, 1], a[:, 1]))
    if beta <= 0:
        raise ValueError("the timed collectives did not get slower with size (beta <= 0); the link "
                         "measurement is unusable: pass --link RATE instead")
    return Link(bandwidth_Bps=1.0 / beta, latency_s=alpha, source=source)


# One-sided 95% normal quantile: the band's edge, and the "sure" rule's margin.
BAND_Z = 1.645
# Standard error of a median over that of a mean for normal noise (sqrt(pi / 2)).
MEDIAN_SE = 1.2533
# The noise estimate uses blocks fitted at most this many times the limit (when they have any spread).
NOISE_NEAR = 10.0


def json_key(choice: Any) -> str:
    """A stable text key of a plan choice (group -> option)."""
    if not isinstance(choice, Mapping):
        return repr(choice)
    return "|".join(f"{k}={v}" for k, v in sorted(choice.items()))


@dataclass
class AccuracyRule:
    """How the accuracy-loss limit was decided (:func:`accuracy_rule`), for the report and the plot.

    ``errors``/``fit``/``band``: per distinct calibration error (ascending), the monotone fit of the
    accuracy loss and the half-width of its ~95% band; ``runs``: how many runs each value rests on.
    ``sigma``: noise of one run's accuracy loss, and ``sigma_source`` where it came from. ``e_max``:
    the largest error the fit places within the limit; ``e_sure``: the largest whose band's upper edge
    is within too; ``confidence``: the probability (normal noise) that the plan at ``e_max`` is within.
    """

    limit: float
    errors: list[float] = field(default_factory=list)
    fit: list[float] = field(default_factory=list)
    band: list[float] = field(default_factory=list)
    runs: list[int] = field(default_factory=list)
    sigma: float = math.nan
    sigma_source: str = "unknown"
    e_max: float = 0.0
    e_sure: float = 0.0
    confidence: float = math.nan
    trials: int = 0
    repeats: int = 0  # runs of a plan already run once (other seeds) that measured something new
    replays: int = 0  # repeats whose seed changed nothing (the workload seeds itself): counted once
    paired: bool | None = None  # every run saw the reference's batches (None: not checked)
    references: int = 1  # reference runs (one per seed used)

    def at(self, e: float) -> tuple[float, float]:
        """(fitted accuracy loss, band half-width) of error ``e``: the value of the largest
        calibrated error at or below ``e`` (a step function: no extrapolation downwards)."""
        i = int(np.searchsorted(np.asarray(self.errors), e, side="right")) - 1
        if i < 0:
            return (self.fit[0], self.band[0]) if self.fit else (0.0, 0.0)
        return self.fit[i], self.band[i]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def words(self) -> str:
        """One paragraph for the report: the rule, its noise and how sure it is."""
        if not self.errors:
            return "No calibration run finished: only uncompressed plans are within the limit."
        pair = {True: "paired (every run saw the reference's batches)",
                False: "not paired (runs saw different batches: the noise includes the data order)",
                None: "pairing not checked"}[self.paired]
        sig = ("unknown (no repeated run and one reference)" if not math.isfinite(self.sigma) else
               f"{self.sigma:.3g} per run ({self.sigma_source})")
        sure = ("" if not math.isfinite(self.confidence) else
                f" The plan at the limit is within it with probability ~{100 * self.confidence:.0f}%"
                f" (normal noise); up to error {self.e_sure:.3g} the band's 95% upper edge is within "
                f"too.")
        warn = (f" The noise is larger than the limit ({self.limit:g}): single runs cannot tell plans "
                f"apart; lengthen --calibration-steps or add --calibration-repeats."
                if math.isfinite(self.sigma) and self.sigma > self.limit else "")
        replay = (f" {self.replays} repeat(s) replayed their first run exactly (counted once)."
                  if self.replays else "")
        return (f"Accuracy rule: a monotone (L1 isotonic) fit of accuracy loss against plan error over "
                f"all {self.trials} calibration runs ({self.repeats} repeats with other seeds, "
                f"{self.references} reference runs); runs {pair}; noise {sig}. Plans with error up to "
                f"{self.e_max:.3g} are within the limit {self.limit:g} by the fit.{sure}{warn}{replay}")


def _isotonic_median(ys: Sequence[Sequence[float]]) -> list[tuple[int, int, float]]:
    """Pool-adjacent-violators with block medians (L1 isotonic regression) over groups of values in
    ascending error order; returns blocks ``(first group, last group, fitted value)``. The median of an
    even count is its upper middle value (a tie between a good run and a bad one is settled against
    the plan; repeats break it), so one run cannot pull a block it shares with others out of the
    limit, and a group of one failing run is pooled with later, passing ones."""
    blocks: list[tuple[int, int, list[float]]] = []

    def med(v: list[float]) -> float:
        v = sorted(v)
        return v[len(v) // 2]

    for i, g in enumerate(ys):
        blocks.append((i, i, list(g)))
        while len(blocks) > 1 and med(blocks[-2][2]) > med(blocks[-1][2]):
            a, b = blocks[-2], blocks.pop()
            blocks[-1] = (a[0], b[1], a[2] + b[2])
    return [(a, b, med(v)) for a, b, v in blocks]


def accuracy_rule(points: Sequence[Mapping[str, Any]], max_accuracy_loss: float, *,
                  reference_sigma: float | None = None, paired: bool | None = None,
                  references: int = 1) -> AccuracyRule:
    """Decide the error limit from every calibration run, so no single noisy run decides it.

    1. Runs are grouped by error (repeats of a plan share one); a pruned run counts as an infinite loss.
    2. The accuracy loss is fitted as a non-decreasing function of the error (it is in expectation: more
       gradient error never helps) by L1 isotonic regression (:func:`_isotonic_median`): a run that
       breaks the order is pooled with its neighbours and the pool's median taken.
    3. Noise ``sigma`` of one run: the spread of runs around the fit within pooled blocks (residual
       standard deviation, ``n - blocks`` degrees of freedom) and, when runs were not paired, the
       spread of the reference runs (``reference_sigma``, one run's standard deviation; a difference of
       two unpaired runs has ``sqrt(2)`` of it); the larger. Paired runs without a repeat fall back to
       the unpaired figure (an upper bound).
    4. Band of a fitted value resting on ``n`` runs: ``1.645 x 1.2533 sigma / sqrt(n)`` (the median's
       standard error). ``e_max`` is the largest error whose fit is within the limit; ``e_sure`` the
       largest whose band's upper edge is; ``confidence`` = Phi((limit - fit) / se) at ``e_max``.
    """
    groups, replays = _losses_by_error(points)
    errs = sorted(groups)
    rule = AccuracyRule(limit=float(max_accuracy_loss), paired=paired, references=references,
                        trials=sum(len(v) for v in groups.values()) + replays,
                        repeats=sum(len(v) - 1 for v in groups.values()), replays=replays)
    if not errs:
        return rule
    ys = [groups[e] for e in errs]
    blocks = _isotonic_median(ys)
    fit = [0.0] * len(errs)
    runs = [0] * len(errs)
    for a, b, m in blocks:
        n = sum(len(g) for g in ys[a:b + 1])
        for i in range(a, b + 1):
            fit[i], runs[i] = m, n
    sigma, src = _run_noise(ys, blocks, max_accuracy_loss, reference_sigma, paired, references)
    band = [BAND_Z * MEDIAN_SE * sigma / math.sqrt(max(1, n)) if math.isfinite(sigma) else math.nan
            for n in runs]
    rule.errors, rule.fit, rule.band, rule.runs = errs, fit, band, runs
    rule.sigma, rule.sigma_source = sigma, src
    rule.e_max, rule.e_sure, rule.confidence = _error_limits(errs, fit, band, max_accuracy_loss)
    return rule


def _losses_by_error(points: Sequence[Mapping[str, Any]]) -> tuple[dict[float, list[float]], int]:
    """Accuracy losses grouped by plan error (a pruned or NaN run: inf), and the number of repeats
    that replayed their first run exactly (kept once)."""
    groups: dict[float, list[float]] = {}
    seen: set[tuple] = set()
    replays = 0
    for p in points:
        e = float(p["error"])
        if not math.isfinite(e):
            continue
        v = math.inf if p.get("pruned") else float(p["accuracy_loss"])
        key = (json_key(p.get("choice")), v)
        if p.get("choice") is not None and key in seen:
            replays += 1  # a repeat that replayed its first run exactly: one measurement, not two
            continue
        seen.add(key)
        groups.setdefault(e, []).append(v if not math.isnan(v) else math.inf)
    return groups, replays


def _run_noise(ys: Sequence[Sequence[float]], blocks: list[tuple[int, int, float]], max_accuracy_loss: float,
               reference_sigma: float | None, paired: bool | None, references: int) -> tuple[float, str]:
    """Noise of one run's accuracy loss and where it came from (:func:`accuracy_rule`, step 3)."""
    # the noise that decides is near the limit: blocks fitted far past it (a codec family the error
    # number does not capture, a diverging run) are spread of another kind; used only when no other
    near_sq, near_dof, all_sq, all_dof = 0.0, 0, 0.0, 0
    for a, b, m in blocks:
        if math.isfinite(m):
            fin = [v for g in ys[a:b + 1] for v in g if math.isfinite(v)]
            sq_b, dof_b = sum((v - m) ** 2 for v in fin), max(0, len(fin) - 1)
            all_sq, all_dof = all_sq + sq_b, all_dof + dof_b
            if m <= NOISE_NEAR * max(abs(float(max_accuracy_loss)), 1e-12):
                near_sq, near_dof = near_sq + sq_b, near_dof + dof_b
    sq, dof = (near_sq, near_dof) if near_dof > 0 else (all_sq, all_dof)
    s_fit = math.sqrt(sq / dof) if dof > 0 else math.nan
    s_ref = math.sqrt(2.0) * reference_sigma if reference_sigma is not None and math.isfinite(
        reference_sigma) else math.nan
    if paired and math.isfinite(s_fit):
        return s_fit, f"spread around the fit, {dof} degrees of freedom"
    cands = [(s, w) for s, w in ((s_fit, f"spread around the fit, {dof} degrees of freedom"),
                                 (s_ref, f"{references} reference runs, unpaired difference"))
             if math.isfinite(s)]
    return max(cands) if cands else (math.nan, "unknown")


def _error_limits(errs: list[float], fit: list[float], band: list[float],
                  max_accuracy_loss: float) -> tuple[float, float, float]:
    """(e_max, e_sure, confidence at e_max) of the fit and its band (:func:`accuracy_rule`, step 4)."""
    lim = float(max_accuracy_loss) + 1e-12
    e_max = e_sure = 0.0
    conf = math.nan
    for i, e in enumerate(errs):
        if fit[i] <= lim:
            e_max = e
            se = band[i] / BAND_Z if math.isfinite(band[i]) else math.nan
            if not math.isfinite(se):  # noise unknown: no probability to give
                conf = math.nan
            elif se == 0:
                conf = 1.0 if fit[i] < lim else 0.5
            else:
                conf = 0.5 * math.erfc(-(lim - fit[i]) / (se * math.sqrt(2)))
            if math.isfinite(band[i]) and fit[i] + band[i] <= lim:
                e_sure = e
    return e_max, e_sure, conf


# The g(e) form cannot match every run closer than this (log units), however precisely the run was
# measured: the floor of a run's standard error in the fit's weights (issue 28).
FIT_SE_FLOOR = 0.05


def fit_convergence(points: Sequence[Mapping[str, Any]], max_accuracy_loss: float,
                    rule: AccuracyRule | None = None) -> Convergence:
    """Fit ``g(e) = 1 + k e^gamma`` to calibration points and find the feasible error limit.

    ``points`` hold ``error``, ``ratio`` (steps the plan needed / steps uncompressed needed),
    ``accuracy_loss`` and ``censored`` (the trial stopped before reaching the level: ``ratio`` is a
    lower bound), and may hold ``ratio_se`` (standard error of ``log(ratio)``, from
    ``calibrate.stretch``). The fit minimises weighted squared log-ratio residuals, weight
    ``1 / (ratio_se^2 + FIT_SE_FLOOR^2)`` (a run measured within wide noise pulls little; none at
    all with an infinite ``ratio_se``), over a grid of ``gamma`` in [0.5, 3] with ``k >= 0``. A
    censored point is a one-sided constraint: it counts only while the model predicts less than
    its bound, so it can pull the fit up to the bound and never above it.
    ``e_max`` comes from the accuracy rule (``rule``, or :func:`accuracy_rule` of the points): the
    largest error a monotone fit over every run places within ``max_accuracy_loss``.
    """
    pts = sorted(points, key=lambda p: p["error"])
    e_max = (rule or accuracy_rule(pts, max_accuracy_loss)).e_max
    fit_pts = [p for p in pts if p["error"] > 0 and math.isfinite(p["ratio"]) and p["ratio"] > 0]
    if not fit_pts:
        return Convergence(k=0.0, gamma=1.0, e_max=e_max)
    es = np.array([p["error"] for p in fit_pts])
    rs = np.log(np.array([max(p["ratio"], 1e-6) for p in fit_pts]))
    cens = np.array([bool(p.get("censored")) for p in fit_pts])
    se = np.array([float(p.get("ratio_se") if p.get("ratio_se") is not None else math.nan) for p in fit_pts])
    se = np.where(np.isnan(se), 0.0, se)  # not measured (pruned runs, older studies): the floor alone
    w = np.where(np.isinf(se), 0.0, 1.0 / (np.where(np.isinf(se), 0.0, se) ** 2 + FIT_SE_FLOOR ** 2))

    def loss(k: float, gamma: float) -> float:
        res = np.log1p(k * es ** gamma) - rs
        res = np.where(cens & (res > 0), 0.0, res)  # above a lower bound: consistent
        return float(np.dot(w * res, res))

    best = (math.inf, 0.0, 1.0)
    ks = np.concatenate([[0.0], np.logspace(-4, 6, 241)])
    for gamma in np.linspace(0.5, 3.0, 26):  # every k of the grid at once
        res = np.log1p(ks[:, None] * es[None, :] ** gamma) - rs[None, :]
        res = np.where(cens[None, :] & (res > 0), 0.0, res)
        v = (w * res * res).sum(1)
        i = int(np.argmin(v))
        if v[i] < best[0] - 1e-12:
            best = (float(v[i]), float(ks[i]), float(gamma))
    # zoom in around the grid optimum (k on a log scale)
    if best[1] > 0:
        dk, dg = 10 ** (10 / 240), 0.1
        for _ in range(30):
            _, k0, g0 = best
            for k in (k0 / dk, k0, k0 * dk):
                for gamma in (g0 - dg, g0, g0 + dg):
                    if 0.5 <= gamma <= 3.0:
                        v = loss(k, gamma)
                        if v < best[0] - 1e-15:
                            best = (v, k, gamma)
            dk, dg = dk ** 0.6, dg * 0.6
    return Convergence(k=best[1], gamma=best[2], e_max=e_max)


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both coordinates (both minimised)."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front: list[int] = []
    best_y = math.inf
    for i in order:
        if points[i][1] < best_y:
            front.append(i)
            best_y = points[i][1]
    return front
