"""One (plan, option) pair in numbers (error, steps, step time, time to accuracy, cost), the
search's objective, the fits of the link and the codec-time scales to what was measured, and the
Pareto front of time against cost.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from fastml_strategy.autotune.catalog import HardwareOption, Link
from fastml_strategy.autotune.costmodel.base import (CANDIDATES, Convergence, Profile, Sharding, family,
                                                     plan_error)
from fastml_strategy.autotune.costmodel.ddp import step_time

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
