"""Hugging Face ``Trainer``: plain DDP against ``Trainer`` + FastML int4 and ``Trainer`` + the plan that
``fastml-autotune`` tunes for the same model (one added line each) at an emulated 100 Mbit/s and 1 Gbit/s
link, on the model of ``recipes/train_transformers.py``.

    sudo python benchmarks/bench_transformers.py                       # tune, then both links, no limit, 3 methods
    sudo python benchmarks/bench_transformers.py --links 100mbit --steps 10
    sudo python benchmarks/bench_transformers.py --tuned tune-out/plan.json    # a plan tuned before

Model: the recipe's Llama built from a config (``--width 256 --layers 4``: 2.75M parameters, 11.0 MB of
fp32 gradient per step, in DDP's default 25 MB buckets), trained byte by byte on the text the recipe uses, batch 8 x 64 bytes per rank,
2 ranks x 1 thread under torchrun, gloo. Methods: ``plain`` (Trainer's own DDP all-reduce, fp32),
``fastml-int4`` (``fastml_strategy.transformers.setup(trainer, plan="int4")``), ``fastml-tuned`` (the same
with ``plan=`` the tuned plan.json, and ``TrainingArguments(ddp_bucket_cap_mb=...)`` from its
``meta.ddp``, as its report says), and the same with ``--methods fastml-none`` or any recipe name after
``fastml-``.

The tuned plan: unless ``--tuned PLAN`` names one, ``fastml-autotune
recipes/autotune_transformers.py:workload_bench`` (this model, a ``Trainer`` target) runs first, in one
process outside the namespaces, with ``--link`` ``--tune-link`` (default 100mbit, the slow link) and
``--world-size 2``, plus ``--tune-args`` (default: short calibration, no local steps); its plan.json is kept
under ``benchmarks/out/bench_transformers_tune/`` (and copied beside the CSV as ``<csv>_plan.json``);
every link runs that one plan.

The link: as root, each link setting gets a private network namespace (``fm24b-<pid>``) whose loopback is
rate-limited with ``tc qdisc add dev lo root tbf rate R burst 512kb latency 100ms``; both ranks run
inside it and share the one link. ``none`` is the namespace without a limit: its ``plain`` step time
is the compute floor. Per row: the median ms per optimizer step after ``--warmup`` steps (timed between
``on_step_end`` events), the wire bytes per step the namespace's loopback counted (/proc/net/dev, both
ranks, TCP/IP headers included), the bytes FastML sent per step and rank (``fastml/bytes_per_step``;
plain: the fp32 ring's 2(W-1)/W x the gradient), the bound max(compute floor, wire bytes / link rate),
and the loss after the same number of steps (same data, same seed). Writes CSV (``--csv``, default
``benchmarks/results/bench_transformers_cpu.csv`` for the full run as root) with the machine and load
average on every row (``benchmarks/_bench.py``): on a shared machine compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _bench  # noqa: E402
from bench_allreduce import _lo_tx_bytes, _rate_bits, _run_quietly, _setup_ns  # noqa: E402

METHODS = ["plain", "fastml-int4", "fastml-tuned"]
LINKS = ["none", "1gbit", "100mbit"]
TUNE_TARGET = "recipes/autotune_transformers.py:workload_bench"  # width 256, 4 layers: this script's default
TUNE_ARGS = ("--no-local-steps --calibration-trials 4 --calibration-steps 30 --calibration-repeats 0 "
             "--references 2 --profile-steps 3 --measure-steps 3 --verify-rounds 0 --budget 20 "
             "--target-steps 5000")


# -- one method, one rank (under torchrun, inside the namespace) ------------------------------------------
def _worker(args) -> None:
    sys.path.insert(0, os.path.join(REPO, "recipes"))
    import torch.distributed as dist
    from train_transformers import ByteText, tiny_model
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import fastml_strategy.transformers

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.times: list = []
            self.wire: list = []

        def on_step_end(self, targs, state, control, **kw):
            self.times.append(time.perf_counter())
            self.wire.append(_lo_tx_bytes())

    plan, cap = None, None
    if args._run == "fastml-tuned":
        plan = args._plan
        with open(plan) as f:
            cap = ((json.load(f).get("meta") or {}).get("ddp") or {}).get("bucket_cap_mb")  # as its report says
    elif args._run.startswith("fastml-"):
        plan = args._run[len("fastml-"):]
    targs = TrainingArguments(output_dir=tempfile.mkdtemp(prefix="fm24b-"), max_steps=args.warmup + args.steps,
                              per_device_train_batch_size=8, learning_rate=3e-3, logging_steps=args.warmup + args.steps,
                              save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                              lr_scheduler_type="constant", ddp_bucket_cap_mb=cap)
    model = tiny_model(False, args.width, args.layers, 64)
    trainer = Trainer(model=model, args=targs, train_dataset=ByteText(argparse.__file__, 64))
    clock = Clock()
    trainer.add_callback(clock)
    cb = None
    if plan is not None:
        cb = fastml_strategy.transformers.setup(trainer, plan=plan, layer_metrics=False)
    trainer.train()
    w = args.warmup
    ms = [(b - a) * 1000 for a, b in zip(clock.times[w - 1:-1], clock.times[w:])]
    wire = (clock.wire[-1] - clock.wire[w - 1]) / max(1, len(ms))
    grad = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    world = dist.get_world_size()
    if cb is not None and cb.state is not None:
        s = cb.state.stats()
        sent = s["bytes_sent"] / max(1, s["steps"])
        ratio = s["compression_ratio"]
    else:
        sent, ratio = 2 * (world - 1) / world * grad, 1.0
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if dist.get_rank() == 0:
        with open(args._out, "w") as f:
            json.dump({"ms": ms, "wire_bytes": wire, "sent_bytes": sent, "ratio": ratio, "grad_bytes": grad,
                       "params": sum(p.numel() for p in model.parameters()), "loss": loss[-1] if loss else None,
                       "bucket_cap_mb": cap}, f)


# -- the tuned plan ---------------------------------------------------------------------------------------------
def _tune(args) -> str:
    """Run fastml-autotune on this benchmark's model (a Trainer target) for --tune-link; return plan.json."""
    if (args.width, args.layers) != (256, 4):
        raise SystemExit(f"bench_transformers: the plan is tuned on {TUNE_TARGET} (width 256, 4 layers); with "
                         f"--width {args.width} --layers {args.layers} pass --tuned PLAN tuned for that model")
    out = os.path.join(REPO, "benchmarks", "out", "bench_transformers_tune")
    cmd = [sys.executable, "-m", "fastml_strategy.autotune.cli", os.path.join(REPO, TUNE_TARGET), "--link",
           args.tune_link, "--world-size", "2", "--out", out, "--overwrite", "--quiet", *args.tune_args.split()]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
           "PYTHONPATH": os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    print(f"bench_transformers: tuning ({' '.join(cmd[3:])})", flush=True)
    t = time.monotonic()
    _run_quietly(cmd, timeout=3600, env=env)
    print(f"bench_transformers: tuned in {(time.monotonic() - t) / 60:.1f} min; {_bench.load_line()}", flush=True)
    return os.path.join(out, "plan.json")


# -- the driver -----------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=METHODS, help="plain, or fastml-RECIPE (fastml-int4...)")
    ap.add_argument("--links", nargs="+", default=LINKS, help="tc rates ('none': no limit); needs root")
    ap.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tuned", metavar="PLAN", default=None,
                    help="plan JSON for fastml-tuned (default: tune one with fastml-autotune first)")
    ap.add_argument("--tune-link", default="100mbit", help="the link the plan is tuned for (fastml-autotune --link)")
    ap.add_argument("--tune-args", default=TUNE_ARGS, help="further fastml-autotune options")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--_run", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    ap.add_argument("--_plan", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._run:
        _worker(args)
        return
    if os.geteuid() != 0:
        ap.error("shaping the loopback needs root (ip netns + tc); run as root")
    full = args.methods == METHODS and args.links == LINKS and args.steps == 8 and args.warmup == 3 \
        and args.width == 256 and args.layers == 4 and args.tune_args == TUNE_ARGS
    args.csv = args.csv or _bench.default_csv("bench_transformers_cpu.csv" if full else "bench_transformers.csv",
                                              full)
    env0 = _bench.environment()
    print(f"bench_transformers: {_bench.machine_line(env=env0)}; {_bench.load_line()}", flush=True)
    plan = None
    if "fastml-tuned" in args.methods:
        plan = os.path.abspath(args.tuned) if args.tuned else _tune(args)
        with open(plan) as f:
            meta = json.load(f).get("meta") or {}
        print(f"bench_transformers: tuned plan {plan} (option {meta.get('hardware_option', '?')}, target "
              f"{meta.get('target', '?')}; ddp bucket_cap_mb {(meta.get('ddp') or {}).get('bucket_cap_mb')})",
              flush=True)
    rows, floor = [], None
    for link in args.links:
        ns = f"fm24b-{os.getpid()}"
        _setup_ns(ns, None if link == "none" else link)
        try:
            for method in args.methods:
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                    out = f.name
                cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                       "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", "29524",
                       os.path.abspath(__file__), "--_run", method, "--_out", out, "--steps", str(args.steps),
                       "--warmup", str(args.warmup), "--width", str(args.width), "--layers", str(args.layers)]
                if method == "fastml-tuned":
                    cmd += ["--_plan", plan]
                env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TQDM_DISABLE": "1",
                       "PYTHONPATH": os.pathsep.join([REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(
                           os.pathsep) if p])}
                _run_quietly(cmd, timeout=1200, env=env)
                with open(out) as f:
                    res = json.load(f)
                os.unlink(out)
                med = statistics.median(res["ms"])
                if link == "none" and method == "plain":
                    floor = med
                rate = _rate_bits(link)
                wire_ms = res["wire_bytes"] * 8 / rate * 1000 if rate else float("nan")
                bound = max(floor or 0.0, wire_ms) if rate else (floor or med)
                rows.append({"link": link, "method": method, "ms_per_step": med, "ms_min": min(res["ms"]),
                             "ms_max": max(res["ms"]), "wire_mb_per_step": res["wire_bytes"] / 1e6,
                             "sent_mb_per_step_rank": res["sent_bytes"] / 1e6, "compression_ratio": res["ratio"],
                             "compute_floor_ms": floor, "wire_ms": wire_ms, "bound_ms": bound,
                             "x_bound": med / bound if bound else float("nan"), "loss_after": res["loss"],
                             "steps": args.warmup + args.steps, "params": res["params"],
                             "plan": os.path.relpath(plan, REPO) if method == "fastml-tuned" else method,
                             "bucket_cap_mb": res.get("bucket_cap_mb"),
                             "grad_mb": res["grad_bytes"] / 1e6, "load_avg_1m": os.getloadavg()[0],
                             "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
                print(f"{link:8s} {method:12s} {med:8.1f} ms/step  wire {res['wire_bytes'] / 1e6:6.2f} MB/step  "
                      f"sent {res['sent_bytes'] / 1e6:6.2f} MB/rank  bound {bound:7.1f} ms  x {med / bound:.2f}  "
                      f"loss {res['loss']:.4f}  (load {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
    _bench.write_csv(args.csv, rows, env0)
    print(f"wrote {args.csv}")
    if plan is not None and not args.tuned:  # tuned by this run: keep the plan its fastml-tuned rows ran
        shutil.copyfile(plan, args.csv[:-len(".csv")] + "_plan.json")
        print(f"wrote {args.csv[:-len('.csv')]}_plan.json (the tuned plan)")


if __name__ == "__main__":
    main()
