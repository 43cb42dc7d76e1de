"""One (plan, option) pair in numbers (error, steps, step time, time to accuracy, cost) as a
:class:`Trial`, the search's objective, the fits of the link and the codec-time scales to what was
measured, and the Pareto front of time against cost.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from fastml_strategy.autotune.catalog import HardwareOption, Link
from fastml_strategy.autotune.costmodel.base import (CANDIDATES, Convergence, Profile, Sharding, family,
                                                     plan_error)
from fastml_strategy.autotune.costmodel.ddp import step_time


_REQUIRED = object()


def _field(key: str, cast: Any, doc: str, default: Any = _REQUIRED) -> Any:
    """A read-only typed attribute of :class:`Trial`: its figure ``key`` (through ``cast``), or
    ``default`` where the row has none (no default: the figure is required)."""

    def get(self: "Trial") -> Any:
        v = self._d[key] if default is _REQUIRED else self._d.get(key, default)
        return v if cast is None else cast(v)

    return property(get, doc=doc)


class Trial(Mapping[str, Any]):
    """One plan evaluated on one hardware option: what the cost model predicts for it and where the
    search put it (the rows of ``trials.csv``, a result's ``best`` and ``baseline``).

    Immutable: built in one place (:meth:`predicted`, by :func:`evaluate` and ``evaluate_local``);
    the search and the driver annotate it (``option``, ``trial``, ``objective``, ``choice``, ...) by
    taking a copy with :meth:`replace`, so a row another part holds (a result's ``best``, a
    ``trials.csv`` row, the search's own list) never changes under it.
    The fields every part of the autotuner reads are typed attributes (``t.choice``, ``t.tta_s``);
    the record is also a mapping of exactly the figures it holds (``t["tta_s"]``, ``dict(t)``,
    JSON and CSV as before), so a figure a kind of training does not have (sharded bytes, a local
    step's stretch) is absent rather than zero. :meth:`of` takes a plain mapping (a stored row, or a
    test's literal) as it is.
    """

    __slots__ = ("_d",)

    def __init__(self, data: Mapping[str, Any] | None = None, /, **kw: Any) -> None:
        object.__setattr__(self, "_d", dict(data or {}, **kw))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"a Trial is immutable; use trial.replace({name}=...) for a changed copy")

    @classmethod
    def of(cls, row: Mapping[str, Any]) -> "Trial":
        """``row`` as a Trial (itself when it already is one)."""
        return row if isinstance(row, Trial) else cls(row)

    @classmethod
    def predicted(cls, *, error: float, feasible: bool, g: float, steps: float, br: Any, tta_s: float,
                  option: HardwareOption, node_net_bytes: int | None = None, **extra: Any) -> "Trial":
        """The prediction of one plan on ``option``: its error and feasibility, ``g(e)``, steps to the
        target, the step breakdown ``br`` (a ``StepBreakdown``; DDP adds the bytes leaving each
        machine, ``node_net_bytes``), the time to accuracy and its cost, then ``extra`` figures (per
        kind of training) in the order given."""
        d = {"error": error, "feasible": feasible, "g": g, "steps": steps, "step_s": br.step_s,
             "compute_s": br.compute_s, "codec_s": br.codec_s, "wire_s": br.wire_s, "exposed_s": br.exposed_s,
             "bytes_per_rank": br.bytes_per_rank}
        if node_net_bytes is not None:
            d["node_net_bytes"] = node_net_bytes
        return cls(d, tta_s=tta_s, cost_usd=cost_usd(tta_s, option), **extra)

    # -- the mapping -------------------------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self._d[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._d)

    def __len__(self) -> int:
        return len(self._d)

    def __repr__(self) -> str:
        return f"Trial({self._d!r})"

    def __eq__(self, other: object) -> bool:
        return dict(self) == dict(other) if isinstance(other, Mapping) else NotImplemented

    def __getstate__(self) -> dict[str, Any]:  # broadcast to every rank (pickle)
        return self._d

    def __setstate__(self, d: dict[str, Any]) -> None:
        object.__setattr__(self, "_d", d)

    def replace(self, changes: Mapping[str, Any] | None = None, /, **kw: Any) -> "Trial":
        """A copy with ``changes`` and ``kw`` (new keys last; a later one wins)."""
        return Trial({**self._d, **(changes or {}), **kw})

    # -- the typed fields --------------------------------------------------------------------------
    option: str = _field("option", str, "The hardware option evaluated on.")
    choice: dict[str, str] = _field("choice", None, "Search group -> codec option (CANDIDATES key).")
    objective: float = _field("objective", None, "What the search minimised: the cost where the option has "
                              "a price, else the time.")
    feasible: bool = _field("feasible", bool, "Within the accuracy rule's error limit (and, sharded, the "
                            "residual memory limit).")
    error: float = _field("error", None, "The plan's relative error per step (the accuracy rule's e).")
    step_s: float = _field("step_s", None, "Predicted seconds per step.")
    tta_s: float = _field("tta_s", None, "Time to accuracy, seconds: steps x step time.")
    cost_usd: float = _field("cost_usd", None, "What the time to accuracy costs on the option, USD.")
    every: int = _field("every", int, "H, the sync period: 1 is per-step compression (the DDP hook), > 1 "
                        "LocalSGD.", default=1)
    kind: str = _field("kind", None, "``fastml`` (per-step compression), ``local-steps``, ``plain-ddp`` or "
                       "``fsdp-own``/``hsdp-own``.", default="fastml")
    use_hook: bool = _field("use_hook", bool, "Whether the plan asks for FastML (False: plain DDP or FSDP's "
                            "own collectives).", default=True)

    @property
    def intra_node(self) -> str | None:
        """The hop inside the machine chosen for the plan (``Plan.intra_node``): "bf16" or "fp16", or
        None (exact fp32, or an option with no such hop)."""
        v = self._d.get("intra_node")
        return None if v in (None, "none") or (isinstance(v, float) and math.isnan(v)) else str(v)

    @property
    def bucket_mb(self) -> float | None:
        """DDP's ``bucket_cap_mb`` chosen for the plan (None: DDP's default buckets)."""
        return self._d.get("bucket_mb")

    @property
    def uniform(self) -> str | None:
        """The codec of a uniform plan (every group on one option), else None."""
        vals = set(self.choice.values())
        return next(iter(vals)) if len(vals) == 1 else None


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
             max_residual_bytes: float | None = None, bucket_mb: float | None = None,
             intra_node: str | None = None) -> Trial:
    """All the numbers of one (plan, option) pair: error, steps, step time, time to accuracy, cost.
    Sharded: also the bytes per collective and the memory per rank; a plan whose residuals exceed
    ``max_residual_bytes`` per rank is infeasible. ``intra_node`` (DDP on several machines of several
    ranks: ``Plan.intra_node``, "none", "bf16" or "fp16"): the hop inside the machine's bytes and
    rounding error (:func:`~fastml_strategy.autotune.costmodel.plan_error`), kept on the row as
    ``intra_node``; None: no such hop is searched (the row has no ``intra_node``)."""
    e = plan_error(profile, choice, intra_node if hook else None)
    br = step_time(profile, choice, option, hook=hook, sharding=sharding, bucket_mb=bucket_mb,
                   intra_node=intra_node if hook else None)
    steps = target_steps * conv.g(e)
    tta = steps * br.step_s
    memory_ok = max_residual_bytes is None or br.residual_bytes <= max_residual_bytes
    extra: dict[str, Any] = {}
    if sharding is not None and sharding.sharded:
        extra.update(allgather_bytes=br.allgather_bytes, reduce_scatter_bytes=br.reduce_scatter_bytes,
                     allreduce_bytes=br.allreduce_bytes, residual_bytes=br.residual_bytes,
                     state_bytes=br.state_bytes, memory_ok=memory_ok)
    if intra_node is not None:
        extra["intra_node"] = intra_node if hook else "none"
    return Trial.predicted(error=e, feasible=e <= conv.e_max + 1e-12 and memory_ok, g=conv.g(e), steps=steps,
                           br=br, tta_s=tta, option=option, node_net_bytes=br.node_net_bytes, **extra)


# -- fits ---------------------------------------------------------------------------------------------
# TCP/IP over Ethernet at MTU 1500 (Linux, TCP timestamps on): a segment carries 1448 payload bytes and
# 66 header bytes beside them (Ethernet 14, IPv4 20, TCP 20 + 12 of timestamps), which a rate limit
# (tc tbf, a switch port) counts: 4.4% of a nominal link's rate is headers. A physical wire adds 24
# more per frame (preamble, gap, FCS); the emulated links of benchmarks/bench_scale.py do not.
TCP_FRAME_OVERHEAD = 66
TCP_IP_HEADERS = 52  # the part of it inside the MTU (IPv4 + TCP with timestamps)


def tcp_payload_link(rate_bits: float, latency_s: float, mtu: int = 1500, overhead: int = TCP_FRAME_OVERHEAD,
                     source: str = "given") -> Link:
    """The :class:`Link` a collective's payload sees on a link of nominal ``rate_bits`` (bits per
    second, as a NIC or ``tc`` states it) and one-way ``latency_s``: the rate times the payload's
    share of each frame, ``(mtu - 52) / (mtu - 52 + overhead)`` (0.956 at MTU 1500; 0.993 at 9000).
    The model's bytes are payload (the hook's ``bytes_sent``), so pricing them at the nominal rate
    under-predicts every wire-bound step by that share (measured: 100 Mbit/s through tbf carried
    11.85 MB/s of TCP payload, 0.948 of 12.5)."""
    if rate_bits <= 0 or mtu <= TCP_IP_HEADERS:
        raise ValueError(f"tcp_payload_link: rate {rate_bits} bit/s and MTU {mtu}: give a positive rate and "
                         f"an MTU above the {TCP_IP_HEADERS} header bytes")
    mss = mtu - TCP_IP_HEADERS
    return Link(rate_bits / 8.0 * mss / (mss + overhead), latency_s, source)


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
