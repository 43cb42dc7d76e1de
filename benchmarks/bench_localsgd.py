"""Below 1 Gbit/s: wall time to a loss for DDP, compressed DDP and FastML's local steps.

    python benchmarks/bench_localsgd.py                    # as root: 5, 20 and 100 Mbit/s links + no limit
    python benchmarks/bench_localsgd.py --quick            # smoke test: tiny model, short curves (~2 min)
    python benchmarks/bench_localsgd.py --links 20mbit     # one emulated link (and no limit)
    python benchmarks/bench_localsgd.py                    # without root: "no link limit" figures only

Model and data: a GPT-style decoder borrowed from ``bench_fsdp.py`` (token + position embedding, 4 pre-LN
blocks of causal attention and a 4x GELU MLP, final layer norm, untied head; 2.2M parameters by
default), trained on ``bench_fsdp.py``'s synthetic bigram language (512 active token ids, each followed
by one of 4 fixed successors: the loss falls from ln(vocab) towards ln 4). Every batch is drawn fresh
(rank and step seed it), so a training loss is an unbiased estimate of the model's expected loss.
2 ranks x 1 thread, gloo, the same inner optimizer everywhere (fused AdamW, constant lr 1e-3: the best of
5e-4, 1e-3, 2e-3 and 3e-3 for DDP fp32 at step 300, smoothed loss 1.82, 1.74, 2.29 and 4.58 at step 275 in
one run each, so the baseline is not handicapped by a learning rate that an outer optimizer could make up).

Methods: DDP fp32; DDP with torch's ``fp16_compress_hook``; FastML int4 every step
(``fastml_strategy.register_hook``); FastML local steps (``fastml_strategy.LocalSGD``: no DDP, int4
pseudo-gradients with error feedback, an outer step every H inner steps) for H = 10 and 50, each whole
(F=1) and streaming (``fragments=F, delay=D``: the model synchronised in F staggered fragments, each
applied D inner steps after its communication starts, which overlaps them).

The metric: wall time to reach the loss that DDP fp32 reaches after N inner steps. Steps-to-loss does
not depend on the link for a given method, so it is measured ONCE with no link limit, and multiplied by
the step time measured on each emulated link:

1. Curves (no link limit, one torchrun job): DDP fp32 runs N + S/2 steps; its smoothed loss at step N is
   the target. Every other method runs until its smoothed loss reaches the target (or ``--max-mult`` x N
   steps). The smoothing: the per-step training loss averaged over the 2 ranks, then a centred moving
   mean over S = 50 steps (``--window``). 50 is a multiple of both H, so every smoothed point averages
   the same phases of the local steps' sawtooth (the loss of the local models drifts between two
   synchronisations), and a centred window adds no lag. Steps to the target: the first step whose
   smoothed loss is <= the target (DDP fp32's own can come a little before N, by noise).
   The outer optimizer of the local steps is chosen here by measurement: for each H, each candidate of
   ``--outer-candidates`` runs whole (F=1), the one with the fewest steps to the target wins (ties: the
   earlier candidate), and the streaming variant of that H uses it. The table lists every candidate.
2. Step time (one torchrun job per link): as root, both ranks run in a private network namespace whose
   loopback is shaped with ``tc qdisc add dev lo root tbf rate R burst 512kb latency 100ms`` (as
   ``bench_allreduce.py`` does), so they share one R link; plus a namespace with no limit. DDP methods:
   median over ``--timed`` steps (after warm-up) of the slowest rank's step, every step starting at a
   barrier. Local steps: synchronisations are bursty, so a step's time is the MEAN over a whole H period
   (the slowest rank's; no barrier inside), and the figure is the median over >= 3 periods (>= 40 steps)
   after a warm-up period.
   Bytes on the link are the namespace's loopback counter (both ranks, headers included) over the
   timed steps.

Per row: steps to target, ms per step, time to target = steps x ms per step, how much sooner than DDP
fp32 and than FastML int4 every step, the bytes each rank sends per step (FastML's ``stats()``; for DDP's
rows 2(W-1)/W, what a ring all-reduce sends per rank, times the bytes handed to the all-reduce per step,
measured: DDP fp32's bucket buffers, the tensors torch's fp16 hook passes to
``torch.distributed.all_reduce`` counted by ``_bench.CollectiveBytes``) and DDP fp32's bytes over them;
"compression" is the gradient bytes over the bytes handed to the collective (FastML: ``stats()``), the bytes
that crossed the link per step and that over the link rate ("wire ms": the physical bound of the
communication), the compute (the same method with no limit) and the bound max(compute, wire) (perfect
overlap) with the measured step over it.

Without root the links cannot be shaped: the script then runs on the host's loopback and labels every
figure "no link limit". The namespaces (and anything started in them) are removed at the end, on
failure and on SIGINT/SIGTERM too. Prints markdown tables, writes CSV (``--csv``; by default
``benchmarks/results/bench_localsgd_cpu.csv`` for the full run as root with every default,
``benchmarks/out/`` otherwise) and the
smoothed curves (``benchmarks/out/bench_localsgd_*_curves.json``), atomically; every CSV row carries the
machine (CPU model, SIMD flags, cores), Python, torch and the load average before and after
(``benchmarks/_bench.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# Benchmarks are scripts: the GPT model, its synthetic language and the machine description are
# bench_fsdp.py's (its import is light: no torch at module level).
import _bench  # noqa: E402
from bench_fsdp import (_CHILDREN, _NAMESPACES, _bigram_batch, _cleanup, _fmt, _machine, _model,  # noqa: E402
                        _net_bytes, _rate_bits, _sh, _stop)

# -- what is measured ------------------------------------------------------------------------------------------
# method -> (label, kind, settings). kind "ddp": DDP with hook None / "fp16" / "fastml" (int4);
# kind "local": LocalSGD with every (H), fragments (F), delay (D); its outer settings come from the curves.
METHODS = {
    "ddp-fp32": ("DDP fp32", "ddp", {"hook": None}),
    "ddp-fp16": ("DDP + torch fp16 hook", "ddp", {"hook": "fp16"}),
    "fastml-int4": ("FastML int4 every step", "ddp", {"hook": "fastml"}),
    "local-h10": ("FastML local steps H=10", "local", {"every": 10, "fragments": 1, "delay": 0}),
    "local-h10-stream": ("FastML local steps H=10, streaming", "local", {"every": 10, "stream": True}),
    "local-h50": ("FastML local steps H=50", "local", {"every": 50, "fragments": 1, "delay": 0}),
    "local-h50-stream": ("FastML local steps H=50, streaming", "local", {"every": 50, "stream": True}),
}
# Streaming settings (F fragments, delay D < H / F) per H; --stream overrides them.
STREAM = {10: (2, 2), 50: (5, 5)}
# Outer optimizers to choose from, by steps to the target: name -> (outer, lr, momentum).
OUTERS = {
    "avg": ("sgd", 1.0, 0.0),              # plain averaging of the local models
    "nesterov-0.7-0.6": ("nesterov", 0.7, 0.6),
    "diloco": ("nesterov", 0.7, 0.9),      # DiLoCo's (arXiv 2311.08105)
}
LINKS = ["5mbit", "20mbit", "100mbit"]
QUICK_LINKS, QUICK_OUTERS = ["20mbit"], ["avg", "diloco"]  # --quick: one link, two outer candidates

FULL = dict(layers=4, d_model=192, heads=6, vocab=1024, seq=32, batch=8, n_target=300, max_mult=3, window=50,
            timed=3, warmup=1, timed_nolimit=10, warmup_nolimit=3, min_local_steps=40)
QUICK = dict(layers=4, d_model=64, heads=4, vocab=512, seq=32, batch=8, n_target=100, max_mult=3, window=50,
             timed=2, warmup=1, timed_nolimit=5, warmup_nolimit=2, min_local_steps=20)
CHECK_EVERY = 10  # curves: the ranks agree on the mean loss every this many steps (one small all_reduce)


# ======================================================================================================
# The worker: one rank (runs under torchrun, inside a namespace when shaped)
# ======================================================================================================
def _centred(means: list, window: int) -> list:
    """Centred moving mean: out[t] (t = inner steps done, 1-based) averages steps t - S/2 + 1 .. t + S/2;
    None where the window does not fit."""
    half = window // 2
    out = [None] * (len(means) + 1)
    if len(means) < window:
        return out
    acc = sum(means[:window])
    for t in range(half, len(means) - half + 1):
        if t > half:
            acc += means[t + half - 1] - means[t - half - 1]
        out[t] = acc / window
    return out


def _steps_to(smoothed: list, target: float) -> int | None:
    return next((t for t, v in enumerate(smoothed) if v is not None and v <= target), None)


class _Run:
    """One method's model, optimizer and (DDP hook or LocalSGD) on this rank."""

    def __init__(self, cfg: dict, method: str, outer: tuple | None) -> None:
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        import fastml_strategy as fm

        _label, kind, s = METHODS[method]
        self.kind, self.method, self.cfg = kind, method, cfg
        torch.manual_seed(cfg["seed"])  # the same initial model on every rank and for every method
        self.model = _model(cfg)
        self.params = sum(p.numel() for p in self.model.parameters())
        self.state = self.local = None
        self.every = 1
        # torch's fp16 hook calls torch.distributed.all_reduce: count what it hands over, per step
        self.counter = _bench.CollectiveBytes() if kind == "ddp" and s["hook"] == "fp16" else None
        self.counted_steps = 0
        if kind == "ddp":
            self.net = DDP(self.model)
            if s["hook"] == "fp16":
                from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

                self.net.register_comm_hook(dist.group.WORLD, default_hooks.fp16_compress_hook)
            elif s["hook"] == "fastml":
                self.state = fm.register_hook(self.net, plan="int4", layer_stats_every=0)
            self.inner = torch.optim.AdamW(self.net.parameters(), lr=cfg["lr"], weight_decay=0.0, fused=True)
        else:
            self.net = self.model
            self.inner = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], weight_decay=0.0, fused=True)
            self.every = s["every"]
            fr, delay = (cfg["stream"][str(self.every)] if s.get("stream") else (s["fragments"], s["delay"]))
            name, lr, mom = outer
            self.fragments, self.delay = fr, delay
            self.local = fm.LocalSGD(self.model, self.inner, every=self.every, outer=name, outer_lr=lr,
                                     outer_momentum=mom, plan="int4", fragments=fr, delay=delay,
                                     layer_stats_every=0)

    def step(self, step: int, rank: int) -> tuple:
        """One inner step on this rank's batch; returns (loss, seconds)."""
        import torch.nn.functional as F

        c = self.cfg
        x, y = _bigram_batch(c["vocab"], c["batch"], c["seq"], seed=c["seed"] + 1 + rank, step=step)
        t0 = time.perf_counter()
        loss = F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())
        if self.counter is not None:
            with self.counter:  # only the step's own all-reduces (not the loss averaging between steps)
                loss.backward()
            self.counted_steps += 1
        else:
            loss.backward()
        self.inner.step()
        self.inner.zero_grad(set_to_none=True)
        if self.local is not None:
            self.local.step()
        return float(loss), time.perf_counter() - t0

    def handed_per_step(self) -> float:
        """DDP without FastML: the bytes handed to the all-reduce per step, measured (the fp16 hook's
        tensors as counted; DDP fp32's bucket buffers, each all-reduced once per step)."""
        if self.counter is not None:
            return self.counter.bytes / max(1, self.counted_steps)
        return float(_bench.ddp_bucket_bytes(self.net) or "nan")

    def bytes_per_step(self, steps: int) -> float:
        """Bytes this rank sent per inner step (gradients or pseudo-gradients; for DDP's own all-reduce,
        what a ring sends per rank, 2(W-1)/W, of the bytes measured as handed to it)."""
        import torch.distributed as dist

        if self.local is not None:
            return self.local.stats()["bytes_per_inner_step"]
        if self.state is not None:
            s = self.state.stats()
            return s["bytes_sent"] / max(1, s["steps"])
        W = dist.get_world_size()
        return 2.0 * (W - 1) / W * self.handed_per_step()

    def compression(self) -> float | None:
        """Gradient bytes over the bytes handed to the collective (FastML: its own ``stats()``)."""
        if self.local is not None:
            return self.local.stats()["compression_ratio"]
        if self.state is not None:
            return self.state.stats()["compression_ratio"]
        return _bench.grad_bytes(self.model) / self.handed_per_step()

    def close(self) -> None:
        if self.local is not None:
            self.local.close()
        if self.state is not None:
            self.state.close()


def _curve(cfg: dict, method: str, outer: tuple | None, max_steps: int, target: float | None) -> dict:
    """Train ``method`` with no link limit until its smoothed loss reaches ``target`` (or max_steps), and
    for at least N + S/2 steps (so its smoothed loss at step N, DDP fp32's target step, is known);
    returns the per-step mean loss over the ranks and the timings."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    run = _Run(cfg, method, outer)
    S = cfg["window"]
    least = cfg["n_target"] + S // 2
    own, means, secs = [], [], []
    reached = None
    t_start = time.perf_counter()
    for step in range(max_steps):
        loss, sec = run.step(step, rank)
        own.append(loss)
        secs.append(sec)
        if (step + 1) % CHECK_EVERY == 0 or step + 1 == max_steps:
            t = torch.tensor(own[len(means):], dtype=torch.float64)
            dist.all_reduce(t)  # every rank gets the same means, so every rank stops at the same step
            means.extend((t / world).tolist())
            if target is not None:
                reached = _steps_to(_centred(means, S), target)
                if reached is not None and len(means) >= least:
                    break
    wall = time.perf_counter() - t_start
    out = {"method": method, "outer": outer, "steps_run": len(means), "means": means,
           "steps_to_target": reached, "loss_at_n": _centred(means, S)[cfg["n_target"]],
           "bytes_per_step_rank": run.bytes_per_step(len(means)),
           "compression_ratio": run.compression(), "params": run.params, "wall_s": wall,
           "ms_per_step_rank": 1000 * sum(secs) / len(secs)}
    run.close()
    dist.barrier()
    return out


def _phase_curves(a: argparse.Namespace, cfg: dict) -> dict:
    import torch.distributed as dist

    N, S = cfg["n_target"], cfg["window"]
    rank = dist.get_rank()
    log = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
    runs = []
    ref = _curve(cfg, "ddp-fp32", None, N + S // 2, None)
    target = _centred(ref["means"], S)[N]
    ref["steps_to_target"] = _steps_to(_centred(ref["means"], S), target)
    runs.append(ref)
    log(f"curves: ddp-fp32 smoothed loss at step {N}: {target:.4f} (the target); "
        f"{ref['ms_per_step_rank']:.0f} ms/step")
    max_steps = cfg["max_mult"] * N
    chosen = {}
    for method in cfg["methods"]:
        if method == "ddp-fp32":
            continue
        _label, kind, s = METHODS[method]
        if kind == "ddp":
            r = _curve(cfg, method, None, max_steps, target)
            runs.append(r)
            log(f"curves: {method} reached it at step {r['steps_to_target']} ({r['wall_s']:.0f} s)")
            continue
        H = s["every"]
        if str(H) not in chosen:  # the first local method of this H: measure the outer candidates
            best = None
            for name in cfg["outer_candidates"]:
                r = _curve(cfg, f"local-h{H}" if f"local-h{H}" in METHODS else method, OUTERS[name],
                           max_steps, target)
                r["outer_name"] = name
                r["candidate"] = True
                runs.append(r)
                key = (r["steps_to_target"] is None, r["steps_to_target"] or 0,
                       statistics.fmean(r["means"][-S:]))
                log(f"curves: local H={H} outer {name}: reached it at step {r['steps_to_target']} "
                    f"({r['wall_s']:.0f} s)")
                if best is None or key < best[0]:
                    best = (key, name)
            chosen[str(H)] = best[1]
            log(f"curves: H={H}: outer {best[1]} chosen")
        if s.get("stream"):
            r = _curve(cfg, method, OUTERS[chosen[str(H)]], max_steps, target)
            r["outer_name"] = chosen[str(H)]
            runs.append(r)
            log(f"curves: {method} (outer {chosen[str(H)]}) reached it at step {r['steps_to_target']} "
                f"({r['wall_s']:.0f} s)")
    return {"target": target, "chosen": chosen, "runs": runs}


def _phase_time(a: argparse.Namespace, cfg: dict, link: str | None) -> list:
    """Step time of each method on this job's link."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    iface = os.environ.get("FASTML_BENCH_IFACE") if rank == 0 else None
    out = []
    for method in cfg["methods"]:
        _label, kind, s = METHODS[method]
        outer = OUTERS[cfg["chosen"][str(s["every"])]] if kind == "local" else None
        run = _Run(cfg, method, outer)
        step = 0
        if kind == "ddp":
            warm, timed = ((cfg["warmup"], cfg["timed"]) if link else (cfg["warmup_nolimit"], cfg["timed_nolimit"]))
            secs, net0 = [], None
            for i in range(warm + timed):
                dist.barrier()
                if i == warm:
                    net0 = _net_bytes(iface)
                _, sec = run.step(step, rank)
                step += 1
                if i >= warm:
                    secs.append(sec)
            dist.barrier()
            net1 = _net_bytes(iface)
            mine = {"secs": secs}
            n_timed = timed
        else:
            H = run.every
            periods = max(3, math.ceil(cfg["min_local_steps"] / H))
            for _ in range(H):  # a whole warm-up period: every fragment synchronised once
                run.step(step, rank)
                step += 1
            dist.barrier()
            net0 = _net_bytes(iface)
            secs = []
            for _ in range(periods):  # no barrier: the ranks meet only in the synchronisations
                t0 = time.perf_counter()
                for _ in range(H):
                    run.step(step, rank)
                    step += 1
                secs.append((time.perf_counter() - t0) / H)  # the mean step of one whole period
            net1 = _net_bytes(iface)  # periodic steady state: what is in flight at both ends is alike
            dist.barrier()
            n_timed = periods * H
            mine = {"secs": secs}
        mine["bytes_per_step_rank"] = run.bytes_per_step(step)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        # DDP: median of the slowest rank's steps; local steps: median of the slowest rank's period means
        ms = 1000 * statistics.median(max(g["secs"][i] for g in gathered) for i in range(len(secs)))
        wire = (net1 - net0) / n_timed if (net0 is not None and net1 is not None) else None
        out.append({"method": method, "link": link or "none", "ms_per_step": ms, "timed_steps": n_timed,
                    "wire_bytes_per_step": wire, "bytes_per_step_rank": gathered[0]["bytes_per_step_rank"],
                    "compression_ratio": run.compression(), "params": run.params,
                    "outer": cfg["chosen"][str(s["every"])] if kind == "local" else "",
                    "fragments": getattr(run, "fragments", ""), "delay": getattr(run, "delay", "")})
        if rank == 0:
            print(f"time: {link or 'no limit':8s} {method:18s} {ms:9.1f} ms/step (over {n_timed} steps)"
                  f"  wire {_fmt(wire / 1e6 if wire else None, '.3f')} MB/step", flush=True)
        run.close()
        dist.barrier()
    return out


def _worker(a: argparse.Namespace) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=30))
    cfg = json.loads(a.cfg)
    if a.phase == "curves":
        res = _phase_curves(a, cfg)
    else:
        res = _phase_time(a, cfg, a.link or None)
    if dist.get_rank() == 0:
        with open(a._out, "w") as f:
            json.dump(res, f)
    dist.barrier()
    dist.destroy_process_group()


# ======================================================================================================
# The driver: namespaces, launches, tables
# ======================================================================================================
# What torch's c10d prints in a fresh namespace (it cannot resolve the client's name; harmless)
_NOISE = ("[c10d] The hostname of the client socket cannot be retrieved",)


def _on_signal(signum, frame):  # noqa: ARG001
    raise SystemExit(f"bench_localsgd: signal {signum}, cleaning up")


def _launch(link: str | None, root: bool, worker_args: list[str], out: str, timeout: float, log_path: str):
    """One torchrun job of 2 ranks: in a fresh namespace (shaped to ``link``, or not) as root, else on the
    host's loopback. Returns the JSON rank 0 wrote."""
    import socket

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # this checkout's package, installed or not
    prefix, env = [], dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
                           PYTHONPATH=os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")])))
    if root:
        ns = f"fmls{os.getpid() % 100000}{link or 'none'}"
        _NAMESPACES.append(ns)
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if link:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", link,
                "burst", "512kb", "latency", "100ms")
        prefix = ["ip", "netns", "exec", ns]
        env["FASTML_BENCH_IFACE"] = "lo"  # the namespace's own loopback: only this job's traffic
        port = 29500
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    cmd = prefix + [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(port), os.path.abspath(__file__),
                    *worker_args, "--_out", out]
    try:
        with open(log_path, "w") as log:
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 errors="replace", start_new_session=True)
            _CHILDREN.append(p)
            deadline = time.monotonic() + timeout
            import threading

            timer = threading.Timer(timeout, lambda: _stop(p))
            timer.start()
            try:
                assert p.stdout is not None
                for line in p.stdout:  # rank 0's progress lines go to the console, everything to the log
                    log.write(line)
                    if line.startswith(("curves:", "time:")):
                        print("  " + line.rstrip(), flush=True)
                p.wait(timeout=max(1.0, deadline - time.monotonic()))
            finally:
                timer.cancel()
                _stop(p)
                _CHILDREN.remove(p)
    finally:
        if root:
            subprocess.run(["ip", "netns", "del", prefix[-1]], stderr=subprocess.DEVNULL)
            _NAMESPACES.remove(prefix[-1])
    # torchrun agents may report an exit-barrier error at teardown: the result file is what counts
    if not os.path.exists(out) or os.path.getsize(out) == 0:
        with open(log_path) as f:
            tail = "".join(line for line in f.readlines()[-80:] if not any(n in line for n in _NOISE))
        raise RuntimeError(f"bench_localsgd: {worker_args[:4]} on {link or 'no limit'} gave no result "
                           f"(exit code {p.returncode}); log {log_path}:\n{tail}")
    with open(out) as f:
        return json.load(f)


def _label(method: str, curves: dict, cfg: dict) -> str:
    label, kind, s = METHODS[method]
    if kind != "local":
        return label
    H = s["every"]
    fr, d = (cfg["stream"][str(H)] if s.get("stream") else (1, 0))
    outer = curves["chosen"][str(H)]
    bits = [f"F={fr}, delay {d}" if s.get("stream") else "F=1", f"outer {outer}"]
    return label.replace(", streaming", "") + f" ({', '.join(bits)})"


def _tables(curves: dict, times: list, cfg: dict, links: list, root: bool) -> tuple[str, list]:
    """The markdown tables and the CSV rows."""
    runs = {r["method"]: r for r in curves["runs"] if not r.get("candidate")}
    for r in curves["runs"]:  # the whole local rows are the chosen candidate's curve
        if r.get("candidate") and curves["chosen"].get(str(METHODS[r["method"]][2]["every"])) == r["outer_name"]:
            runs[r["method"]] = r
    by = {(t["link"], t["method"]): t for t in times}
    methods = [m for m in cfg["methods"] if m in runs]
    ddp_bytes = runs["ddp-fp32"]["bytes_per_step_rank"]  # measured: 2(W-1)/W x DDP's bucket bytes
    out, rows = [], []
    for link in links:
        where = link or "none"
        rate = _rate_bits(link) if link else None
        title = f"{link.replace('mbit', ' Mbit/s')} link shared by both ranks" if link else \
            ("no link limit (a namespace with an unshaped loopback)" if root else "no link limit (host loopback)")
        out.append(f"\n### {title}\n")
        hdr = ["method", "steps to target", "ms/step", "time to target (s)", "x sooner than DDP fp32",
               "x sooner than int4 every step", "bytes/step/rank", "x fewer bytes than DDP fp32"]
        if link:
            hdr += ["link MB/step", "wire ms (bound)", "compute ms (no limit)", "bound max(compute, wire)",
                    "measured / bound"]
        out.append("| " + " | ".join(hdr) + " |")
        out.append("|" + "---|" * len(hdr))
        ref_t = {}
        for m in ("ddp-fp32", "fastml-int4"):
            if (where, m) in by and runs.get(m, {}).get("steps_to_target"):
                ref_t[m] = runs[m]["steps_to_target"] * by[(where, m)]["ms_per_step"] / 1000
        for m in methods:
            t = by.get((where, m))
            if t is None:
                continue
            steps = runs[m]["steps_to_target"]
            tt = steps * t["ms_per_step"] / 1000 if steps else None
            bps = t["bytes_per_step_rank"]
            wire = t["wire_bytes_per_step"]
            wire_ms = wire * 8 / rate * 1000 if (wire is not None and rate) else None
            comp = by.get(("none", m), {}).get("ms_per_step")
            bound = max(comp, wire_ms) if (comp is not None and wire_ms is not None) else None
            cells = [_label(m, curves, cfg),
                     str(steps) if steps else f"not in {runs[m]['steps_run']}",
                     _fmt(t["ms_per_step"]), _fmt(tt, ".1f"),
                     _fmt(ref_t["ddp-fp32"] / tt if tt and "ddp-fp32" in ref_t else None, ".2f"),
                     _fmt(ref_t["fastml-int4"] / tt if tt and "fastml-int4" in ref_t else None, ".2f"),
                     _fmt(bps / 1e3, ".1f") + " kB", _fmt(ddp_bytes / bps, ".1f")]
            if link:
                cells += [_fmt(wire / 1e6 if wire is not None else None, ".3f"), _fmt(wire_ms), _fmt(comp),
                          _fmt(bound), _fmt(t["ms_per_step"] / bound if bound else None, ".2f")]
            out.append("| " + " | ".join(cells) + " |")
            rows.append({"table": "time_to_loss", "link": where, "method": m, "label": _label(m, curves, cfg),
                         "outer": t["outer"], "fragments": t["fragments"], "delay": t["delay"],
                         "steps_to_target": steps or "", "steps_run": runs[m]["steps_run"],
                         "target_loss": curves["target"], "ms_per_step": t["ms_per_step"],
                         "timed_steps": t["timed_steps"], "time_to_target_s": tt if tt else "",
                         "x_vs_ddp_fp32": ref_t["ddp-fp32"] / tt if tt and "ddp-fp32" in ref_t else "",
                         "x_vs_fastml_int4": ref_t["fastml-int4"] / tt if tt and "fastml-int4" in ref_t else "",
                         "bytes_per_step_rank": bps, "x_fewer_bytes_vs_ddp_fp32": ddp_bytes / bps,
                         "compression_ratio": t["compression_ratio"] or "",
                         "link_bytes_per_step": wire if wire is not None else "",
                         "wire_ms": wire_ms if wire_ms is not None else "", "compute_ms": comp or "",
                         "bound_ms": bound or "", "params": t["params"]})
        if link:
            out.append(_targets(link, runs, by, ref_t, ddp_bytes, methods))
    # every curve: steps to the target, and the loss at DDP's step N
    N = cfg["n_target"]
    out.append(f"\n### Steps to the target, no link limit (outer optimizer of the local steps chosen here)\n")
    out.append(f"| method | outer (lr, momentum) | steps to target | x DDP fp32's steps | smoothed loss at step "
               f"{N} | chosen |")
    out.append("|---|---|---|---|---|---|")
    ref_steps = runs["ddp-fp32"]["steps_to_target"]
    for r in curves["runs"]:
        m = r["method"]
        kind = METHODS[m][1]
        name = r.get("outer_name", "")
        H = METHODS[m][2].get("every")
        pick = kind == "local" and curves["chosen"].get(str(H)) == name
        label = METHODS[m][0] if kind == "ddp" else (
            _label(m, curves, cfg).split(" (")[0] + (f" (F={cfg['stream'][str(H)][0]}, delay "
                                                     f"{cfg['stream'][str(H)][1]})" if METHODS[m][2].get("stream")
                                                     else " (F=1)"))
        o = OUTERS[name] if name else None
        steps = r["steps_to_target"]
        out.append("| " + " | ".join([
            label, f"{name}: {o[0]} ({o[1]:g}, {o[2]:g})" if o else "-",
            str(steps) if steps else f"not in {r['steps_run']}",
            _fmt(steps / ref_steps if steps and ref_steps else None, ".2f"),
            _fmt(r["loss_at_n"], ".4f") + (" (target)" if m == "ddp-fp32" else ""),
            "yes" if (pick and r.get("candidate")) else ""]) + " |")
        rows.append({"table": "steps_to_target", "link": "none", "method": m, "label": label, "outer": name,
                     "fragments": (cfg["stream"][str(H)][0] if METHODS[m][2].get("stream") else 1) if H else "",
                     "delay": (cfg["stream"][str(H)][1] if METHODS[m][2].get("stream") else 0) if H else "",
                     "steps_to_target": steps or "", "steps_run": r["steps_run"], "target_loss": curves["target"],
                     "loss_at_n": r["loss_at_n"], "chosen": bool(pick and r.get("candidate")),
                     "ms_per_step": r["ms_per_step_rank"]})
    return "\n".join(out), rows


def _targets(link: str, runs: dict, by: dict, ref_t: dict, ddp_bytes: float, methods: list) -> str:
    """Issue 13's targets on this link (each: the best local-steps row)."""
    local = [m for m in methods if METHODS[m][1] == "local" and runs[m]["steps_to_target"] and (link, m) in by]
    if not local:
        return ""
    tt = {m: runs[m]["steps_to_target"] * by[(link, m)]["ms_per_step"] / 1000 for m in local}
    best = min(local, key=tt.get)
    lines = []
    if link == "20mbit" and "ddp-fp32" in ref_t:
        x = ref_t["ddp-fp32"] / tt[best]
        lines.append(f"best local steps ({best}) {x:.1f}x sooner than DDP fp32 (target >= 5: "
                     f"{'met' if x >= 5 else 'MISSED'})")
    if link == "5mbit" and "fastml-int4" in ref_t:
        x = ref_t["fastml-int4"] / tt[best]
        lines.append(f"best local steps ({best}) {x:.1f}x sooner than FastML int4 every step (target >= 2: "
                     f"{'met' if x >= 2 else 'MISSED'})")
    if link == "20mbit":
        few = {m: ddp_bytes / by[(link, m)]["bytes_per_step_rank"] for m in local}
        ok = [m for m in local if few[m] >= 100]
        lines.append("bytes per step >= 100x fewer than DDP fp32: " +
                     ", ".join(f"{m} {few[m]:.0f}x ({'met' if m in ok else 'missed'})" for m in local))
    return ("\nTargets: " + "; ".join(lines) + ".") if lines else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, short curves: a smoke test (~2 min)")
    ap.add_argument("--links", nargs="+", default=None, help=f"tc rates to emulate (default {' '.join(LINKS)}; "
                    f"--quick: {QUICK_LINKS[0]}); 'none' alone: no shaped link")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--outer-candidates", nargs="+", default=None, choices=list(OUTERS),
                    help=f"outer optimizers to measure for each H, the fewest steps to the target wins (default "
                         f"all; --quick: {' '.join(QUICK_OUTERS)})")
    ap.add_argument("--stream", nargs="+", default=None, metavar="H:F:D",
                    help=f"streaming settings per H: F fragments, delay D (default "
                         f"{' '.join(f'{h}:{f}:{d}' for h, (f, d) in STREAM.items())})")
    for k in FULL:
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None,
                        help=f"default {FULL[k]} (--quick: {QUICK[k]})")
    ap.add_argument("--lr", type=float, default=1e-3, help="inner AdamW learning rate (every method)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per torchrun job")
    ap.add_argument("--csv", default=None, help="default benchmarks/results/bench_localsgd_cpu.csv for the full "
                    "run as root (every default), benchmarks/out/bench_localsgd_{quick,root,nolimit}.csv otherwise")
    # the worker's arguments (torchrun starts this file again with them)
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_phase", dest="phase", help=argparse.SUPPRESS)
    ap.add_argument("--_link", dest="link", default="", help=argparse.SUPPRESS)
    ap.add_argument("--_cfg", dest="cfg", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        _worker(a)
        return

    preset = QUICK if a.quick else FULL
    cfg = {k: (getattr(a, k) if getattr(a, k) is not None else preset[k]) for k in FULL}
    stream = dict(STREAM)
    for spec in a.stream or []:
        h, f, d = (int(v) for v in spec.split(":"))
        stream[h] = (f, d)
    methods = [m for m in METHODS if m in a.methods]
    if "ddp-fp32" not in methods:
        ap.error("--methods must include ddp-fp32: its loss after N steps is the target")
    cfg.update(lr=a.lr, seed=a.seed, methods=methods,
               outer_candidates=a.outer_candidates or (QUICK_OUTERS if a.quick else list(OUTERS)),
               stream={str(h): v for h, v in stream.items()})
    if cfg["window"] % 2 or any(cfg["window"] % METHODS[m][2]["every"] for m in methods
                                if METHODS[m][1] == "local"):
        ap.error(f"--window {cfg['window']} must be even and a multiple of every H measured, so each smoothed "
                 f"point averages whole periods")
    links = [ln for ln in (a.links or (QUICK_LINKS if a.quick else LINKS)) if ln != "none"]
    for ln in links:
        _rate_bits(ln)  # a clear error for a malformed rate, before anything starts
    root = os.geteuid() == 0
    if not root and links:
        print("bench_localsgd: not root, so the links cannot be shaped (ip netns + tc need root): every rank "
              "runs on this host's loopback and the figures are labelled 'no link limit'.", file=sys.stderr)
        links = []
    # benchmarks/results/ only for the run the docs quote (every default, as root)
    full = (root and links and not a.quick and a.links is None and methods == list(METHODS) and not a.stream
            and a.outer_candidates is None and all(getattr(a, k) is None for k in FULL))
    csv_path = a.csv or ("benchmarks/out/bench_localsgd_quick.csv" if a.quick else
                         "benchmarks/results/bench_localsgd_cpu.csv" if full else
                         "benchmarks/out/bench_localsgd_root.csv" if root and links else
                         "benchmarks/out/bench_localsgd_nolimit.csv")
    machine = _machine()
    load0 = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"bench_localsgd: {started:%Y-%m-%d %H:%M} UTC; {machine}; load average {load0[0]:.2f} "
          f"{load0[1]:.2f} {load0[2]:.2f}", flush=True)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_signal)
    logdir = tempfile.mkdtemp(prefix="bench_localsgd_")
    t_all = time.monotonic()
    try:
        print("1. steps to the target loss, no link limit", flush=True)
        curves = _launch(None, root, ["--_worker", "--_phase", "curves", "--_cfg", json.dumps(cfg)],
                         os.path.join(logdir, "curves.json"), a.timeout, os.path.join(logdir, "curves.log"))
        cfg["chosen"] = curves["chosen"]
        times = []
        for link in links + [None]:
            print(f"2. step time, {link or 'no link limit'}", flush=True)
            tag = link or "none"
            times += _launch(link, root, ["--_worker", "--_phase", "time", "--_link", link or "",
                                          "--_cfg", json.dumps(cfg)],
                             os.path.join(logdir, f"time-{tag}.json"), a.timeout,
                             os.path.join(logdir, f"time-{tag}.log"))
    finally:
        _cleanup()
    load1 = os.getloadavg()

    tables, rows = _tables(curves, times, cfg, links + [None], root)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    _bench.write_csv(csv_path, [dict({k: r.get(k, "") for k in fields}, n_target=cfg["n_target"],
                                     window=cfg["window"], lr=cfg["lr"], date_utc=f"{started:%Y-%m-%d %H:%M}",
                                     machine=machine, load_before=f"{load0[0]:.2f}",
                                     load_after=f"{load1[0]:.2f}") for r in rows])
    curves_path = os.path.join("benchmarks", "out", os.path.basename(csv_path).replace(".csv", "_curves.json"))
    from fastml_strategy._io import atomic_open

    with atomic_open(curves_path) as f:
        json.dump({"cfg": cfg, **curves}, f)

    r0 = curves["runs"][0]
    cmd = " ".join(["python", "benchmarks/bench_localsgd.py", *sys.argv[1:]])
    print(f"\n## Time to a loss below 1 Gbit/s: local steps against DDP (`benchmarks/bench_localsgd.py`)\n")
    print(f"`{cmd}` ({started:%Y-%m-%d %H:%M} UTC, {time.monotonic() - t_all:.0f} s; {machine}; a shared "
          f"machine: load average {load0[0]:.2f} before, {load1[0]:.2f} after). GPT-style decoder "
          f"({cfg['layers']} blocks, d {cfg['d_model']}, vocabulary {cfg['vocab']}; {r0['params'] / 1e6:.2f}M "
          f"parameters) on a synthetic bigram language, batch {cfg['batch']} x {cfg['seq']} tokens per rank, "
          f"2 ranks x 1 thread, gloo, AdamW lr {cfg['lr']:g} for every method.")
    print(f"\n**Target**: the loss DDP fp32 reaches after N = {cfg['n_target']} steps, "
          f"{curves['target']:.4f} (training loss averaged over the ranks, centred moving mean over "
          f"{cfg['window']} steps). **Steps to target are measured once with no link limit; time to target = "
          f"steps x ms/step measured on each link.** ms/step: DDP methods, median of the slowest rank's "
          f"step ({cfg['timed']} steps after {cfg['warmup']} warm-up on a shaped link, {cfg['timed_nolimit']} "
          f"with no limit); local steps, the mean step over a whole H period (syncs are bursty), median of "
          f">= 3 periods. "
          + ("Links: both ranks in a network namespace whose loopback is shaped with `tc qdisc add dev lo root "
             "tbf rate R burst 512kb latency 100ms`; link MB/step is the loopback's counter (both ranks, "
             "headers included), wire ms that over the rate: the physical bound; compute is the same method "
             "with no limit." if links else
             "**No link limit**: links not shaped (that needs root), so these are not the issue's figures."))
    print(tables)
    print(f"\nCSV: {csv_path}; curves: {curves_path}")


if __name__ == "__main__":
    main()
