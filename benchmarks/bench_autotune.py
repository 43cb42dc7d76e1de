"""Autotuned plan vs uniform recipes, trained to a target on 2 ranks over an emulated link.

Two workloads (``--workload``):

- ``gpt`` (a transformer): the 4-block byte-level GPT of ``gpt_workload.py`` (3.3M
  parameters, 54 tensors: embeddings, attention, MLP, head), AdamW 1e-3, batch 8 x 64 tokens per rank,
  each rank its own stream of the synthetic byte language, on an emulated **100 Mbit/s** link, trained
  to a validation loss of 1.65 (fp32 DDP reaches it in about 110 steps; the loss floor is ln 4 =
  1.39). The tuner runs with its default calibration and ``--no-local-steps`` (this benchmark compares
  per-step plans); the tuned plan's ``meta.ddp.bucket_cap_mb`` is passed to DDP, as its report says.
- ``gpt2``: a second transformer of another width, depth, language and optimizer
  (``gpt_workload.make2``: 6 blocks of d=192, 2.7M parameters in 78 tensors, a 128-token language
  with unequally likely successors, context 48, batch 12 x 48 tokens per rank, NAdam 2e-3), on an
  emulated **50 Mbit/s** link, trained to a validation loss of 1.30 (fp32 reaches it in about 55
  steps; the loss floor is 0.90).
- ``digits``: the digits MLP (scikit-learn's bundled digits, 1.1M parameters), Adam 1e-3, batch 32
  per rank, on an emulated 1 Gbit/s link, trained to 97% test accuracy.

What it measures
----------------
1. ``fastml-autotune`` on the workload, launched with torchrun on 2 ranks inside the emulated link:
   it measures the link (timed collectives), profiles, calibrates, searches and writes plan.json plus
   its predicted step times (``tune/step_times.csv``).
2. Training to the target with each plan: the tuned plan.json, the uniform recipes, torch's own
   PowerSGD hook (issue 36: ``--powersgd-ranks`` 1,2,4 x ``--powersgd-starts`` 2,10, one DDP bucket
   each, since torch's hook aborts on gloo with two; its bytes are what it hands to
   ``torch.distributed.all_reduce``, counted, and its ms/step is the median of its compressing steps,
   while its time to the target includes its first ``start_powerSGD_iter`` uncompressed steps), and
   plain fp32 DDP (no hook). Same seed, data and optimizer; the clock runs only during training steps
   (evaluation every few steps is paused). Full runs: the time to the target is the sum of the
   measured steps up to the evaluation that reached it, not a prediction.
3. A table: measured ms/step, predicted ms/step and the prediction error, steps and seconds to the
   target, bytes per step on the wire (counted by the hook; DDP's fp32 all-reduce is 2(W-1)/W x 4
   bytes per gradient element), and the physical bound of each plan: max(compute, wire bytes / link
   rate) per step, with compute timed in the same processes (``compute_ms``: forward, backward and
   optimizer step of one rank on a model of its own, no communication). Both ranks share the one
   emulated link, so the bound counts both ranks' bytes. Written as CSV to
   ``benchmarks/results/bench_autotune_<workload>_cpu.csv`` (other seeds and rates than the
   workload's defaults: ``bench_autotune_<workload>_<rate>_seed<N>_cpu.csv``).
4. ``--seed N`` (default 0) is the tuner's ``--seed`` and the training's: the model's initial
   weights and every rank's data stream change with it (the validation batches do not).
   ``--summary`` prints, from every such CSV under ``benchmarks/results/``, per workload, rate and
   seed the tuned plan's measured time to the target against the best uniform recipe's and the best
   torch PowerSGD setting's (``tuned_over_best_powersgd``).

The emulated link: a commodity cluster link on one machine
----------------------------------------------------------
Run as root. The benchmark creates a private network namespace, brings its loopback up, rate-limits
it with a token bucket filter and runs every rank inside it, so both ranks share one link::

    ip netns add fastml-at-PID
    ip -n fastml-at-PID link set lo up
    ip netns exec fastml-at-PID tc qdisc add dev lo root tbf rate 100mbit burst 512kb latency 100ms
    ip netns exec fastml-at-PID python benchmarks/bench_autotune.py --inner ...
    ip netns del fastml-at-PID          # always, also on failure

(``--netns-prefix P`` names it ``P-PID``, so that several people on one machine do not collide.)

``--no-netns`` skips all that (plain loopback, no rate limit: a quick functional run, not a
measurement of a slow link).

Usage::

    sudo python benchmarks/bench_autotune.py                    # GPT, 100 Mbit/s: ~30 min on 2 cores
    sudo python benchmarks/bench_autotune.py --workload gpt2 --seed 1  # the second transformer
    sudo python benchmarks/bench_autotune.py --workload digits  # digits MLP, 1 Gbit/s: ~10 min
    python benchmarks/bench_autotune.py --summary               # tuned vs best uniform, every run
    python benchmarks/bench_autotune.py --no-netns --quick      # functional smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gpt_workload, in spawned ranks too
from _bench import CollectiveBytes  # noqa: E402
HIDDEN = int(os.environ.get("FASTML_BENCH_HIDDEN", "1024"))  # digits: 1.1M parameters, 4.4 MB of grads
BATCH = 32  # digits, per rank
LR = 1e-3


@dataclass(frozen=True)
class Task:
    """What differs between the workloads: the tuner's target, the metric and the defaults."""

    name: str
    factory: str  # the tuner's TARGET: path:function
    metric: str  # what the target is on
    higher_is_better: bool
    target: float
    rate: str  # the emulated link
    recipes: tuple[str, ...]
    tuner_args: tuple[str, ...]
    max_steps: int
    timing_steps: int  # each plan trains at least this many steps (timed), also past the target
    eval_every: int


TASKS = {
    "gpt": Task("gpt", f"{Path(__file__).resolve().parent / 'gpt_workload.py'}:make", "validation loss",
                False, 1.65, "100mbit", ("fp16", "int8", "int4", "int2", "topk1"),
                ("--no-local-steps", "--budget", "12"), 400, 0, 5),
    "gpt2": Task("gpt2", f"{Path(__file__).resolve().parent / 'gpt_workload.py'}:make2", "validation loss",
                 False, 1.30, "50mbit", ("fp16", "int8", "int4", "int2", "topk1"),
                 ("--no-local-steps", "--budget", "12"), 300, 0, 5),
    # issue 38's third transformer: 3 blocks of d=320 on gpt's byte language (gpt_workload.make3)
    "gpt3": Task("gpt3", f"{Path(__file__).resolve().parent / 'gpt_workload.py'}:make3", "validation loss",
                 False, 1.65, "50mbit", ("fp16", "int8", "int4", "int2", "topk1"),
                 ("--no-local-steps", "--budget", "12"), 400, 0, 5),
    "digits": Task("digits", f"{Path(__file__).resolve()}:digits_workload", "test accuracy", True, 0.97,
                   "1gbit", ("none", "fp16", "int8", "int4", "int2", "topk1"),
                   ("--trials", "200", "--calibration-trials", "6", "--calibration-steps", "120",
                    "--measure-steps", "40", "--max-accuracy-loss", "0.01"), 1000, 150, 5),
}


# -- the workloads (digits_workload is also the autotuner's TARGET for --workload digits) ---------------
def digits_workload():
    """The digits MLP as an autotuner Workload: this rank's shard of the training split, Adam."""
    import torch.distributed as dist

    from fastml_strategy._digits import accuracy, batches, digits_mlp, load_digits_split
    from fastml_strategy.autotune import Workload

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    x, y, xt, yt = load_digits_split(seed=0)
    return Workload(
        model=digits_mlp(hidden=HIDDEN, seed=0),
        batches=lambda: batches(x, y, BATCH, rank, world, seed=0),
        loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
        eval_fn=lambda m: accuracy(m, xt, yt),
        optimizer=lambda p: torch.optim.Adam(p, lr=LR),
        name="digits",
    )


def _training_parts(task: str, rank: int, world: int, seed: int = 0):
    """(new model, this rank's batch stream factory, loss(model, batch), evaluate(model), optimizer);
    ``seed`` changes the initial weights and the data streams (seed 0: the tuner's own)."""
    if task == "gpt":
        import gpt_workload as g

        val = [next(g.batch_stream(99, 32)) for _ in range(2)]  # held out: another seed than training

        def model():
            torch.manual_seed(seed)
            return g.GPT()

        return (model, lambda: g.batch_stream(7 + 1000 * rank + 100 * seed), g.loss_fn,
                lambda m: g.validation_loss(m, val), lambda p: torch.optim.AdamW(p, lr=1e-3))
    if task == "gpt2":
        import gpt_workload as g

        val2 = [next(g.batch_stream2(99, 32)) for _ in range(2)]

        def model2():
            torch.manual_seed(seed)
            return g.GPT(layers=g.LAYERS2, d=g.D2, heads=g.HEADS2, vocab=g.VOCAB2, positions=2 * g.SEQ2)

        return (model2, lambda: g.batch_stream2(11 + 1000 * rank + 100 * seed), g.loss_fn2,
                lambda m: g.validation_loss2(m, val2), g.gpt2_optimizer)
    if task == "gpt3":
        import gpt_workload as g

        val3 = [next(g.batch_stream(99, 32)) for _ in range(2)]

        def model3():
            torch.manual_seed(seed)
            return g.GPT(layers=g.LAYERS3, d=g.D3, heads=g.HEADS3)

        return (model3, lambda: g.batch_stream(13 + 1000 * rank + 100 * seed), g.loss_fn,
                lambda m: g.validation_loss(m, val3), lambda p: torch.optim.AdamW(p, lr=1e-3))
    from fastml_strategy._digits import accuracy, batches, digits_mlp, load_digits_split

    x, y, xt, yt = load_digits_split(seed=0)
    return (lambda: digits_mlp(hidden=HIDDEN, seed=0), lambda: batches(x, y, BATCH, rank, world, seed=0),
            lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
            lambda m: accuracy(m, xt, yt), lambda p: torch.optim.Adam(p, lr=LR))


# -- training to the target, on 2 spawned gloo ranks ----------------------------------------------------
# All plans train side by side in the same 2 processes, taking turns in chunks of ``eval_every`` steps
# (each plan has its own model, optimizer, data stream and hook): on a shared machine a burst of load
# from other processes then hits every plan alike, instead of whichever plan happened to be running.
# A plan's clock is the sum of its own steps up to the target; evaluation (every chunk) is not timed.
# Plans keep training past the target until --timing-steps steps are timed, for a steadier median.
def _train_worker(rank: int, world: int, port: int, task_name: str, plans, target: float, max_steps: int,
                  eval_every: int, timing_steps: int, q, seed: int = 0) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fastml_strategy import Plan, register_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    task = TASKS[task_name]
    reached = (lambda v: v >= target) if task.higher_is_better else (lambda v: v <= target)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
        new_model, stream, loss_fn, evaluate, optimizer = _training_parts(task_name, rank, world, seed)
        runs = {}
        for label, plan_arg, cap_mb in plans:
            model = DDP(new_model(), **({"bucket_cap_mb": cap_mb} if cap_mb else {}))
            state = psgd = None
            if plan_arg is not None and plan_arg.startswith(POWERSGD):
                psgd = _register_powersgd(model, plan_arg)
            elif plan_arg is not None:
                plan = Plan.load(plan_arg) if plan_arg.endswith(".json") else Plan.from_recipe(plan_arg)
                state = register_hook(model, plan)
            runs[label] = {"model": model, "state": state, "psgd": psgd, "opt": optimizer(model.parameters()),
                           "stream": stream(), "times": [], "value": None, "reached": None, "allreduced": 0,
                           "curve": []}
        compute = _compute_times(new_model, stream, loss_fn, optimizer, steps=20)
        active = list(runs)
        while active:
            for label in list(active):
                r = runs[label]
                # torch's PowerSGD hook calls torch.distributed.all_reduce: count what it hands over
                with (CollectiveBytes() if r["psgd"] is not None else contextlib.nullcontext()) as counted:
                    for _ in range(eval_every):
                        batch = next(r["stream"])
                        t0 = time.perf_counter()
                        r["opt"].zero_grad(set_to_none=True)
                        loss_fn(r["model"], batch).backward()
                        r["opt"].step()
                        r["times"].append(time.perf_counter() - t0)
                r["allreduced"] += counted.bytes if counted is not None else 0
                r["value"] = evaluate(r["model"].module)  # replicas identical: ranks agree
                r["curve"].append((len(r["times"]), sum(r["times"]), r["value"]))
                if r["reached"] is None and reached(r["value"]):
                    r["reached"] = len(r["times"])
                # keep going past the target until timing_steps steps are timed: a steadier median
                if (r["reached"] and len(r["times"]) >= timing_steps) or len(r["times"]) >= max_steps:
                    active.remove(label)
        dist.barrier()
        out = {}
        for label, r in runs.items():
            psgd = r["psgd"]
            # PowerSGD: the steps after start_powerSGD_iter (before it, it is plain DDP's all-reduce)
            timed = r["times"][psgd.start_powerSGD_iter:] if psgd is not None else r["times"]
            steady = sorted(timed[5:] or timed or r["times"])
            st = r["state"].stats() if r["state"] else None
            ring = 2.0 * (world - 1) / world  # gloo's ring all-reduce: bytes a rank sends per byte reduced
            out[label] = {
                "steps": r["reached"],
                "seconds": sum(r["times"][: r["reached"]]) if r["reached"] else None,
                "final_value": r["value"], "ms_per_step": 1e3 * steady[len(steady) // 2],
                "compression_ratio": st["compression_ratio"] if st else
                (psgd.compression_stats()[0] if psgd is not None and psgd.total_numel_after_compression else 1.0),
                "wire_bytes_per_step": (st["bytes_sent"] / max(st["steps"], 1)) if st else
                ring * r["allreduced"] / len(r["times"]) if psgd is not None else
                ring * 4 * sum(p.numel() for p in r["model"].parameters()),
                "compute_ms": compute,
                # (steps, seconds of this rank's own steps, evaluated value) after every chunk
                "curve": r["curve"],
            }
        q.put((rank, "ok", out))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, "error", f"{type(e).__name__}: {e}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# torch's PowerSGD hook as a trained method: "powersgd:RANK:START" (plan argument), "powersgd-rRANK-sSTART"
# (label). torch's default start_powerSGD_iter is 1000: longer than any run here (--max-steps 400), so
# with it the hook never compresses and its run is plain fp32 DDP's; the runs below start it at 2 (its
# minimum with error feedback) and 10 (its docstring's advice, 10% of the training steps: fp32 DDP
# reaches gpt's target in about 110 steps).
POWERSGD = "powersgd:"
POWERSGD_RANKS = "1,2,4"
POWERSGD_STARTS = "2,10"


def _register_powersgd(model, plan_arg: str):
    """torch's PowerSGD hook on ``model`` (DDP, one bucket) at the rank and start of ``plan_arg``."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    _, rank, start = plan_arg.split(":")
    state = PowerSGDState(process_group=None, matrix_approximation_rank=int(rank),
                          start_powerSGD_iter=int(start))
    model.register_comm_hook(state, powerSGD_hook)
    return state


def _powersgd_plans(task_name: str, ranks: str, starts: str) -> list[tuple[str, str, float]]:
    """(label, plan argument, bucket_cap_mb) of each PowerSGD method: one bucket (torch's hook aborts
    on gloo with two, DESIGN.md)."""
    from fastml_strategy.autotune.costmodel.powersgd import one_bucket_mb

    numel = sum(p.numel() for p in _training_parts(task_name, 0, 2)[0]().parameters())
    cap = one_bucket_mb(numel)
    return [(f"powersgd-r{r}-s{s}", f"{POWERSGD}{r}:{s}", cap)
            for r in ranks.split(",") if r for s in starts.split(",") if s]


def _compute_times(new_model, stream, loss_fn, optimizer, steps: int) -> float:
    """Median ms of one rank's forward + backward + optimizer step without communication (a model of
    its own, no DDP): the compute side of the physical bound."""
    m = new_model()
    opt = optimizer(m.parameters())
    s = stream()
    times = []
    for _ in range(steps):
        batch = next(s)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_fn(m, batch).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    times = sorted(times[3:])
    return 1e3 * times[len(times) // 2]


def train_to_target(task: str, plans, target: float, max_steps: int, eval_every: int,
                    timing_steps: int = 100, world: int = 2, timeout: float = 3600, seed: int = 0) -> dict:
    """{label: result} for ``plans`` = [(label, recipe name | plan.json path | None for plain DDP,
    bucket_cap_mb | None)]."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_train_worker, args=(r, world, port, task, plans, target, max_steps,
                                                     eval_every, timing_steps, q, seed))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    deadline = time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            r, status, v = q.get(timeout=1.0)
            results[r] = (status, v)
        except Exception:  # noqa: BLE001
            if all(not p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    errors = {r: v for r, (s, v) in results.items() if s != "ok"}
    if errors or len(results) < world:
        raise RuntimeError(f"training failed: {errors or 'timeout'}")
    # The slowest rank's step time counts; both ranks stop each plan at the same step.
    out = {}
    for label, _, _ in plans:
        rows = [v[label] for _, v in results.values()]
        o = dict(rows[0])
        for k in ("ms_per_step", "compute_ms"):
            o[k] = max(r[k] for r in rows)
        if o["seconds"] is not None:
            o["seconds"] = max(r["seconds"] for r in rows)
        # the slowest rank's clock at each evaluation (the values agree: identical replicas)
        o["curve"] = [(n, max(c[i][1] for c in (r["curve"] for r in rows)), v)
                      for i, (n, _, v) in enumerate(rows[0]["curve"])]
        out[label] = o
    return out


# -- the run inside the emulated link ------------------------------------------------------------------
def _tune(args: argparse.Namespace, task: Task, tune: Path) -> float:
    """Run fastml-autotune under torchrun on 2 ranks; returns its wall time in seconds."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO) + os.pathsep +
               os.environ.get("PYTHONPATH", ""), MASTER_ADDR="127.0.0.1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()),
           "-m", "fastml_strategy.autotune.cli", task.factory, "--out", str(tune), "--quiet",
           *task.tuner_args, "--seed", str(args.seed), *(args.tuner_args or [])] + (
               ["--overwrite"] if args.resume else [])
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=REPO, timeout=3600)
    return time.perf_counter() - t0


def _rate_bits(rate: str) -> float:
    """tc's rate string ('100mbit', '1gbit') in bit/s."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    for u, f in units.items():
        if rate.lower().endswith(u):
            return float(rate[: -len(u)]) * f
    raise ValueError(f"unknown rate {rate!r}: give it as tc does, e.g. 100mbit or 1gbit")


def inner(args: argparse.Namespace) -> None:
    # One thread per rank everywhere (ranks and torchrun children alike): 2 ranks on 2 cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    task = TASKS[args.workload]
    out = Path(args.out or REPO / "benchmarks" / "out" / f"autotune_{task.name}_{_run_tag(args, task)}")
    tune = out / "tune"
    if args.trained_plan:  # another run's tuning: train only
        if not (tune / "plan.json").is_file():
            sys.exit(f"bench_autotune: --trained-plan needs {tune}/plan.json from an earlier run (same --out)")
        tune_s, tune_load = None, ""
    else:
        if tune.exists() and not args.resume:
            shutil.rmtree(tune)
        tune_load_before = os.getloadavg()[0]
        tune_s = _tune(args, task, tune)
        tune_load = f"{tune_load_before:.1f}-{os.getloadavg()[0]:.1f}"
    predicted = {}
    with open(tune / "step_times.csv") as f:
        for row in csv.DictReader(f):
            key = "tuned" if row["plan"].startswith("tuned") else row["plan"]
            predicted[key] = (float(row["predicted_s"]), float(row["measured_s"]))
    meta = json.loads((tune / "plan.json").read_text()).get("meta", {})
    cap = (meta.get("ddp") or {}).get("bucket_cap_mb")
    plans: list[tuple[str, str | None, float | None]] = [
        ("tuned", None if meta.get("hook") is False else str(tune / "plan.json"), cap)]
    plans += [(r, r, None) for r in (args.recipes.split(",") if args.recipes else task.recipes)]
    plans += _powersgd_plans(task.name, args.powersgd_ranks, args.powersgd_starts)
    plans += [] if args.skip_ddp else [("ddp-fp32", None, None)]
    load_before = os.getloadavg()[0]
    print(f"training {len(plans)} plans side by side to {task.metric} {args.target}...", flush=True)
    results = train_to_target(task.name, plans, args.target, args.max_steps, args.eval_every,
                              args.timing_steps, seed=args.seed)
    load = f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"
    link_bytes_s = _rate_bits(args.rate) / 8 if not args.no_netns else float("inf")
    rows = []
    for label, _, cap_mb in plans:
        r = results[label]
        pred_s, tuner_measured_s = predicted.get(label, (float("nan"), float("nan")))
        # step_times.csv times and predicts the tuned plan with DDP's default buckets; the plan's own
        # prediction (meta.predicted) is for the bucket size it chose, which this run passes to DDP
        pred_own = (meta.get("predicted") or {}).get("step_s") if label == "tuned" and cap else None
        wire_ms = 1e3 * 2 * r["wire_bytes_per_step"] / link_bytes_s  # both ranks share the link
        bound = max(r["compute_ms"], wire_ms)
        rows.append({
            "workload": task.name, "seed": args.seed, "target": args.target,
            "plan": label, "bucket_cap_mb": cap_mb or "", "ms_per_step": round(r["ms_per_step"], 1),
            "predicted_ms": round(1e3 * pred_s, 1),
            "prediction_error_pct": round(100 * (1e3 * pred_s - r["ms_per_step"]) / r["ms_per_step"], 1),
            "tuner_measured_ms": round(1e3 * tuner_measured_s, 1),
            "predicted_ms_own_buckets": round(1e3 * pred_own, 1) if pred_own else "",
            "compute_ms": round(r["compute_ms"], 1), "wire_mb_per_step": round(r["wire_bytes_per_step"] / 1e6, 3),
            "bound_ms": round(bound, 1), "x_bound": round(r["ms_per_step"] / bound, 2),
            "steps_to_target": r["steps"] or "", "seconds_to_target": round(r["seconds"], 2) if r["seconds"] else "",
            "final_value": round(r["final_value"], 4), "compression_ratio": round(r["compression_ratio"], 2),
            # 1-minute load average of the (shared) machine before and after: above ~2 on 2 cores,
            # timings are noisy
            "load_avg": load, "link": "none" if args.no_netns else args.rate,
            "method": _method(label),
        })
    rows[0]["plan_summary"] = _plan_summary(tune / "plan.json")
    rows[0]["check"] = (meta.get("checked_against_uniform") or {}).get("verdict", "")
    rows[0].update(_fp16_stretch(tune / "calibration.csv"))
    rows[0]["e_max"] = (meta.get("accuracy_rule") or {}).get("e_max", "")
    rows[0]["tune_s"] = round(tune_s) if tune_s is not None else "reused"
    rows[0]["tune_load_avg"] = tune_load
    from tabulate import tabulate

    import _bench

    default_name = (f"bench_autotune_{task.name}_cpu.csv" if args.rate == task.rate and args.seed == 0
                    else f"bench_autotune_{task.name}_{_run_tag(args, task)}_cpu.csv")
    csv_path = Path(args.csv or _bench.default_csv(default_name, documented=not args.no_netns))
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    _bench.write_csv(csv_path, rows)
    print()
    print(f"{task.name}: 2 ranks x 1 thread, link: {'none (plain loopback)' if args.no_netns else args.rate + ' emulated (tbf)'}; "
          f"target {task.metric} {args.target}; {_bench.machine_line()}, load {load}; tuning "
          f"{'reused' if tune_s is None else f'took {tune_s:.0f} s'}; tuned plan: {_plan_summary(tune / 'plan.json')}"
          f"{f', bucket_cap_mb {cap}' if cap else ''}")
    print(tabulate([[r["plan"], r["ms_per_step"], r["predicted_ms"], f"{r['prediction_error_pct']:+.1f}%",
                     r["compute_ms"], r["wire_mb_per_step"], r["bound_ms"], r["x_bound"],
                     r["steps_to_target"] or "not reached", r["seconds_to_target"] or "-",
                     r["final_value"], f"{r['compression_ratio']:.1f}x"] for r in rows],
                   headers=["plan", "ms/step", "predicted", "pred. error", "compute ms", "MB/step/rank",
                            "bound ms", "x bound", "steps to target", "s to target", task.metric,
                            "compression"], tablefmt="github"))
    _print_ratios(rows)
    print(f"\nwrote {csv_path} and {tune}/report.html")


def _print_ratios(rows: list[dict]) -> None:
    """The tuned plan's time to the target against the best uniform recipe's and the best torch
    PowerSGD setting's (rows[0] is the tuned plan)."""
    tuned = rows[0]
    best = min((r for r in rows if r["seconds_to_target"] != "" and r["method"] == "fastml recipe"),
               key=lambda r: r["seconds_to_target"], default=None)
    best_psgd = min((r for r in rows if r["seconds_to_target"] != "" and r["method"] == "torch powersgd"),
                    key=lambda r: r["seconds_to_target"], default=None)
    if best and tuned["seconds_to_target"] != "":
        print(f"\ntuned plan: {tuned['seconds_to_target']} s to the target; best uniform recipe {best['plan']}: "
              f"{best['seconds_to_target']} s ({best['seconds_to_target'] / tuned['seconds_to_target']:.2f}x)")
    if best_psgd and tuned["seconds_to_target"] != "":
        print(f"tuned plan against the best torch PowerSGD setting {best_psgd['plan']}: "
              f"{best_psgd['seconds_to_target']} s, tuned / PowerSGD = "
              f"{tuned['seconds_to_target'] / best_psgd['seconds_to_target']:.3f} "
              f"(PowerSGD takes {best_psgd['seconds_to_target'] / tuned['seconds_to_target']:.2f}x the tuned "
              f"plan's time)")


def _method(label: str) -> str:
    """What a CSV row trained: the tuned plan, a FastML uniform recipe, torch's PowerSGD hook or DDP."""
    if label == "tuned":
        return "tuned plan"
    if label.startswith("powersgd-"):
        return "torch powersgd"
    return "ddp" if label == "ddp-fp32" else "fastml recipe"


def _fp16_stretch(calibration_csv: Path) -> dict:
    """The tuner's calibration run of uniform fp16 at its own seed: its stretch with the ~95%
    interval, and its accuracy loss (what the rule used, and the final-loss gap): issue 28's check
    that a plan indistinguishable from the reference measures a stretch consistent with 1."""
    if not calibration_csv.exists():
        return {}
    with open(calibration_csv) as f:
        rows = list(csv.DictReader(f))
    seed0 = min((int(r.get("seed") or 0) for r in rows), default=0)
    for r in rows:
        choice = set(json.loads(r["choice"]).values()) if r.get("choice") else set()
        if choice == {"fp16"} and int(r.get("seed") or 0) == seed0:
            return {"fp16_stretch": r.get("ratio", ""), "fp16_stretch_lo": r.get("ratio_lo", ""),
                    "fp16_stretch_hi": r.get("ratio_hi", ""), "fp16_accuracy_loss": r.get("accuracy_loss", ""),
                    "fp16_accuracy_loss_raw": r.get("accuracy_loss_raw", "")}
    return {}


def _run_tag(args: argparse.Namespace, task: Task) -> str:
    """``50mbit_seed1``: the link and seed of a run, in file names."""
    return f"{'nolimit' if args.no_netns else args.rate}_seed{args.seed}"


def summary(results: Path = REPO / "benchmarks" / "results") -> list[dict]:
    """Per workload, link and seed (every bench_autotune CSV under ``results`` with those columns):
    the tuned plan's measured seconds to the target against the best uniform recipe's."""
    rows = []
    for path in sorted(results.glob("bench_autotune_*_cpu.csv")):
        with open(path) as f:
            got = list(csv.DictReader(f))
        if not got or "workload" not in got[0]:
            continue  # written before the workload and seed columns
        tuned = next((r for r in got if r["plan"] == "tuned"), None)
        uni = [r for r in got if _method(r["plan"]) == "fastml recipe"]
        reached = [r for r in uni if r["seconds_to_target"]]
        best = min(reached, key=lambda r: float(r["seconds_to_target"]), default=None)
        psgd = [r for r in got if _method(r["plan"]) == "torch powersgd" and r["seconds_to_target"]]
        best_p = min(psgd, key=lambda r: float(r["seconds_to_target"]), default=None)
        t_s = float(tuned["seconds_to_target"]) if tuned and tuned["seconds_to_target"] else None
        b_s = float(best["seconds_to_target"]) if best else None
        rows.append({
            "workload": got[0]["workload"], "link": got[0]["link"], "seed": got[0]["seed"],
            "target": got[0]["target"], "tuned_plan": tuned.get("plan_summary", "") if tuned else "",
            "tuned_s": t_s, "tuned_steps": tuned["steps_to_target"] if tuned else "",
            "tuned_ms_per_step": tuned["ms_per_step"] if tuned else "",
            "best_uniform": best["plan"] if best else "none reached",
            "best_uniform_s": b_s, "best_uniform_steps": best["steps_to_target"] if best else "",
            "best_uniform_ms_per_step": best["ms_per_step"] if best else "",
            "tuned_over_best_uniform": round(t_s / b_s, 3) if t_s and b_s else "",
            "tuned_no_later": (t_s is not None and (b_s is None or t_s <= b_s)),
            "uniform_not_reached": ",".join(r["plan"] for r in uni if not r["seconds_to_target"]),
            "best_powersgd": best_p["plan"] if best_p else "",
            "best_powersgd_s": float(best_p["seconds_to_target"]) if best_p else "",
            "tuned_over_best_powersgd": round(t_s / float(best_p["seconds_to_target"]), 3) if t_s and best_p else "",
            "fp16_stretch": _interval(tuned) if tuned else "",
            "csv": path.name,
        })
    return rows


def _interval(row: dict) -> str:
    """'1.00 (0.94-1.07)' from a tuned row's fp16 stretch columns ('' when the run has none)."""
    try:
        return f"{float(row['fp16_stretch']):.3g} ({float(row['fp16_stretch_lo']):.3g}-{float(row['fp16_stretch_hi']):.3g})"
    except (KeyError, ValueError):
        return ""


def _plan_summary(path: Path) -> str:
    d = json.loads(path.read_text())
    from collections import Counter

    from fastml_strategy.config import CodecConfig

    c = Counter(CodecConfig.from_dict(v).describe() for k, v in d["layers"].items())
    return ", ".join(f"{n} x{k}" for n, k in c.most_common())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=sorted(TASKS), default="gpt")
    p.add_argument("--out", default=None, help="tuner output (default benchmarks/out/autotune_WORKLOAD)")
    p.add_argument("--csv", default=None,
                   help="default benchmarks/results/bench_autotune_WORKLOAD_cpu.csv")
    p.add_argument("--rate", default=None, help="tc tbf rate of the emulated link (default per workload)")
    p.add_argument("--target", type=float, default=None,
                   help="target validation loss (gpt) or test accuracy (digits)")
    p.add_argument("--recipes", default=None, help="uniform recipes compared, comma-separated")
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None)
    p.add_argument("--timing-steps", type=int, default=None,
                   help="each plan trains at least this many steps (timed), also past the target")
    p.add_argument("--tuner-args", nargs=argparse.REMAINDER,
                   help="extra fastml-autotune arguments (last on the command line)")
    p.add_argument("--quick", action="store_true", help="few trials and steps: a functional check")
    p.add_argument("--resume", action="store_true", help="keep a previous tuning run's storage")
    p.add_argument("--trained-plan", action="store_true",
                   help="do not tune: train OUT/tune/plan.json of an earlier run (same --out) against the "
                        "recipes, e.g. recipes that run did not train")
    p.add_argument("--no-netns", action="store_true", help="plain loopback, no rate limit")
    p.add_argument("--skip-ddp", action="store_true",
                   help="do not train plain fp32 DDP (the slowest plan on a slow link)")
    p.add_argument("--powersgd-ranks", default=POWERSGD_RANKS,
                   help="torch PowerSGD hook ranks trained beside the plans, comma-separated ('' for none)")
    p.add_argument("--powersgd-starts", default=POWERSGD_STARTS,
                   help="its start_powerSGD_iter values, comma-separated (torch's default 1000 never "
                        "compresses within --max-steps: the run would be plain DDP's)")
    p.add_argument("--seed", type=int, default=0,
                   help="the tuner's --seed and the training's (initial weights, data streams)")
    p.add_argument("--netns-prefix", default="fastml-at",
                   help="the emulated link's network namespace is PREFIX-PID (default fastml-at)")
    p.add_argument("--summary", action="store_true",
                   help="print tuned vs best uniform recipe from every CSV under benchmarks/results/")
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.summary:
        from tabulate import tabulate

        rows = summary()
        print(tabulate(rows, headers="keys", tablefmt="github"))
        return
    task = TASKS[args.workload]
    for k in ("rate", "target", "max_steps", "eval_every", "timing_steps"):
        if getattr(args, k) is None:
            setattr(args, k, getattr(task, k))
    if args.quick:
        args.tuner_args = ["--trials", "20", "--calibration-trials", "2", "--calibration-steps", "20",
                           "--verify-rounds", "0", "--budget", "4"] + (args.tuner_args or [])
        args.max_steps = min(args.max_steps, 60)
        args.timing_steps = min(args.timing_steps, 20)
        args.recipes = args.recipes or "int4,int8"
        if args.csv is None:
            args.csv = str(REPO / "benchmarks" / "out" / f"bench_autotune_{task.name}_quick.csv")
    if args.inner or args.no_netns:
        inner(args)
        return
    if os.geteuid() != 0:
        sys.exit("bench_autotune: the emulated link needs root (ip netns, tc); run with sudo, or pass "
                 "--no-netns for an unthrottled functional run")
    ns = f"{args.netns_prefix}-{os.getpid()}"
    run = lambda *c: subprocess.run(list(c), check=True)  # noqa: E731
    run("ip", "netns", "add", ns)
    try:
        run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
            args.rate, "burst", "512kb", "latency", "100ms")
        cmd = ["ip", "netns", "exec", ns, sys.executable, str(Path(__file__).resolve()), "--inner"]
        cmd += [a for a in sys.argv[1:] if a != "--inner"]
        subprocess.run(cmd, check=True)
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


if __name__ == "__main__":
    main()
