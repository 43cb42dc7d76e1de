"""The statistics of the calibration runs: the accuracy rule (which plan errors stay within
``--max-accuracy-loss``, decided by every run so that no single noisy one decides) and the fit of
``g(e) = 1 + k e^gamma`` to the runs' stretches (censored runs as one-sided bounds).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from fastml_strategy.autotune.costmodel.base import Convergence

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
    the largest error the fit places within the limit, or within the noise band of no loss at all
    (its fitted loss not above its band's half-width: the runs cannot tell it from the reference);
    ``e_noise``: the largest error admitted only that way (0: none); ``e_sure``: the largest whose
    band's upper edge is within the limit; ``confidence``: the probability (normal noise) that the
    plan at ``e_max`` is within the limit.
    """

    limit: float
    errors: list[float] = field(default_factory=list)
    fit: list[float] = field(default_factory=list)
    band: list[float] = field(default_factory=list)
    runs: list[int] = field(default_factory=list)
    sigma: float = math.nan
    sigma_source: str = "unknown"
    e_max: float = 0.0
    e_noise: float = 0.0
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
        noise = (f" Up to error {self.e_noise:.3g} the fitted loss exceeds the limit but not its noise band "
                 f"(it cannot be told from no loss with this noise), so those plans are admitted; "
                 f"more runs (--calibration-repeats, --calibration-steps) narrow the band."
                 if self.e_noise > 0 else "")
        return (f"Accuracy rule: a monotone (L1 isotonic) fit of accuracy loss against plan error over "
                f"all {self.trials} calibration runs ({self.repeats} repeats with other seeds, "
                f"{self.references} reference runs); runs {pair}; noise {sig}. Plans with error up to "
                f"{self.e_max:.3g} are within the limit {self.limit:g} by the fit, or within its noise "
                f"band.{noise}{sure}{warn}{replay}")


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
       standard error). ``e_max`` is the largest error whose fit is within the limit or within its
       band (a fitted loss no larger than the band's half-width cannot be told from no loss;
       otherwise one noisy run, say +6.9% against a noise of 0.069, excludes every compressed plan);
       ``e_sure`` the largest whose band's upper edge is within the limit; ``confidence`` =
       Phi((limit - fit) / se) at ``e_max``.
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
    rule.e_max, rule.e_noise, rule.e_sure, rule.confidence = _error_limits(errs, fit, band, max_accuracy_loss)
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
                  max_accuracy_loss: float) -> tuple[float, float, float, float]:
    """(e_max, e_noise, e_sure, confidence at e_max) of the fit and its band (:func:`accuracy_rule`,
    step 4). The errors admitted form a prefix: the first one neither within the limit nor within
    its band ends it."""
    lim = float(max_accuracy_loss) + 1e-12
    e_max = e_noise = e_sure = 0.0
    conf = math.nan
    for i, e in enumerate(errs):
        within_noise = math.isfinite(band[i]) and fit[i] <= band[i]
        if not (fit[i] <= lim or within_noise):
            break
        e_max = e
        if fit[i] > lim:
            e_noise = e
        se = band[i] / BAND_Z if math.isfinite(band[i]) else math.nan
        if not math.isfinite(se):  # noise unknown: no probability to give
            conf = math.nan
        elif se == 0:
            conf = 1.0 if fit[i] < lim else 0.5
        else:
            conf = 0.5 * math.erfc(-(lim - fit[i]) / (se * math.sqrt(2)))
        if math.isfinite(band[i]) and fit[i] + band[i] <= lim:
            e_sure = e
    return e_max, e_noise, e_sure, conf


# The g(e) form cannot match every run closer than this (log units), however precisely the run was
# measured: the floor of a run's standard error in the fit's weights.
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
