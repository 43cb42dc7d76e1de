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
5. Codec time per layer is the measured round trip (one encode + one decode) scaled by how many of each
   the collective does: scatter-reduce-allgather encodes ``1 + 1/N`` of the tensor and decodes ``2`` of
   it, i.e. ``(3 + 1/N) / 2`` round trips; top-k encodes once and scatter-adds ``N-1`` small messages
   (counted as one round trip).

Steps to the target: ``S(p) = S_ref * g(e(p))``, where ``e(p)`` is the plan's relative gradient error
(the gradient-energy-weighted root mean square of the per-layer relative errors, measured with error
feedback on real gradients) and ``g(e) = 1 + k e^gamma`` is fitted by the calibration (``g(0) = 1``).

Time to accuracy ``TTA = S(p) * T(p, c)``; cost ``= TTA * N * price_per_node_hour / 3600``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from fastml_strategy.autotune.catalog import HardwareOption, Link
from fastml_strategy.config import Codec, CodecConfig

__all__ = [
    "CANDIDATES",
    "LayerProfile",
    "Profile",
    "Convergence",
    "StepBreakdown",
    "ddp_buckets",
    "plan_error",
    "step_time",
    "evaluate",
    "fit_alpha_beta",
    "fit_codec_scale",
    "family",
    "fit_convergence",
    "pareto_front",
]

# DDP's bucket sizes (torch.nn.parallel.DistributedDataParallel: bucket_cap_mb=25, and
# dist._DEFAULT_FIRST_BUCKET_BYTES = 1 MiB for the first bucket, the last layers).
FIRST_BUCKET_BYTES = 1 << 20
BUCKET_BYTES = 25 << 20


def _q(bits: int, **kw: Any) -> CodecConfig:
    return CodecConfig(codec=Codec.QUANTIZE, bits=bits, **kw)


# The per-layer choices the search considers, cheapest error first. "none" keeps every plan with
# error 0 reachable (uncompressed is always feasible); "-noef" options drop error feedback, saving the
# residual memory at the price of bias (profiled like every other option).
CANDIDATES: dict[str, CodecConfig] = {
    "none": CodecConfig(codec=Codec.FP32),
    "fp16": CodecConfig(codec=Codec.FP16),
    "int8": _q(8),
    "int6": _q(6),
    "int4": _q(4),
    "int3": _q(3),
    "int2": _q(2),
    "int4-noef": _q(4, error_feedback=False),
    "topk10": CodecConfig(codec=Codec.TOPK, topk=0.10),
    "topk1": CodecConfig(codec=Codec.TOPK, topk=0.01),
    "topk1-int4": CodecConfig(codec=Codec.TOPK, topk=0.01, bits=4),
}


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


@dataclass(frozen=True)
class StepBreakdown:
    compute_s: float
    codec_s: float
    wire_s: float  # total wire time of all buckets
    exposed_s: float  # the part of wire_s that does not overlap the backward pass
    step_s: float
    bytes_per_rank: int


# -- buckets and plan error ------------------------------------------------------------------------
def ddp_buckets(profile: Profile) -> list[list[LayerProfile]]:
    """Layers grouped as DDP buckets them: reverse registration order, 1 MiB first bucket, then 25 MiB."""
    buckets: list[list[LayerProfile]] = []
    cur: list[LayerProfile] = []
    size = 0
    cap = FIRST_BUCKET_BYTES
    for lp in sorted(profile.layers, key=lambda x: -x.index):
        cur.append(lp)
        size += 4 * lp.numel
        if size >= cap:
            buckets.append(cur)
            cur, size, cap = [], 0, BUCKET_BYTES
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
    if nodes <= 1:
        return 0.0
    if cfg.codec is Codec.TOPK:
        return 1.0
    return (3.0 + 1.0 / nodes) / 2.0


def step_time(profile: Profile, choice: Mapping[str, str], option: HardwareOption,
              nodes: int | None = None, hook: bool = True) -> StepBreakdown:
    """Predicted step time of a plan (``choice``: layer name -> CANDIDATES key) on ``option``
    (with ``nodes`` overriding the option's node count, for scaling predictions). ``hook=False`` is
    plain DDP (fp32 all-reduce, no encode/decode), the uncompressed baseline."""
    from fastml_strategy.codecs import effective_config, wire_bytes

    n = option.nodes if nodes is None else nodes
    ranks = n * option.accelerators_per_node
    scale = profile.world_size / (ranks * option.compute_speed)
    fwd, bwd, opt = (profile.forward_s * scale, profile.backward_s * scale, profile.optimizer_s * scale)
    link = option.link
    codec_total = 0.0
    free = 0.0
    wire_total = 0.0
    total_bytes = 0
    for bucket in ddp_buckets(profile):
        nbytes = 0
        codec_b = 0.0
        for lp in bucket:
            name, cfg = _cfg(choice, lp) if hook else ("none", CANDIDATES["none"])
            if n > 1:
                nbytes += wire_bytes(lp.numel, cfg, n)
                eff = effective_config(cfg, lp.numel, n)
                if hook and lp.tunable:
                    # a top-k layer past its fallback world size runs its dense fallback codec
                    t = lp.codec_s.get(name, 0.0) if eff == cfg else lp.codec_s.get(
                        _candidate_name(eff), lp.codec_s.get("int8", 0.0))
                    codec_b += (t * _codec_factor(eff, n) * profile.codec_scale.get(family(eff), 1.0)
                                / option.compute_speed)
        # the hook issues two collectives per bucket (all_to_all + all_gather), DDP one ring
        # all-reduce; both take 2(N-1) latency rounds
        rounds = 2 * (n - 1)
        wire = (rounds * link.latency_s + nbytes / link.bandwidth_Bps) if n > 1 else 0.0
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
    return StepBreakdown(fwd + bwd + opt, codec_total, wire_total, exposed, step, total_bytes)


def family(cfg: CodecConfig) -> str:
    """The codec family whose time scale applies: fp32, cast (fp16/bf16), quantize or topk."""
    return {Codec.FP32: "fp32", Codec.FP16: "cast", Codec.BF16: "cast", Codec.QUANTIZE: "quantize",
            Codec.TOPK: "topk"}[cfg.codec]


def fit_codec_scale(profile: Profile, option: HardwareOption, measured: Mapping[str, float],
                    lo: float = 0.25, hi: float = 10.0) -> dict[str, float]:
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
                return step_time(profile, choice, option).step_s

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


def _candidate_name(cfg: CodecConfig) -> str:
    for name, c in CANDIDATES.items():
        if c == cfg:
            return name
    return "int8"


def evaluate(profile: Profile, choice: Mapping[str, str], option: HardwareOption, conv: Convergence,
             target_steps: float, hook: bool = True) -> dict[str, float]:
    """All the numbers of one (plan, option) pair: error, steps, step time, time to accuracy, cost."""
    e = plan_error(profile, choice)
    br = step_time(profile, choice, option, hook=hook)
    steps = target_steps * conv.g(e)
    tta = steps * br.step_s
    cost = tta * option.nodes * option.price_per_hour / 3600.0
    return {
        "error": e,
        "feasible": e <= conv.e_max + 1e-12,
        "g": conv.g(e),
        "steps": steps,
        "step_s": br.step_s,
        "compute_s": br.compute_s,
        "codec_s": br.codec_s,
        "wire_s": br.wire_s,
        "exposed_s": br.exposed_s,
        "bytes_per_rank": br.bytes_per_rank,
        "tta_s": tta,
        "cost_usd": cost,
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


def fit_convergence(points: Sequence[Mapping[str, Any]], max_accuracy_loss: float) -> Convergence:
    """Fit ``g(e) = 1 + k e^gamma`` to calibration points and find the feasible error limit.

    ``points`` hold ``error``, ``ratio`` (steps the plan needed / steps uncompressed needed),
    ``accuracy_loss`` and ``censored`` (the trial stopped before reaching the level: ``ratio`` is a
    lower bound). The fit minimises squared log-ratio residuals over a grid of ``gamma`` in [0.5, 3]
    with ``k >= 0``; a censored point only counts when the model predicts less than its bound.
    ``e_max`` is the largest error such that every calibration point at or below it stayed within
    ``max_accuracy_loss`` (a conservative envelope: no interpolation past a failing point).
    """
    pts = sorted(points, key=lambda p: p["error"])
    e_max = 0.0
    for p in pts:
        ok = (not p.get("pruned")) and p["accuracy_loss"] <= max_accuracy_loss
        if not ok:
            break
        e_max = max(e_max, p["error"])
    fit_pts = [p for p in pts if p["error"] > 0 and math.isfinite(p["ratio"]) and p["ratio"] > 0]
    if not fit_pts:
        return Convergence(k=0.0, gamma=1.0, e_max=e_max)
    es = np.array([p["error"] for p in fit_pts])
    rs = np.log(np.array([max(p["ratio"], 1e-6) for p in fit_pts]))
    cens = np.array([bool(p.get("censored")) for p in fit_pts])
    def loss(k: float, gamma: float) -> float:
        res = np.log1p(k * es ** gamma) - rs
        res = np.where(cens & (res > 0), 0.0, res)  # above a lower bound: consistent
        return float(np.dot(res, res))

    best = (math.inf, 0.0, 1.0)
    for gamma in np.linspace(0.5, 3.0, 26):
        for k in np.concatenate([[0.0], np.logspace(-4, 6, 241)]):
            v = loss(float(k), float(gamma))
            if v < best[0] - 1e-12:
                best = (v, float(k), float(gamma))
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
