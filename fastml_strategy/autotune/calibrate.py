"""Convergence calibration: how much slower does a plan of gradient error ``e`` train?

The profile says what each plan's error is; this module measures what that error costs in steps.

1. Reference: train the workload uncompressed for ``steps`` steps from its initial weights (fixed seed),
   keeping the loss curve and, if the workload has one, the final eval metric.
2. Candidates: the same run with :class:`~fastml_strategy.autotune.profile.SimulatedCompression`
   (per-layer codecs with error feedback). The first candidates are uniform plans spread over the
   error range (so the fit sees small and large errors); further ones are random per-group mixes.
   After each search round the driver adds the plans the search chose (verification): one scalar
   error does not capture every codec family equally (top-k with error feedback and quantization
   of the same per-step error train differently), so the plan that will be used is always trained
   once, and the fit and the feasible limit include it.
3. Stretch (:func:`stretch`). Both loss curves are smoothed (exponential moving average)
   and made monotone (running minimum). At 15 levels, the reference's smoothed loss at 20% to 90% of
   the run, the candidate's crossing step (interpolated, lag-corrected) is divided by the
   reference's. Each level's log-ratio has the standard error ``sigma / |d ref / d log t|``: the
   noise of a smoothed loss difference over the reference's slope there, so where the reference has
   flattened (a vertical offset within noise is a large horizontal one) a level weighs little, and
   past a factor e of uncertainty not at all. ``sigma`` comes from the two references and the
   repeats (:func:`stretch_noise`). A level the candidate never reaches is a lower bound and enters
   as a one-sided constraint. The estimate is the weighted least-squares log-ratio under those
   constraints, with a ~95% interval; a run that reached no level is *censored*: its ratio is the
   interval's lower end, a bound, and the fit of ``g`` takes it as one. The usual way (three levels,
   their geometric mean, an unreached level counted as ``run length / reference step``) read the
   flattened part of a 60-step run as 1.33x for a plan indistinguishable from the reference.
4. Accuracy loss: reference metric minus candidate metric (eval function), or without one the relative
   increase of the final smoothed training loss.
5. Pruning: every few steps a trial reports its current lag (its step count over the step at which
   the reference had the candidate's current loss); Optuna's ThresholdPruner stops trials more than
   ``prune_ratio`` times behind after the first quarter. A pruned trial counts as failing the
   accuracy limit. This is a single-objective study, so pruning works (Optuna 5 multi-objective
   studies cannot prune).
6. :func:`~fastml_strategy.autotune.costmodel.fit_convergence` fits ``g(e) = 1 + k e^gamma`` (each run
   weighted by its stretch's standard error, censored runs as one-sided bounds) and the largest
   feasible error.
7. :func:`time_to_same_loss`: the driver's last check before writing the plan, the tuned plan and a
   uniform plan trained side by side, and which reaches the tuned plan's losses sooner in wall time
   (measured stretch x predicted step time).

This is a single-rank simulation: each rank's gradient is compressed once, as the first half of the
scatter-reduce-allgather does; the re-compression of the sum is not simulated (its error is of the same
order and is partly averaged out across ranks).

Local steps (:func:`run_local_calibration`): how much longer does :class:`~fastml_strategy.LocalSGD`
with H inner steps between synchronisations take to reach the same loss?

1. Reference: per-step synchronisation at the simulated world size W (``--world-size``): one model,
   each step the mean gradient of W consecutive batches (what DDP computes).
2. Local steps, for each H: W replicas in one process, replica i training on batch i of each W
   consecutive batches (the same batches as the reference, in the same order), each with its own
   inner optimizer; every H steps the pseudo-gradients (shared - local) are compressed with the
   calibrated outer plan (uniform int4, error feedback per replica: the first half of the
   scatter-reduce-allgather, as above), averaged, and LocalSGD's outer optimizer (Nesterov, lr 0.7,
   momentum 0.9) steps the shared parameters, which every replica then takes. The last step
   synchronises too, so the metric is the shared model's. The loss of a step is the replicas' mean.
3. Stretch ``s(H)`` = :func:`steps_ratio` of the two loss curves (the plans' :func:`stretch`, with
   the two curves' step-to-step scatter as the noise: one reference only), at least 1; accuracy loss
   as for the plans.

Each run lasts ``max(--calibration-steps, 4 x the largest H)`` steps (the largest H syncs at least 4
times) of W forward/backward passes: with the defaults (W = 2, H in 10 and 50) three runs of 200
steps, 1200 passes. Results are kept in the storage (a resumed run reads them back).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import random
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from fastml_strategy.autotune.costmodel import (CANDIDATES, LOCAL_CALIBRATION_OPTION, LocalCalibration,
                                                Profile, json_key, plan_error)
from fastml_strategy.autotune.profile import SimulatedCompression
from fastml_strategy.autotune.workload import Workload
from fastml_strategy.config import LocalSteps

__all__ = ["train_curve", "smooth", "steps_ratio", "stretch", "Stretch", "Noise", "stretch_noise",
           "step_noise", "time_to_same_loss", "lag_ratio", "end_slope", "accuracy_within_noise", "calibration_candidates",
           "run_calibration", "powersgd_curve", "build_run", "runs_paired", "final_loss", "reference_sigma",
           "repeat_candidates", "local_curve", "local_calibration_steps", "run_local_calibration"]

_LOCAL = LocalSteps()  # LocalSGD's outer optimizer, the one calibrated by default


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore the global RNGs of torch (CPU, and the current CUDA device when CUDA is in use),
    ``random`` and numpy on exit. A calibration run must seed them globally (the target's factory and
    training code draw from them), but the caller's own random state is not the autotuner's to change."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    py, npy = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            random.setstate(py)
            np.random.set_state(npy)


def _seed_all(seed: int) -> None:
    """Seed every global RNG: call inside :func:`preserved_rng`."""
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % (2 ** 32))


# A run of seed s starts s % SEED_SKIP batches into the workload's stream (the reference of that seed
# too): a workload that seeds itself (its own torch.manual_seed and generators) still sees another
# data order under another seed, so a repeat measures something new.
SEED_SKIP = 16


def seeded_stream(wl: Workload, seed: int) -> Any:
    """The batch stream of a run of ``seed``: ``seed % SEED_SKIP`` batches in."""
    stream = wl.batch_stream()
    for _ in range(seed % SEED_SKIP):
        next(stream)
    return stream


def build_run(wl: Workload, seed: int) -> Workload:
    """The workload of one calibration run: rebuilt from its factory (when it has one) with every
    random generator seeded, then seeded again, so the model starts from the same weights and a
    deterministic factory (or DataLoader) yields the same batches in every run of that seed.
    This seeds the global RNGs: callers run it inside :func:`preserved_rng`."""
    _seed_all(seed)
    wl = wl.rebuild()
    _seed_all(seed)
    return wl


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # an object without a usable ==: cannot say they are the same
        return False


def runs_paired(wl: Workload, seed: int, batches: int = 3) -> bool:
    """Whether two runs of one seed are paired: built the way calibration runs are built
    (:func:`build_run`), they start from the same weights and draw the same first ``batches`` batches.
    Then a candidate's loss differs from the reference's by what its compression did, not by the data
    it happened to see."""
    with preserved_rng():
        a = build_run(wl, seed)
        sa = [p.detach().clone() for p in a.fresh_model().parameters()]
        ba = [x for _, x in zip(range(batches), a.batch_stream())]
        b = build_run(wl, seed)
        sb = [p.detach().clone() for p in b.fresh_model().parameters()]
        bb = [x for _, x in zip(range(batches), b.batch_stream())]
    return _same(sa, sb) and _same(ba, bb)


def window(n: int) -> int:
    """Steps the final loss is averaged over: the last fifth of a run of ``n`` steps, at least 5."""
    return min(n, max(5, n // 5))


def final_loss(losses: Sequence[float]) -> float:
    """Mean training loss over the last :func:`window` steps (inf when any of them diverged)."""
    x = np.asarray(losses[-window(len(losses)):], dtype=float) if len(losses) else np.array([np.inf])
    return float(x.mean()) if np.isfinite(x).all() else math.inf


def _train(wl: Workload, steps: int, seed: int, prepare: Callable[[torch.nn.Module], Callable[[], None] | None],
           report: Callable[[int, list[float]], None] | None = None,
           report_every: int = 5) -> tuple[list[float], float | None]:
    """Train ``steps`` steps from the initial weights on the seeded batches; ``prepare(model)`` gives
    what runs on the gradients between backward and the optimizer step (None: nothing). Each step
    averages the gradients of ``wl.ranks`` batches (the ranks' mean, as DDP's all-reduce gives it) and
    records their mean loss. Returns the loss curve and the eval metric."""
    W = max(1, int(wl.ranks))
    wl = build_run(wl, seed)
    model = wl.fresh_model()
    model.train()
    opt = wl.make_optimizer(model)
    on_grads = prepare(model)
    losses: list[float] = []
    stream = seeded_stream(wl, seed)
    for t in range(steps):
        opt.zero_grad(set_to_none=True)
        v = 0.0
        for _ in range(W):
            loss = wl.loss_fn(model, next(stream))
            (loss / W if W > 1 else loss).backward()
            v += float(loss.detach()) / W
        if on_grads is not None:
            on_grads()
        opt.step()
        losses.append(v if math.isfinite(v) else math.inf)
        if report is not None and (t + 1) % report_every == 0:
            report(t + 1, losses)
    return losses, _metric(wl, model)


@preserved_rng()
def train_curve(wl: Workload, choice: Mapping[str, str] | None, steps: int, seed: int,
                report: Callable[[int, list[float]], None] | None = None,
                report_every: int = 5) -> tuple[list[float], float | None]:
    """Train ``steps`` steps from the initial weights; return the loss curve and the eval metric."""
    configs = {n: CANDIDATES[o] for n, o in (choice or {}).items() if o != "none"}

    def prepare(model: torch.nn.Module) -> Callable[[], None] | None:
        return SimulatedCompression(model, configs).apply if choice else None

    return _train(wl, steps, seed, prepare, report, report_every)


class _OneBucket:
    """What torch's PowerSGD hook reads from DDP's ``GradBucket`` (``buffer``, ``gradients``,
    ``index``, ``is_last``), over one flat fp32 buffer of every trainable gradient in DDP's order
    (reverse registration): one bucket, as the hook runs on gloo (costmodel.powersgd)."""

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(reversed(list(params)))
        self._buf = torch.zeros(sum(p.numel() for p in self.params))
        self._views, i = [], 0
        for p in self.params:
            self._views.append(self._buf[i:i + p.numel()].view_as(p))
            i += p.numel()

    def fill(self) -> None:
        for v, p in zip(self._views, self.params):
            v.copy_(p.grad) if p.grad is not None else v.zero_()  # DDP all-reduces unused ones as zeros

    def give_back(self, out: torch.Tensor) -> None:
        i = 0
        for p in self.params:
            p.grad = out[i:i + p.numel()].view_as(p).clone()
            i += p.numel()

    def buffer(self) -> torch.Tensor:
        return self._buf

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


@functools.cache
def _one_rank_group() -> Any:
    """A gloo group of this process alone, outside torch.distributed's default group (a tuning run
    launched with torchrun has one of its own): the all-reduces torch's hook issues are then exact
    copies, and what the hook does to the gradient is all that changes the run.

    One for the process, never dropped: the hook's future callbacks hold the group, and a group whose
    last reference went with a callback was destroyed on its own gloo worker thread, which then
    joined itself (``std::system_error: Resource deadlock avoided``, the process aborted; seen in
    about one tuning run in three)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=300))


@preserved_rng()
def powersgd_curve(wl: Workload, rank: int, steps: int, seed: int,
                   start: int | None = None) -> tuple[list[float], float | None, float]:
    """:func:`train_curve` with torch's own PowerSGD hook (``PowerSGDState`` with its defaults but
    ``matrix_approximation_rank=rank`` and ``start_powerSGD_iter=start``, default
    :func:`~fastml_strategy.autotune.costmodel.powersgd.calibration_start_iter`) applied to each
    step's gradient on a one-rank group: the single-rank simulation the plans' calibration runs
    are (each rank's gradient compressed once), with torch's code doing the compressing, error
    feedback and warm start. Returns the loss curve, the eval metric and the median seconds of one
    compressing call of the hook (its compute: the cost model's ``codec_s``)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    from fastml_strategy.autotune.costmodel.powersgd import calibration_start_iter

    hook_s: list[float] = []

    def prepare(model: torch.nn.Module) -> Callable[[], None]:
        bucket = _OneBucket([p for p in model.parameters() if p.requires_grad])
        state = PowerSGDState(process_group=_one_rank_group(), matrix_approximation_rank=rank,
                              start_powerSGD_iter=calibration_start_iter(steps) if start is None else start)

        def compress() -> None:
            bucket.fill()
            compressing = state.iter >= state.start_powerSGD_iter
            t0 = time.perf_counter()
            out = powerSGD_hook(state, bucket).wait()
            if compressing:
                hook_s.append(time.perf_counter() - t0)
            bucket.give_back(out[0] if isinstance(out, (list, tuple)) else out)

        return compress

    losses, metric = _train(wl, steps, seed, prepare)
    return losses, metric, float(np.median(hook_s)) if hook_s else 0.0


def _metric(wl: Workload, model: torch.nn.Module) -> float | None:
    if wl.eval_fn is None:
        return None
    model.eval()
    with torch.no_grad():
        m = wl.eval_fn(model)
    return None if m is None else float(m)


@preserved_rng()
def local_curve(wl: Workload, world_size: int, every: int, steps: int, seed: int,
                min_numel: int = 0, option: str = LOCAL_CALIBRATION_OPTION, outer: str = _LOCAL.outer,
                outer_lr: float = _LOCAL.outer_lr,
                outer_momentum: float = _LOCAL.outer_momentum) -> tuple[list[float], float | None]:
    """The loss curve (mean over replicas) and final metric of LocalSGD simulated in one process:
    ``world_size`` replicas, a synchronisation every ``every`` steps and after the last one, the
    pseudo-gradients compressed with ``option`` (tensors under ``min_numel`` exact). ``every=0`` is
    the per-step reference: one model, the mean gradient of ``world_size`` batches per step."""
    wl = build_run(wl, seed)
    stream = seeded_stream(wl, seed)
    W = max(1, world_size)
    if every == 0:
        return _per_step_curve(wl, stream, W, steps)
    base = wl.fresh_model()
    replicas = [copy.deepcopy(base) for _ in range(W)]
    for m in replicas:
        m.train()
    opts = [wl.make_optimizer(m) for m in replicas]
    named = [[(n, p) for n, p in m.named_parameters() if p.requires_grad] for m in replicas]
    shared = [p.detach().to(torch.float32, copy=True).requires_grad_(True) for _, p in named[0]]
    outer_opt = torch.optim.SGD(shared, lr=outer_lr, momentum=outer_momentum,
                                nesterov=outer == "nesterov")
    cfg = CANDIDATES[option]
    residuals: dict[tuple[int, int], torch.Tensor] = {}
    losses: list[float] = []
    for t in range(steps):
        total = 0.0
        for m, opt in zip(replicas, opts):
            opt.zero_grad(set_to_none=True)
            loss = wl.loss_fn(m, next(stream))
            loss.backward()
            opt.step()
            total += float(loss.detach())
        losses.append(total / W if math.isfinite(total) else math.inf)
        if (t + 1) % every == 0 or t + 1 == steps:
            _outer_step(shared, named, outer_opt, cfg, residuals, min_numel)
    return losses, _metric(wl, replicas[0])


def _per_step_curve(wl: Workload, stream: Iterator[Any], W: int, steps: int) -> tuple[list[float], float | None]:
    """Local steps' reference: one model, each step the mean gradient of ``W`` batches (what DDP
    computes)."""
    model = wl.fresh_model()
    model.train()
    opt = wl.make_optimizer(model)
    losses: list[float] = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for _ in range(W):
            loss = wl.loss_fn(model, next(stream))
            (loss / W).backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total / W if math.isfinite(total) else math.inf)
    return losses, _metric(wl, model)


def _outer_step(shared: list[torch.Tensor], named: list[list[tuple[str, torch.nn.Parameter]]],
                outer_opt: torch.optim.Optimizer, cfg: Any, residuals: dict[tuple[int, int], torch.Tensor],
                min_numel: int) -> None:
    """One synchronisation: each replica's pseudo-gradient (shared - local) compressed with ``cfg``
    (error feedback per replica), averaged, the outer optimizer's step, and every replica takes the
    shared parameters."""
    from fastml_strategy.codecs import roundtrip

    W = len(named)
    with torch.no_grad():
        for j, a in enumerate(shared):
            mean = torch.zeros_like(a)
            for i in range(W):
                delta = a - named[i][j][1].detach().to(torch.float32)
                if cfg.lossy and delta.numel() >= min_numel:
                    x = delta + residuals[(i, j)] if (i, j) in residuals else delta
                    dec, _ = roundtrip(x, cfg)
                    if cfg.uses_residual:
                        residuals[(i, j)] = x - dec
                    delta = dec
                mean += delta
            a.grad = mean / W
        outer_opt.step()
        outer_opt.zero_grad(set_to_none=True)
        for i in range(W):
            for j, (_, p) in enumerate(named[i]):
                p.copy_(shared[j].to(p.dtype))


def local_calibration_steps(calibration_steps: int, every: Sequence[int]) -> int:
    """Length of each local-steps calibration run: the plans' length, or 4 syncs of the largest H."""
    return max(calibration_steps, 4 * max(every, default=1))


def run_local_calibration(wl: Workload, profile: Profile, every: Sequence[int], *, world_size: int,
                          steps: int, seed: int, max_accuracy_loss: float, storage: Any = None,
                          study_name: str | None = None, progress: Any = None) -> LocalCalibration:
    """Run (or read back from the storage) the per-step reference and one LocalSGD run per H, and
    return the measured stretch and accuracy loss of each H (module docstring)."""
    study = None
    if storage is not None and study_name is not None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(storage=storage, study_name=study_name, direction="minimize",
                                    load_if_exists=True)

    def run(key: str, h: int) -> dict[str, Any]:
        got = study.user_attrs.get(key) if study is not None else None
        if got is None:
            losses, metric = local_curve(wl, world_size, h, steps, seed, min_numel=profile.min_numel)
            got = {"losses": losses, "metric": metric}
            if study is not None:
                study.set_user_attr(key, got)
        if progress is not None:
            progress.update(1)
        return got

    ref = run("local-reference", 0)
    ratios, acc, cens = {}, {}, {}
    for h in sorted(set(every)):
        r = run(f"local-H{h}", h)
        st = stretch(ref["losses"], r["losses"])
        ratios[h] = max(1.0, st.ratio)
        acc[h] = accuracy_within_noise(ref, r["losses"], r["metric"], st,
                                       end_slope([ref["losses"]]))["accuracy_loss"]
        cens[h] = st.censored
    e_cal = plan_error(profile, {lp.name: LOCAL_CALIBRATION_OPTION for lp in profile.layers
                                 if lp.tunable and LOCAL_CALIBRATION_OPTION in lp.rel_error})
    return LocalCalibration(stretch=ratios, accuracy_loss=acc, censored=cens, e_cal=e_cal,
                            max_accuracy_loss=max_accuracy_loss, steps=steps, world_size=world_size)


def smooth(losses: Sequence[float], span: int | None = None) -> np.ndarray:
    """Exponential moving average (span ~ a tenth of the run, at least 5), then a running minimum."""
    x = np.asarray(losses, dtype=float)
    x = np.where(np.isfinite(x), x, np.nanmax(np.where(np.isfinite(x), x, np.nan)) * 10
                 if np.isfinite(x).any() else 1e30)
    span = span or _span(len(x))
    alpha = 2.0 / (span + 1)
    out = np.empty_like(x)
    acc = x[0]
    for i, v in enumerate(x):
        acc = alpha * v + (1 - alpha) * acc
        out[i] = acc
    return np.minimum.accumulate(out)


def _span(n: int) -> int:
    return max(5, n // 10)


# The stretch (steps_ratio) is measured at the reference's smoothed loss at these fractions of the run,
# at every level where the reference still descends (a level's horizontal uncertainty is the noise
# over the reference's slope there, so flattened levels weigh little or are left out).
LEVEL_FRACTIONS = tuple(float(f) for f in np.round(np.linspace(0.2, 0.9, 15), 3))
# Two-sided 95% normal quantile of the stretch intervals; widened to Student's t for the degrees of
# freedom the noise was estimated with (:func:`t_quantile`). Checked on synthetic curves (white noise,
# 60-200 steps, one pair of references, 100 draws each): with t, 92-97% of the intervals of an equal
# curve held 1 and 84-98% of those of a 1.5x slower one held 1.5 (the running minimum biases a
# flatter curve ~1% fast); with the normal quantile 87-90% and 79-97%.
INTERVAL_Z = 1.96
# A level whose log-ratio is uncertain by more than this (a factor e) says nothing: left out.
MAX_LEVEL_SE = 1.0
# Floor of a level's standard error (log units): noise-free synthetic curves stay well conditioned.
MIN_LEVEL_SE = 1e-3
# The grid the interval is read from: log-ratios from 1/8 to 32.
_LOG_GRID = np.linspace(math.log(1 / 8), math.log(32.0), 4001)


@dataclass(frozen=True)
class Stretch:
    """How many times the reference's steps a run needs to reach the reference's losses, with its
    uncertainty (:func:`stretch`).

    ``ratio`` is the estimate and ``lo``/``hi`` its ~95% interval (``hi`` infinite when the run
    reached none of the levels: then ``ratio`` is a lower bound, ``censored``). ``se`` is the standard
    error of ``log(ratio)``; ``levels`` the levels measured (where the reference still descends) and
    ``reached`` how many of them the run reached; ``sigma`` the noise of a smoothed loss difference
    that the interval rests on."""

    ratio: float
    lo: float
    hi: float
    se: float
    censored: bool
    levels: int
    reached: int
    sigma: float

    def contains(self, x: float = 1.0) -> bool:
        """Whether ``x`` lies in the interval (``1``: the run is within noise of the reference)."""
        return self.lo <= x <= self.hi

    def interval_words(self) -> str:
        """'1.02x (0.95-1.10)' or 'at least 1.8x'."""
        if self.levels == 0:
            return "unknown (the reference never descended beyond noise)"
        if self.censored:
            return f"at least {self.ratio:.3g}x"
        hi = "inf" if not math.isfinite(self.hi) else f"{self.hi:.3g}"
        return f"{self.ratio:.3g}x ({self.lo:.3g}-{hi})"

    def words(self) -> str:
        """One sentence a user can check against the curves."""
        if self.levels == 0:
            return ("stretch unknown: the reference's smoothed loss never fell by more than the noise "
                    f"({self.sigma:.3g}) over a smoothing window; lengthen --calibration-steps")
        where = (f"at {self.levels} loss levels where the reference still descends ({self.reached} "
                 f"reached by this run)")
        if self.censored:
            return (f"reached none of the reference's levels {where.split(' (')[0][3:]}: it needs at "
                    f"least {self.ratio:.3g}x the steps (a lower bound, the 95% lower end)")
        verdict = ("within noise of the reference (the interval contains 1)" if self.contains(1.0) else
                   "slower than the reference beyond noise" if self.lo > 1.0 else
                   "faster than the reference beyond noise")
        return f"{self.interval_words()} of the reference's steps, {where}: {verdict}"

    def verdict(self) -> str:
        """What the interval says, without the figures: 'within noise of the reference (its interval
        contains 1); 15 levels, 15 reached'."""
        if self.levels == 0:
            return "unknown: the reference never descended beyond noise"
        if self.censored:
            return f"a lower bound: none of the {self.levels} levels reached"
        v = ("within noise of the reference (its interval contains 1)" if self.contains(1.0) else
             "slower than the reference beyond noise" if self.lo > 1.0 else
             "faster than the reference beyond noise")
        return f"{v}; {self.levels} levels, {self.reached} reached"

    def to_point(self) -> dict[str, Any]:
        """The fields a calibration point stores (``ratio``, its interval and standard error, ...)."""
        return {"ratio": self.ratio, "ratio_lo": self.lo, "ratio_hi": self.hi, "ratio_se": self.se,
                "censored": self.censored, "levels": self.levels, "levels_reached": self.reached}


def _crossing(x: np.ndarray, level: float) -> float | None:
    """The (1-based, linearly interpolated) step at which the monotone curve ``x`` first reaches
    ``level``; None if it never does."""
    hit = np.nonzero(x <= level)[0]
    if not hit.size:
        return None
    i = int(hit[0])
    if i == 0:
        return 1.0
    drop = x[i - 1] - x[i]
    return float(i + ((x[i - 1] - level) / drop if drop > 0 else 1.0))


def step_noise(*curves: Sequence[float]) -> float:
    """Noise of the difference of the smoothed ``curves`` (two of them: a candidate and its
    reference), from their step-to-step scatter alone: each curve's per-step noise (median absolute
    deviation of consecutive differences) shrunk by the moving average. It misses slow, seed-wide
    differences (another data order): a floor, used when no second reference or repeat measured more."""
    var = 0.0
    for c in curves:
        x = np.asarray(c, dtype=float)
        x = x[np.isfinite(x)]
        if len(x) < 3:
            continue
        d = np.diff(x)
        s = 1.4826 * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2.0)
        alpha = 2.0 / (_span(len(x)) + 1)
        var += s * s * alpha / (2.0 - alpha)
    return math.sqrt(var)


def window_rms(diff: np.ndarray) -> float:
    """Root mean square of a smoothed difference over the part of the run the levels are taken in
    (from the first level's fraction of it on)."""
    n = len(diff)
    d = diff[int(LEVEL_FRACTIONS[0] * n):]
    d = d[np.isfinite(d)]
    return float(np.sqrt(np.mean(d * d))) if d.size else math.nan


def smoothed_difference(a: Sequence[float], b: Sequence[float]) -> np.ndarray:
    """``smooth(a) - smooth(b)`` over their common length (the span of ``b``'s length)."""
    n = min(len(a), len(b))
    span = _span(len(b))
    return smooth(list(a)[:n], span) - smooth(list(b)[:n], span)


class Noise(NamedTuple):
    """The noise of a smoothed loss difference between two runs that differ only by chance
    (:func:`stretch_noise`), the degrees of freedom it was estimated with, and where it came from."""

    sigma: float
    dof: float
    source: str


def t_quantile(dof: float, z: float = INTERVAL_Z) -> float:
    """Student's t quantile matching the normal ``z`` (Cornish-Fisher, two terms: 2.26 for 8 degrees
    of freedom against the exact 2.31; ``z`` itself for infinitely many)."""
    if not math.isfinite(dof) or dof <= 0:
        return z if not dof <= 0 else 4.0 * z
    return z + (z ** 3 + z) / (4 * dof) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * dof ** 2)


def stretch(ref: Sequence[float], cand: Sequence[float], sigma: "Noise | float | None" = None,
            fractions: Sequence[float] = LEVEL_FRACTIONS) -> Stretch:
    """The steps ``cand`` needs to reach ``ref``'s losses over the steps ``ref`` needs, with a ~95%
    interval that noise cannot inflate (module docstring, step 3).

    ``sigma``: the noise of a smoothed loss difference between two runs that differ only by chance
    (a :class:`Noise` from :func:`stretch_noise`, or a number: known exactly; None: :func:`step_noise`
    of these two curves, a floor).

    1. Both curves are smoothed (:func:`smooth`); crossing steps are interpolated between steps and
       corrected by the moving average's lag (the same for both curves).
    2. At each level (the reference's loss at ``fractions`` of its run) the log-ratio of the crossing
       steps gets a standard error ``sigma / |d ref / d log t|``: a vertical noise of ``sigma``
       moves the crossing by ``sigma`` over the reference's slope. Where the reference has flattened
       this is large: a level uncertain by more than :data:`MAX_LEVEL_SE` is left out, the others
       are weighted by ``1 / se^2``.
    3. A level the candidate never reaches is a lower bound (its log-ratio is at least that of the
       run's end), entering as a one-sided constraint: it pulls the estimate up to its bound, never
       above.
    4. The estimate minimises ``Q(mu) = sum w (x - mu)^2 + sum_bounds w max(0, b - mu)^2`` over the
       log-ratio ``mu``; the interval is where ``Q`` is within ``t^2`` of its minimum (``t``: the
       95% quantile for the noise's degrees of freedom, :func:`t_quantile`), with
       ``Q`` scaled by the number of independent levels over the number used (levels closer than a
       smoothing window share their noise). With no level reached the ratio is the interval's lower
       end (a bound) and ``hi`` is infinite.
    """
    span = _span(len(ref))
    lag = (span - 1) / 2
    r = smooth(ref, span)
    c = smooth(cand, span)
    n = len(r)
    if isinstance(sigma, Noise):
        sigma, dof = sigma.sigma, sigma.dof
    else:
        dof = math.inf
    if sigma is None or not math.isfinite(sigma):
        sigma, dof = step_noise(ref, cand), max(1.0, n / span)
    sigma = max(float(sigma), 0.0)
    z = t_quantile(dof)
    h = max(1, span // 2)
    xs, xw, bs, bw, ts = [], [], [], [], []
    for f in fractions:
        level = r[max(0, int(round(f * n)) - 1)]
        t_ref = _crossing(r, level)
        if t_ref is None or t_ref - lag < 1.0:
            continue
        i = min(n - 1, max(0, int(math.ceil(t_ref)) - 1))
        a_, b_ = max(0, i - h), min(n - 1, i + h)
        slope = (r[a_] - r[b_]) / max(1, b_ - a_)
        t0 = t_ref - lag
        se = sigma / (slope * t0) if slope > 0 else math.inf
        if not se <= MAX_LEVEL_SE:
            continue
        w = 1.0 / max(se, MIN_LEVEL_SE) ** 2
        ts.append(t0)
        t_c = _crossing(c, level)
        if t_c is not None:
            xs.append(math.log(max(1.0, t_c - lag) / t0))
            xw.append(w)
        else:
            bs.append(math.log(max(1.0, len(c) - lag) / t0))
            bw.append(w)
    used = len(ts)
    if not used:
        return Stretch(1.0, 0.0, math.inf, math.inf, False, 0, 0, sigma)
    x, wx, b, wb = (np.asarray(v, dtype=float) for v in (xs, xw, bs, bw))
    scale = min(1.0, ((max(ts) - min(ts)) / span + 1.0) / used)
    g = _LOG_GRID
    q = scale * (((g[:, None] - x[None, :]) ** 2 * wx).sum(1)
                 + (np.maximum(0.0, b[None, :] - g[:, None]) ** 2 * wb).sum(1))
    inside = np.nonzero(q <= q.min() + z ** 2)[0]
    lo, hi = float(g[inside[0]]), float(g[inside[-1]]) if inside[-1] < len(g) - 1 else math.inf
    if not xs:  # no level reached: only a bound, its 95% lower end
        return Stretch(math.exp(lo), math.exp(lo), math.inf, math.inf, True, used, 0, sigma)
    mu = _hinge_minimum(x, wx, b, wb)
    lo = min(lo, mu)
    se = (hi - lo) / (2 * z) if math.isfinite(hi) else (mu - lo) / z
    return Stretch(math.exp(mu), math.exp(lo), math.exp(hi) if math.isfinite(hi) else math.inf,
                   float(se), False, used, len(xs), sigma)


def _hinge_minimum(x: np.ndarray, wx: np.ndarray, b: np.ndarray, wb: np.ndarray) -> float:
    """The exact minimiser of ``sum wx (x - mu)^2 + sum wb max(0, b - mu)^2`` (``x`` not empty): the
    weighted mean of the values and of the bounds above it (active set, raised until stable)."""
    active = np.zeros(len(b), dtype=bool)
    for _ in range(len(b) + 1):
        mu = float((np.dot(wx, x) + np.dot(wb[active], b[active])) / (wx.sum() + wb[active].sum()))
        now = b > mu
        if (now == active).all():
            return mu
        active = active | now
    return mu


def steps_ratio(ref: Sequence[float], cand: Sequence[float],
                fractions: Sequence[float] = LEVEL_FRACTIONS, sigma: float | None = None) -> tuple[float, bool]:
    """(steps the candidate needs / steps the reference needs, censored?): :func:`stretch`'s estimate
    and whether it is only a lower bound (the candidate reached none of the reference's levels)."""
    st = stretch(ref, cand, sigma, fractions)
    return st.ratio, st.censored


def stretch_noise(refs: Mapping[int, Mapping[str, Any]], repeats: Sequence[Sequence[tuple[Any, Any]]] = (),
                  paired: bool | None = None) -> Noise:
    """Noise of a smoothed loss difference between a run and its reference when only chance
    separates them, with its degrees of freedom and where it came from.

    - The references (one per seed): two runs that differ only by their seed. Their smoothed
      difference's RMS over the measured window is the noise of an unpaired comparison.
    - The repeats (``repeats``: per plan run with several seeds, its ``(losses, reference losses)``
      pairs): the plan's difference from its reference changes between seeds only by chance; the RMS
      of the change over ``sqrt(2)`` is the noise of one (paired) comparison.

    Each difference counts (window length / smoothing span) degrees of freedom (its independent
    stretches). The larger of the two is used, paired runs too (``paired`` only words the source):
    what the cost model needs is the stretch in the user's own training, another seed and data
    order, so a plan whose curve lies within the references' band must get a stretch consistent
    with 1 even where paired runs could resolve a smaller, seed-specific difference (on the tests'
    tiny MLP, paired repeats alone gave fp16 "1.01x, beyond noise"). Neither: sigma nan (each
    :func:`stretch` then uses :func:`step_noise`, a floor)."""
    def dof(d: np.ndarray) -> float:
        return max(1.0, (1 - LEVEL_FRACTIONS[0]) * len(d) / _span(len(d)))

    curves = [v["losses"] for _, v in sorted(refs.items()) if v.get("losses")]
    ref_sq: list[tuple[float, float]] = []
    for a, b in zip(curves, curves[1:]):
        d = smoothed_difference(a, b)
        ref_sq.append((window_rms(d) ** 2, dof(d)))
    rep_sq: list[tuple[float, float]] = []
    for runs in repeats:
        diffs = [smoothed_difference(c, r) for c, r in runs]
        for d0, d1 in zip(diffs, diffs[1:]):
            m = min(len(d0), len(d1))
            rep_sq.append((window_rms(d0[:m] - d1[:m]) ** 2 / 2.0, dof(d0[:m])))

    def pooled(v: list[tuple[float, float]], words: str) -> Noise:
        v = [(s, k) for s, k in v if math.isfinite(s)]
        if not v:
            return Noise(math.nan, 0.0, words)
        return Noise(math.sqrt(sum(s * k for s, k in v) / sum(k for _, k in v)), sum(k for _, k in v), words)

    n_ref = pooled(ref_sq, f"the band of {len(curves)} reference runs of different seeds")
    n_rep = pooled(rep_sq, f"{len(rep_sq)} repeat(s) of a plan with another seed"
                   + (", paired" if paired else ""))
    known = [x for x in (n_ref, n_rep) if math.isfinite(x.sigma)]
    if not known:
        return Noise(math.nan, 0.0, "each run's step-to-step scatter (no second reference or repeat)")
    return max(known, key=lambda x: x.sigma)


def time_to_same_loss(tuned: Sequence[float], other: Sequence[float], noise: "Noise | float | None",
                      tuned_step_s: float, other_step_s: float) -> dict[str, Any]:
    """Whether ``other`` reaches the losses of ``tuned`` sooner in wall time: both trained side by
    side (same seed: the same weights and, when paired, the same batches), ``other``'s
    :func:`stretch` against ``tuned`` (steps ``other`` needs for ``tuned``'s losses over the steps
    ``tuned`` needs) times the ratio of their step times. Returns the stretch's point fields,
    ``time_ratio`` (< 1: ``other`` is sooner) with its interval ``time_lo``/``time_hi``, ``sooner``
    (the estimate says so and ``other`` reached the levels, not just a bound) and ``words``."""
    st = stretch(tuned, other, noise)
    f = other_step_s / tuned_step_s if tuned_step_s > 0 else math.inf
    out = dict(st.to_point(), time_ratio=st.ratio * f, time_lo=st.lo * f, time_hi=st.hi * f,
               step_ratio=f, sooner=bool(not st.censored and st.levels > 0 and st.ratio * f < 1.0))
    out["words"] = (f"it needed {st.interval_words()} the tuned plan's steps to reach the tuned plan's "
                    f"losses ({st.words().split(': ')[-1].replace('reference', 'tuned plan')}), at "
                    f"{f:.3g}x its step time: {out['time_ratio']:.3g}x the time"
                    + ("" if st.censored or not math.isfinite(out["time_hi"]) else
                       f" (95% interval {out['time_lo']:.3g}-{out['time_hi']:.3g})"))
    return out


def lag_ratio(ref_smoothed: np.ndarray, cand: Sequence[float]) -> float:
    """How many times behind the reference the candidate is now (1 = on par; inf = above the
    reference's starting loss)."""
    c = smooth(cand, span=_span(len(ref_smoothed)))
    now = c[-1]
    hit = np.nonzero(ref_smoothed <= now)[0]
    if not hit.size:
        return 1.0  # better than anything the reference reached: not behind
    ref_step = int(hit[0]) + 1
    return len(cand) / ref_step


def calibration_candidates(profile: Profile, groups: Mapping[str, list[str]], n: int,
                           seed: int) -> list[dict[str, str]]:
    """Group-level choices (group -> option) for the calibration trials: uniform options spread over
    the error range first (log-spaced), then random mixes."""
    lossy = [o for o in profile.options if o != "none"]
    uniform = sorted(lossy, key=lambda o: plan_error(profile, {
        n_: o for names in groups.values() for n_ in names}))
    errs = [plan_error(profile, {n_: o for names in groups.values() for n_ in names}) for o in uniform]
    uniform = [o for o, e in zip(uniform, errs) if e > 0]
    picked: list[str] = []
    k = min(n, len(uniform))
    if k:
        idx = np.unique(np.round(np.linspace(0, len(uniform) - 1, k)).astype(int))
        picked = [uniform[i] for i in idx]
    out = [{g: o for g in groups} for o in picked]
    rng = random.Random(seed)
    while len(out) < n:
        out.append({g: rng.choice(profile.options) for g in groups})
    return out


def run_calibration(
    wl: Workload,
    profile: Profile,
    groups: Mapping[str, list[str]],
    plans: Sequence[Mapping[str, str] | tuple[Mapping[str, str], int]],
    *,
    storage: Any,
    study_name: str,
    steps: int,
    seed: int,
    prune_ratio: float = 3.0,
    progress: Any = None,
    references: int = 2,
    deadline: float | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Make sure every plan in ``plans`` (group -> option, or ``(choice, seed)`` for a repeat with
    another seed; plain choices run with ``seed``) has a finished calibration trial in the study
    (running only the missing ones, so a stopped run resumes), and return the reference run and one
    point per finished trial.

    Reference runs: one per seed a trial uses, and at least ``references`` (seeds ``seed``,
    ``seed + 1``, ...): their spread is the noise of one run. Every trial is compared with the
    reference of its own seed (paired when the workload replays its batches, :func:`runs_paired`).
    The returned reference dict adds ``references`` (seed -> run), ``paired`` and ``sigma``
    (:func:`reference_sigma`) and ``noise`` (:func:`stretch_noise`: the noise every run's stretch
    interval rests on, from the references and the repeats). ``deadline`` (a ``time.time()``): trials
    not started by then are skipped (the search uses what was measured)."""
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        storage=storage, study_name=study_name, direction="minimize", load_if_exists=True,
        sampler=optuna.samplers.RandomSampler(seed=seed),
        pruner=optuna.pruners.ThresholdPruner(upper=prune_ratio, n_warmup_steps=max(1, steps // 4)),
    )
    items = [(dict(p[0]), int(p[1])) if isinstance(p, tuple) else (dict(p), seed) for p in plans]
    seeds = sorted({seed + i for i in range(max(1, references))} | {s_ for _, s_ in items})
    refs = _reference_runs(wl, study, seeds, seed, steps, deadline)
    paired = study.user_attrs.get("paired")
    if paired is None:
        paired = runs_paired(wl, seed)
        study.set_user_attr("paired", paired)
    noise0 = stretch_noise(refs, paired=paired)  # the trials' own values: the references' noise
    if progress is not None:
        progress.update(1)
    ref = dict(refs[seed])
    keys = {g: f"g{i}" for i, g in enumerate(groups)}  # group -> its parameter in the study
    todo = _trials_to_run(study, items, keys, seed, refs, progress)
    if todo:
        for params in todo:
            study.enqueue_trial(params, skip_if_exists=True)
        # (enqueued trials the deadline left unrun stay waiting: a resumed run takes them first)
        study.optimize(_calibration_objective(wl, profile, groups, keys, refs, seed, steps, noise0),
                       n_trials=len(todo), callbacks=[_tick_until(deadline, progress)])
    points = _calibration_points(study, keys, seed)
    noise = stretch_noise(refs, _repeat_curves(points, refs), paired=paired)
    slope = end_slope([v["losses"] for v in refs.values() if v.get("losses")])
    for p in points:  # every stretch again, with the noise of the references and the repeats
        if p.get("losses") and int(p["seed"]) in refs:
            r_ = refs[int(p["seed"])]
            st = stretch(r_["losses"], p["losses"], noise)
            acc = accuracy_within_noise(r_, p["losses"], p.get("metric"), st, slope)
            p.update(st.to_point(), stretch_sigma=noise.sigma, stretch_noise=noise.source, **acc)
    ref["references"] = refs
    ref["paired"] = bool(paired)
    ref["sigma"] = reference_sigma(list(refs.values()))
    ref["noise"] = noise
    return ref, points


def _repeat_curves(points: Sequence[Mapping[str, Any]],
                   refs: Mapping[int, Mapping[str, Any]]) -> list[list[tuple[Any, Any]]]:
    """Per plan run with several seeds: its ``(losses, its seed's reference losses)`` pairs."""
    by: dict[str, list[tuple[Any, Any]]] = {}
    for p in points:
        s_ = int(p.get("seed", -1))
        if p.get("losses") and not p.get("pruned") and s_ in refs:
            by.setdefault(json_key(p["choice"]), []).append((p["losses"], refs[s_]["losses"]))
    return [v for v in by.values() if len(v) > 1]


def _reference_runs(wl: Workload, study: Any, seeds: Sequence[int], seed: int, steps: int,
                    deadline: float | None) -> dict[int, dict[str, Any]]:
    """Seed -> uncompressed run (losses, metric), read back from the study or run and stored there;
    past ``deadline`` the missing runs of other seeds than ``seed`` are left out."""
    import time

    refs: dict[int, dict[str, Any]] = {}
    for s_ in seeds:
        key = "reference" if s_ == seed else f"reference-seed{s_}"
        got = study.user_attrs.get(key)
        if got is None:
            if s_ != seed and deadline is not None and time.time() > deadline:
                continue
            losses, metric = train_curve(wl, None, steps, s_)
            got = {"losses": losses, "metric": metric}
            study.set_user_attr(key, got)
        refs[s_] = got
    return refs


def _params_key(params: Mapping[str, Any], seed: int) -> tuple:
    """A trial's parameters as a comparable key (trials stored before seeds were a parameter ran
    with ``seed``)."""
    return tuple(sorted({"seed": seed, **params}.items()))


def _trials_to_run(study: Any, items: list[tuple[dict[str, str], int]], keys: Mapping[str, str], seed: int,
                   refs: Mapping[int, Any], progress: Any) -> list[dict[str, Any]]:
    """The study parameters of each plan not yet finished in the study (each once) whose seed has a
    reference run; a plan already done (or without its reference) ticks the progress bar."""
    import optuna

    finished_states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    done = {_params_key(t.params, seed) for t in study.trials if t.state in finished_states}
    todo: list[dict[str, Any]] = []
    for p, s_ in items:
        params = {**{keys[g]: p[g] for g in keys}, "seed": s_}
        k = _params_key(params, seed)
        if k in done or s_ not in refs:
            if progress is not None:
                progress.update(1)
            continue
        done.add(k)
        todo.append(params)
    return todo


def _calibration_objective(wl: Workload, profile: Profile, groups: Mapping[str, list[str]],
                           keys: Mapping[str, str], refs: Mapping[int, Mapping[str, Any]], seed: int,
                           steps: int, noise: Noise | None = None) -> Callable[[Any], float]:
    """The study's objective: train the trial's plan with its seed and return the stretch against
    that seed's reference (:func:`stretch` with the references' ``noise``; :func:`run_calibration`
    measures it again once the repeats are in), reporting the lag as it trains so that hopeless
    plans are pruned. The loss curve is kept on the trial."""
    import optuna

    top = seed + 10_000  # one distribution for every trial of the study

    def objective(trial: optuna.Trial) -> float:
        gchoice = {g: trial.suggest_categorical(keys[g], profile.options) for g in keys}
        s_ = trial.suggest_int("seed", seed, top)
        r = refs[s_]
        r_s = smooth(r["losses"])
        choice = {n: o for g, o in gchoice.items() for n in groups[g]}
        e = plan_error(profile, choice)
        trial.set_user_attr("error", e)

        def report(step: int, losses: list[float]) -> None:
            lag = lag_ratio(r_s, losses)
            trial.report(lag if math.isfinite(lag) else 1e9, step)
            if trial.should_prune():
                trial.set_user_attr("pruned_at", step)
                raise optuna.TrialPruned()

        losses, metric = train_curve(wl, choice, steps, s_, report=report, report_every=max(1, steps // 10))
        st = stretch(r["losses"], losses, noise)
        trial.set_user_attr("censored", st.censored)
        trial.set_user_attr("losses", [float(v) if math.isfinite(v) else None for v in losses])
        trial.set_user_attr("metric", metric)
        trial.set_user_attr("accuracy_loss", _accuracy_loss(r, losses, metric))
        return st.ratio

    return objective


def _tick_until(deadline: float | None, progress: Any) -> Callable[[Any, Any], None]:
    """The study's callback after each trial: tick the progress bar, and stop the study when a run as
    long as the last one would end past ``deadline``."""
    import time

    def tick(study: Any, trial: Any) -> None:
        if progress is not None:
            progress.update(1)
        took = ((trial.datetime_complete - trial.datetime_start).total_seconds()
                if trial.datetime_complete and trial.datetime_start else 0.0)
        if deadline is not None and time.time() + took > deadline:
            study.stop()  # the next run would end past the deadline: the search uses what was measured

    return tick


def _calibration_points(study: Any, keys: Mapping[str, str], seed: int) -> list[dict[str, Any]]:
    """One point per finished trial: its error, stretch (``ratio``), accuracy loss, choice, seed and
    loss curve (``losses``; None for trials stored before curves were kept: their stretch has no
    interval); a pruned trial: its last lag as a lower bound, failing the accuracy limit."""
    import optuna

    points = []
    for t in study.trials:
        choice = {g: t.params[keys[g]] for g in keys if keys[g] in t.params}
        s_ = int(t.params.get("seed", seed))
        if t.state is optuna.trial.TrialState.COMPLETE:
            losses = t.user_attrs.get("losses")
            points.append({"trial": t.number, "error": t.user_attrs["error"], "ratio": t.value,
                           "ratio_lo": math.nan, "ratio_hi": math.nan, "ratio_se": math.nan,
                           "censored": t.user_attrs["censored"], "pruned": False,
                           "accuracy_loss": t.user_attrs["accuracy_loss"],
                           "metric": t.user_attrs.get("metric"), "choice": choice, "seed": s_,
                           "losses": None if losses is None else
                           [math.inf if v is None else float(v) for v in losses]})
        elif t.state is optuna.trial.TrialState.PRUNED:
            last = t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else math.inf
            points.append({"trial": t.number, "error": t.user_attrs.get("error", math.inf),
                           "ratio": float(last), "ratio_lo": float(last), "ratio_hi": math.inf,
                           "ratio_se": math.nan, "censored": True, "pruned": True,
                           "accuracy_loss": math.inf, "metric": None, "choice": choice, "seed": s_})
    return points


def _accuracy_loss(ref: Mapping[str, Any], losses: Sequence[float], metric: float | None) -> float:
    """Reference metric minus the run's, or without an eval function the relative increase of the
    final loss averaged over the last :func:`window` steps (one step's loss is mostly batch noise)."""
    if ref.get("metric") is not None and metric is not None:
        return float(ref["metric"]) - float(metric)
    r = final_loss(ref["losses"])
    c = final_loss(losses)
    if not math.isfinite(c):
        return math.inf
    return float((c - r) / abs(r)) if r != 0 else float(c - r)


def end_slope(curves: Sequence[Sequence[float]]) -> float:
    """How steeply the references still descend over the last :func:`window` of their runs: the
    drop of the smoothed loss per unit of log-step (``-d loss / d log t``, >= 0), the mean over
    ``curves``. A horizontal offset of ``log s`` (a run ``s`` times slower or faster) moves the final
    loss by about this times ``log s``."""
    out = []
    for c in curves:
        n = len(c)
        w = window(n)
        if n < w + 2:
            continue
        r = smooth(c)
        lag = (_span(n) - 1) / 2
        a, b = n - w - 1, n - 1  # 0-based: the step before the window, and the last
        t_a, t_b = a + 1 - lag, b + 1 - lag
        if t_a >= 1.0 and math.isfinite(r[a] - r[b]):
            out.append(max(0.0, float(r[a] - r[b])) / math.log(t_b / t_a))
    return float(np.mean(out)) if out else 0.0


def accuracy_within_noise(ref: Mapping[str, Any], losses: Sequence[float], metric: float | None,
                          st: Stretch | None, slope: float) -> dict[str, float]:
    """A run's accuracy loss for the accuracy rule: the part of its final-loss gap that a delay within
    its stretch interval does not explain (the delay is charged through the stretch already).

    Without an eval function the accuracy loss is the relative increase of the final windowed loss.
    Where the reference still descends steeply at the end of a short run, being a few percent of the
    steps behind is a large vertical gap: on the benchmark's second transformer uniform fp16 (error 0.0002,
    stretch 1.00 with interval 0.92-1.10) ended 2.3% above the reference, and the rule, limit 1%,
    excluded every compressed plan; on the first, uniform int2 (stretch 1.13, 1.10-1.15) ended 11%
    above and was excluded, though in training it reached the target at 1.16x the steps and the same
    loss: the delay was charged twice, as steps by ``g(e)`` and again as lost accuracy. So the run
    is shifted back by the delay within its ~95% stretch interval ``[lo, hi]`` (widened to include no
    delay, so that the shift only ever explains a gap) that best explains its gap (``slope x log s``
    over the final reference loss, ``slope``: :func:`end_slope`), and what is left is its accuracy
    loss: a curve that is the reference's delayed (within noise or beyond it: the
    delay is the stretch's to charge) loses nothing; a higher plateau keeps its gap, and where the
    reference has flattened the slope, and so the shift, is ~0. A censored run (no level reached: its
    delay is unknown) or a run with an eval metric (measured once, at the end) is not shifted.

    Returns ``accuracy_loss`` (what the rule uses), ``accuracy_loss_raw`` and ``accuracy_allowance``
    (what the shift explained, >= 0)."""
    raw = _accuracy_loss(ref, losses, metric)
    adj = raw
    by_metric = ref.get("metric") is not None and metric is not None
    r = final_loss(ref["losses"])
    if (st is not None and not by_metric and math.isfinite(raw) and not st.censored and st.levels > 0
            and st.lo > 0 and math.isfinite(st.hi) and slope > 0 and math.isfinite(r) and r != 0):
        per_log = slope / abs(r)  # relative final loss per unit of log-delay
        # the delays of its interval, and no delay: a run ahead of the reference beyond noise that ends
        # above it is not charged more than its gap (gpt2 seed 0: int2, 0.83x (0.76-0.90), ended 3.7%
        # above and would have been charged 11%)
        shift = min(max(raw / per_log, math.log(min(st.lo, 1.0))), math.log(max(st.hi, 1.0)))
        adj = raw - per_log * shift
    return {"accuracy_loss": adj, "accuracy_loss_raw": raw, "accuracy_allowance": abs(raw - adj)}


def reference_sigma(refs: Sequence[Mapping[str, Any]]) -> float:
    """Standard deviation of one reference run's outcome across seeds, in accuracy-loss units (metric
    points, or relative final loss); nan with fewer than two references."""
    if len(refs) < 2:
        return math.nan
    if all(r.get("metric") is not None for r in refs):
        v = np.array([float(r["metric"]) for r in refs])
    else:
        v = np.array([final_loss(r["losses"]) for r in refs])
        if not np.isfinite(v).all() or v.mean() == 0:
            return math.nan
        v = v / abs(v.mean())
    return float(v.std(ddof=1))


def repeat_candidates(rule: Any, points: Sequence[Mapping[str, Any]], n: int,
                      seed: int) -> list[tuple[dict[str, str], int]]:
    """The ``n`` plans whose fitted accuracy loss is nearest the limit (in band widths when the noise
    is known), each to be run again with a seed none of its runs used: ``(choice, seed)`` pairs."""
    if n <= 0 or not rule.errors:
        return []
    runs: dict[str, list[dict[str, Any]]] = {}
    for p in points:
        if p.get("choice") and any(o != "none" for o in p["choice"].values()):
            runs.setdefault(json_key(p["choice"]), []).append(p)

    def distance(ps: list[dict[str, Any]]) -> tuple[float, int, float]:
        f, b = rule.at(ps[0]["error"])
        d = abs(f - rule.limit) if math.isfinite(f) else math.inf
        scale = b if math.isfinite(b) and b > 0 else 1.0
        return (d / scale, len(ps), ps[0]["error"])

    out = []
    for ps in sorted(runs.values(), key=distance)[:n]:
        if not math.isfinite(distance(ps)[0]):
            continue
        used = {int(p.get("seed", seed)) for p in ps}
        s = seed + 1
        while s in used:
            s += 1
        out.append((dict(ps[0]["choice"]), s))
    return out



