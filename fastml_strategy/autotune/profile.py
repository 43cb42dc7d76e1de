"""Profiling: the measured inputs of the cost model.

1. Compute. A few real training steps of the workload, timing forward, backward and the optimizer, and
   (with post-accumulate-grad hooks) when each parameter's gradient is ready in the backward pass, which
   is what lets communication overlap backward. The driver runs it under :func:`rank_threads` with the
   threads one rank will have (``--threads-per-rank``; one process standing in for W ranks gets the
   cores / W by default), since two ranks on two cores each compute with one: timed with both, a
   2-rank step of benchmarks/gpt_workload.py's GPT was predicted at half its measured time.
2. Per-layer error and codec speed. On the same steps, every candidate codec option compresses every
   tunable layer's real gradient with ``fastml_strategy.codecs.roundtrip``, keeping one error-feedback
   residual per (layer, option) as the hook would, so the error measured at step t includes what error
   feedback carried over. The relative error of a layer is
   ``sqrt(sum_t |decoded_t - grad_t|^2 / sum_t |grad_t|^2)``; its time is the median round trip.
   The optimizer steps on the exact gradient, so the gradients seen are those of real training.
3. The link. When launched distributed, timed ``all_reduce`` (ring: ``2(W-1)`` rounds, ``2(W-1)/W`` of the
   size per rank) and ``all_gather`` (``W-1`` rounds and messages) at several sizes give
   ``(rounds, bytes, seconds)`` samples for the alpha-beta fit; otherwise the link comes from ``--link`` or
   the catalog.

:class:`SimulatedCompression` is the single-process stand-in for the compressed all-reduce that the
calibration trains with: the same per-layer codecs and error feedback, applied to one rank's gradient.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Iterator, Mapping

import torch

from fastml_strategy.autotune.costmodel import BASE_OPTIONS, CANDIDATES, LayerProfile, Profile
from fastml_strategy.autotune.workload import Workload
from fastml_strategy.config import CodecConfig

__all__ = ["profile_workload", "measure_link", "SimulatedCompression", "fsdp_unit_modules",
           "rank_threads", "available_cores"]

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def fsdp_unit_modules(model: torch.nn.Module) -> list[str]:
    """The module paths the cost model treats as FSDP units (each gets its own ``fully_shard``; the
    root's remaining parameters form the root unit): every child of the root that holds parameters,
    looking through containers (ModuleList, ModuleDict, Sequential), so that each block of
    ``model.layers`` is a unit, the usual way to apply ``fully_shard``."""
    units: list[str] = []

    def visit(prefix: str, module: torch.nn.Module) -> None:
        for name, child in module.named_children():
            path = prefix + name
            if isinstance(child, _CONTAINERS):
                visit(path + ".", child)
            elif any(p.requires_grad for p in child.parameters()):
                units.append(path)

    visit("", model)
    return units


def unit_of(name: str, units: list[str]) -> str:
    """The FSDP unit (module path, ``""`` the root) that parameter ``name`` belongs to."""
    best = ""
    for u in units:
        if name.startswith(u + ".") and len(u) > len(best):
            best = u
    return best


class SimulatedCompression:
    """Replace each parameter's gradient by ``decode(encode(grad + residual))``, with error feedback.

    ``configs`` maps parameter names to CodecConfig (missing or fp32: untouched). A low-rank layer
    runs as the runtime runs it on one rank: its warm-up steps in int8 without a residual, then one
    power step per step from the previous step's ``Q`` (:func:`~fastml_strategy.codecs.lowrank.local_power_step`),
    the first drawn as the runtime draws it.
    """

    def __init__(self, model: torch.nn.Module, configs: Mapping[str, CodecConfig]) -> None:
        from fastml_strategy.codecs import codec_for, roundtrip

        self._roundtrip = roundtrip
        self.params = [(n, p, configs[n]) for n, p in model.named_parameters()
                       if n in configs and configs[n].lossy]
        self.lowrank = {n for n, p, cfg in self.params
                        if cfg.wire.lowrank and codec_for(cfg).compressible(tuple(p.shape))}
        self.residuals: dict[str, torch.Tensor] = {}
        self.q: dict[str, torch.Tensor] = {}
        self.step = 0

    def _low_rank(self, name: str, x: torch.Tensor, cfg: CodecConfig) -> tuple[torch.Tensor, bool]:
        """A low-rank layer's step: (what it decodes to, whether error feedback applies)."""
        from fastml_strategy.codecs import codec_for
        from fastml_strategy.codecs.lowrank import initial_q, local_power_step, matrix_shape

        if self.step < cfg.start:
            return self._roundtrip(x, codec_for(cfg).start_cfg)[0], False
        q = self.q.get(name)
        if q is None:
            q = initial_q(name, matrix_shape(x.shape)[1], cfg.rank, 0, x.device)
        dec, self.q[name] = local_power_step(x, q)
        return dec, True

    def apply(self) -> None:
        for name, p, cfg in self.params:
            if p.grad is None:
                continue
            g = p.grad
            x = g + self.residuals[name] if name in self.residuals else g.clone()
            if name in self.lowrank:
                dec, fed = self._low_rank(name, x, cfg)
            else:
                (dec, _), fed = self._roundtrip(x, cfg), True
            if cfg.uses_residual and fed:  # kept in the residual's dtype, as the collective keeps it
                self.residuals[name] = (x - dec).to(cfg.residual_torch_dtype)
            g.copy_(dec)
        self.step += 1


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, else the machine's count)."""
    import os

    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@contextlib.contextmanager
def rank_threads(threads: int | None) -> Iterator[None]:
    """Run the block with ``threads`` intra-op threads (what one rank will have), then restore.
    None: leave torch's setting alone (a torchrun rank already runs as it will)."""
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def step_clock() -> Callable[[], float]:
    """The clock compute and codec times are profiled with: this thread's CPU time where one thread
    does the work (one intra-op thread, no GPU: the default of two ranks on two cores), else the wall
    clock. On a shared machine the wall clock times the other jobs too: at load 25-50 on 2 cores the
    profile of issue 38's GPT read 20 s per step, the 50 Mbit/s link looked free beside it, and the
    tuner answered plain DDP; the thread's CPU time is what the step costs on the rank it will run on."""
    if torch.get_num_threads() == 1 and not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return time.thread_time
    return time.perf_counter


def profile_workload(
    wl: Workload,
    *,
    steps: int = 5,
    options: list[str] | None = None,
    min_numel: int = 4096,
    world_size: int = 1,
    warmup: int = 2,
    progress: Callable[[int], None] | None = None,
) -> Profile:
    """Measure compute time, gradient-ready times, and each layer's error and codec time per option."""
    if steps < 1:
        raise ValueError(f"profile steps is {steps}; give at least 1")
    options = _profile_options(options)
    model = wl.fresh_model()
    model.train()
    opt = wl.make_optimizer(model)
    run = _ProfileRun(wl, model, opt)
    clock = run.clock
    tunable = {n for n, p in run.named if p.numel() >= min_numel}
    try:
        for step in range(warmup + steps):
            measured = step >= warmup
            run.forward_backward(measured)
            if measured:
                run.measure_codecs(tunable, options, steps)
            t3 = clock()
            opt.step()
            _sync()
            if measured:
                run.opt_t.append(clock() - t3)
                if progress is not None:
                    progress(1)
        run.more_compute_steps()
    finally:
        run.remove_hooks()
    return Profile(layers=_layer_profiles(run, tunable, options, steps), forward_s=statistics.median(run.fwd_t),
                   backward_s=statistics.median(run.bwd_t), optimizer_s=statistics.median(run.opt_t),
                   world_size=world_size, min_numel=min_numel, options=options,
                   optimizer_state_bytes=_optimizer_state_bytes(opt), threads=torch.get_num_threads())


def _profile_options(options: list[str] | None) -> list[str]:
    """The codec options profiled, validated, with ``none`` first unless given."""
    options = list(options or BASE_OPTIONS)
    unknown = [o for o in options if o not in CANDIDATES]
    if unknown:
        raise ValueError(f"unknown codec option(s) {unknown}; choose from {list(CANDIDATES)}")
    if "none" not in options:
        options = ["none"] + options
    return options


class _ProfileRun:
    """The profiling steps of one model: its timed forward and backward passes (with when each
    gradient was ready) and each tunable gradient's codec round trips, and what they measured."""

    def __init__(self, wl: Workload, model: torch.nn.Module, opt: Any) -> None:
        self.wl, self.model, self.opt = wl, model, opt
        self.clock = step_clock()  # CPU time of this thread where it does the work (step_clock)
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.ready: dict[str, float] = {}  # this step: seconds into backward each gradient was ready
        self.t_bwd0 = 0.0
        self.handles = [p.register_post_accumulate_grad_hook(self._ready_hook(n)) for n, p in self.named]
        self.stream: Iterator[Any] = wl.batch_stream()
        self.fwd_t: list[float] = []
        self.bwd_t: list[float] = []
        self.opt_t: list[float] = []
        self.ready_t: dict[str, list[float]] = {n: [] for n, _ in self.named}
        self.err_sq: dict[tuple[str, str], float] = {}
        self.grad_sq: dict[str, float] = {n: 0.0 for n, _ in self.named}
        self.codec_t: dict[tuple[str, str], list[float]] = {}
        self.residual: dict[tuple[str, str], torch.Tensor] = {}
        self.warmed: set[str] = set()  # codec options called once, untimed

    def _ready_hook(self, n: str) -> Callable[[torch.Tensor], None]:
        def hook(_p: torch.Tensor) -> None:
            self.ready[n] = self.clock() - self.t_bwd0
        return hook

    def remove_hooks(self) -> None:
        for h in self.handles:
            h.remove()

    def forward_backward(self, record: bool) -> float:
        """One timed forward + backward; records the times (and when each gradient was ready)."""
        batch = next(self.stream)
        self.opt.zero_grad(set_to_none=True)
        self.ready.clear()
        _sync()
        t0 = self.clock()
        loss = self.wl.loss_fn(self.model, batch)
        _sync()
        t1 = self.clock()
        self.t_bwd0 = t1
        loss.backward()
        _sync()
        t2 = self.clock()
        if record:
            self.fwd_t.append(t1 - t0)
            self.bwd_t.append(t2 - t1)
            for n, _ in self.named:
                self.ready_t[n].append(self.ready.get(n, t2 - t1))
        return t2

    def measure_codecs(self, tunable: set[str], options: list[str], steps: int) -> None:
        """Every gradient's squared norm and, for tunable layers, each option's round trip: its time
        and its error with the option's own error-feedback residual."""
        from fastml_strategy.codecs import roundtrip

        for n, p in self.named:
            if p.grad is None:
                continue
            g = p.grad.detach()
            gs = float(g.float().pow(2).sum())
            self.grad_sq[n] += gs / steps
            if n not in tunable:
                continue
            for o in options:  # "none" too: the hook's fp32 path still copies and sums
                cfg = CANDIDATES[o]
                key = (n, o)
                x = g + self.residual[key] if key in self.residual else g.clone()
                if o not in self.warmed:  # a codec's first call loads (or builds) its kernel:
                    roundtrip(x.clone(), cfg)  # seconds once, not its speed (it set int8 at 3 s)
                    _sync()
                    self.warmed.add(o)
                ta = self.clock()
                dec, _ = roundtrip(x, cfg)
                _sync()
                self.codec_t.setdefault(key, []).append(self.clock() - ta)
                if cfg.uses_residual:
                    self.residual[key] = (x - dec).to(cfg.residual_torch_dtype)
                self.err_sq[key] = self.err_sq.get(key, 0.0) + float((dec - g).float().pow(2).sum())

    def more_compute_steps(self) -> None:
        """More compute-only steps, for a steadier median, while they are cheap (at most 20 steps
        or about 2 seconds): a single preempted step on a shared machine must not set the model."""
        t_start = time.perf_counter()
        while len(self.fwd_t) < 20 and time.perf_counter() - t_start < 2.0:
            t2 = self.forward_backward(True)
            self.opt.step()
            _sync()
            self.opt_t.append(self.clock() - t2)


def _optimizer_state_bytes(opt: Any) -> int:
    """Bytes of the optimizer's tensor state (step counters and other scalars left out)."""
    return int(sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0))


def _layer_profiles(run: _ProfileRun, tunable: set[str], options: list[str], steps: int) -> list[LayerProfile]:
    """One profile per trainable parameter: median ready time, mean squared gradient norm, FSDP unit,
    and per option its relative error and median codec time (0 for layers not tuned)."""
    units = fsdp_unit_modules(run.model)
    embeddings = {f"{prefix}{'.' if prefix else ''}weight" for prefix, m in run.model.named_modules()
                  if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))}
    layers = []
    for i, (n, p) in enumerate(run.named):
        lp = LayerProfile(name=n, numel=p.numel(), index=i,
                          ready_s=statistics.median(run.ready_t[n]), grad_sq=run.grad_sq[n],
                          tunable=n in tunable, shape=list(p.shape), unit=unit_of(n, units),
                          kind="embedding" if n in embeddings else "")
        total = run.grad_sq[n] * steps
        for o in options:
            if n not in tunable:
                lp.rel_error[o] = 0.0
                lp.codec_s[o] = 0.0
                continue
            lp.rel_error[o] = (run.err_sq[(n, o)] / total) ** 0.5 if total > 0 else 0.0
            lp.codec_s[o] = statistics.median(run.codec_t[(n, o)])
        layers.append(lp)
    return layers


def measure_link(sizes: tuple[int, ...] = (1 << 14, 1 << 18, 1 << 20, 1 << 22),
                 repeats: int = 3, group: Any = None) -> list[tuple[float, float, float]]:
    """Time all_reduce and all_gather of fp32 tensors of ``sizes`` bytes on the current process group.

    Every rank must call this. Returns ``(rounds, bytes_per_rank, seconds)`` samples (the slowest rank's
    median time for each), ready for :func:`~fastml_strategy.autotune.costmodel.fit_alpha_beta`.
    """
    import torch.distributed as dist

    w = dist.get_world_size(group)
    rows: list[tuple[float, float, float]] = []
    times: list[float] = []
    for size in sizes:
        numel = max(1, size // 4)
        x = torch.ones(numel)
        outs = [torch.empty(numel) for _ in range(w)]
        for kind in ("all_reduce", "all_gather"):
            ts = []
            for _ in range(repeats + 1):
                dist.barrier(group)
                t0 = time.perf_counter()
                if kind == "all_reduce":
                    dist.all_reduce(x, group=group)
                else:
                    dist.all_gather(outs, x, group=group)
                ts.append(time.perf_counter() - t0)
            times.append(statistics.median(ts[1:]))
            if kind == "all_reduce":
                rows.append((2 * (w - 1), 2 * (w - 1) / w * 4 * numel, 0.0))
            else:
                rows.append((w - 1, (w - 1) * 4 * numel, 0.0))
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return [(r, b, float(s)) for (r, b, _), s in zip(rows, t.tolist())]
