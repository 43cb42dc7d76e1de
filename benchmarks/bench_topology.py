"""Several ranks per machine: FastML's hierarchical all-reduce against the flat one, plain DDP and torch's
fp16 hook, on two emulated machines.

    sudo python benchmarks/bench_topology.py                       # R = 2 and 4, 1 Gbit/s, 50 Mbit/s, no limit
    sudo python benchmarks/bench_topology.py --ranks 2 --links 50mbit --steps 3

Two machines: two network namespaces joined by a veth pair, each end shaped with ``tc ... tbf rate
RATE`` (``benchmarks/bench_fsdp.py``'s ``Topology``, reused, with namespace names starting ``fm23``), and
in each ``GLOO_SOCKET_IFNAME=VETH torchrun --nnodes 2 --node-rank K --nproc-per-node R``: ranks of one
machine talk over its namespace's own loopback (unshaped), ranks of different machines over the veth.
FastML learns R from torchrun's ``LOCAL_WORLD_SIZE`` (no setting), so ``fastml-int4-hier`` is
``register_hook(ddp, plan="int4")`` as a user writes it, and ``fastml-int4-flat`` the same with
``ranks_per_node=1``.

Model: an MLP of ``--layers`` Linear(WIDTH, WIDTH) + ReLU and a Linear(WIDTH, 10) head (2.37M
parameters, 9.5 MB of fp32 gradient by default) in DDP with ``bucket_cap_mb`` = a quarter of the
gradient (one bucket per layer), SGD (lr 0.05) on a fixed random teacher's labels; 1 thread per rank,
gloo. Every method starts from the same weights and sees the same batches.

Per row: median ms per step over ``--steps`` steps after ``--warmup`` (a step's time is the slowest
rank's; every step starts at a barrier); bytes that left each machine per step, from the veth's own
``tx_bytes`` (``/proc/net/dev`` in the namespace; TCP/IP headers included; the mean of the two
machines) and in units of S (the fp32 gradient) and S_c (its int4 encoding, ``codecs.wire_bytes``);
the cost model's prediction of those bytes (``costmodel.ddp_node_net_bytes``, the schedule the hook
runs) and its error; the physical bound: those bytes / link rate ("wire ms") against the same
method's step with no limit (compute and codec), and the step over the larger of the two; the loss on
a fixed batch after the same steps. The namespaces are removed at the end, on failure and on SIGINT
too. CSV (``--csv``; default ``benchmarks/results/bench_topology_cpu.csv`` for the run with every
default, ``benchmarks/out/`` otherwise), every row with the machine and the load average.

``localsgd-islands``: DiLoCo islands, DDP over each machine's ranks (``machine_group()``) and
``LocalSGD(ddp, every=50, plan="int4")`` across machines. Its row covers a whole period: after the
warm-up, 50 inner steps of which one synchronises, and gives the mean ms per step and the bytes across
machines per step averaged over the period (its loss is after those 52 steps, not the others' 6).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_fsdp as bf  # noqa: E402  the namespaces, veth pair, tc shaping and launchers

# method -> what it is (None: a slot not measured yet)
METHODS = {
    "ddp": "plain DDP (gloo's ring all-reduce, fp32)",
    "fp16-hook": "torch's fp16_compress_hook",
    "fastml-int4-flat": "FastML int4, flat (register_hook(..., ranks_per_node=1))",
    "fastml-int4-hier": "FastML int4, hierarchical (register_hook(...): R from LOCAL_WORLD_SIZE)",
    "localsgd-islands": "LocalSGD, H=50, int4, over DDP islands (DDP inside each machine)",
}
ISLANDS_H = 50  # inner steps between synchronisations of the islands row (DiLoCo's order of magnitude)
DEFAULTS = dict(ranks=[2, 4], links=["1gbit", "50mbit"], layers=4, width=768, batch=16, steps=4, warmup=2)


def _model(a):
    import torch

    torch.manual_seed(0)
    mods = []
    for _ in range(a.layers):
        mods += [torch.nn.Linear(a.width, a.width), torch.nn.ReLU()]
    mods.append(torch.nn.Linear(a.width, 10))
    return torch.nn.Sequential(*mods)


def _batch(a, rank: int, step: int):
    import torch

    teacher = torch.Generator().manual_seed(4321)
    w = torch.randn(a.width, 10, generator=teacher)
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(a.batch, a.width, generator=g)
    return x, (x @ w).argmax(1)


def _worker(a) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastml_strategy as fm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=900))
    rank = dist.get_rank()
    local0 = int(os.environ.get("LOCAL_RANK", "0")) == 0
    iface = os.environ.get("FASTML_BENCH_IFACE")
    out = {}
    for method in a.methods_csv.split(","):
        model = _model(a)
        nbytes = sum(p.numel() * 4 for p in model.parameters())
        islands = method == "localsgd-islands"
        if islands:
            from fastml_strategy.localsgd import machine_group

            ddp = DDP(model, bucket_cap_mb=nbytes / 4 / (1 << 20), process_group=machine_group())
        else:
            ddp = DDP(model, bucket_cap_mb=nbytes / 4 / (1 << 20))
        state = local = None
        if method == "fp16-hook":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method == "fastml-int4-flat":
            state = fm.register_hook(ddp, plan="int4", ranks_per_node=1)
        elif method == "fastml-int4-hier":
            state = fm.register_hook(ddp, plan="int4")
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        if islands:
            local = fm.LocalSGD(ddp, opt, every=ISLANDS_H, plan="int4")
        steps = ISLANDS_H if islands else a.steps
        times, tx0 = [], None
        for step in range(a.warmup + steps):
            x, y = _batch(a, rank, step)
            dist.barrier()
            if step == a.warmup:
                tx0 = bf._net_bytes(iface)
            t0 = time.perf_counter()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            if local is not None:
                local.step()
            dt = torch.tensor([time.perf_counter() - t0])
            dist.barrier()
            tx = bf._net_bytes(iface) if step == a.warmup + steps - 1 else None
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if step >= a.warmup:
                times.append(float(dt))
        node_bytes = torch.tensor([float((tx - tx0) / steps) if (local0 and tx is not None and tx0 is not None)
                                   else 0.0])
        dist.all_reduce(node_bytes)  # the sum over machines (only each machine's local rank 0 adds)
        with torch.no_grad():
            x, y = _batch(a, 10 ** 6, 0)
            loss = float(torch.nn.functional.cross_entropy(model(x), y))
        # islands: the mean over the period (one step in 50 synchronises); the others: the median step
        ms = 1e3 * (statistics.mean(times) if islands else statistics.median(times))
        out[method] = {"ms": ms, "node_bytes": float(node_bytes) / 2,
                       "loss": loss, "hierarchical": bool(state.hierarchical) if state else islands,
                       "stats": {k: state.stats()[k] for k in ("bytes_sent_inter", "bytes_sent_intra")}
                       if state else None, "grad_bytes": nbytes}
        if state is not None:
            state.close()
        if local is not None:
            out[method]["outer_steps"] = local.stats()["outer_steps"]
            local.close()
        del ddp
    if rank == 0:
        with open(a._out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _predicted(a, R: int, method: str) -> tuple[float, str]:
    """(bytes leaving each machine per step, schedule) from the cost model, as the runtime runs it."""
    from fastml_strategy.autotune.catalog import HardwareOption
    from fastml_strategy.autotune.costmodel import CANDIDATES, LayerProfile, Profile, step_time

    model = _model(a)
    layers = [LayerProfile(name=n, numel=p.numel(), index=i, ready_s=0.0, grad_sq=1.0, tunable=p.numel() >= 4096)
              for i, (n, p) in enumerate(model.named_parameters())]
    for lp in layers:
        lp.rel_error = {o: 0.0 for o in CANDIDATES}
        lp.codec_s = {o: 0.0 for o in CANDIDATES}
    prof = Profile(layers=layers, forward_s=0, backward_s=0, optimizer_s=0, world_size=2 * R, min_numel=4096,
                   options=list(CANDIDATES))
    opt = HardwareOption(name="emulated", nodes=2, accelerators_per_node=R, price_per_hour=0.0, bandwidth_gbps=1.0,
                         latency_us=0.0, compute_speed=1.0)
    choice = {lp.name: "int4" for lp in layers if lp.tunable}
    if method == "localsgd-islands":  # one compressed part per local rank across machines, once per H
        br = step_time(prof, choice, opt, topology="auto")
        return float(br.node_net_bytes) / ISLANDS_H, br.topology
    if method == "ddp":
        br = step_time(prof, {}, opt, hook=False)
    elif method == "fp16-hook":  # the fp16 hook is a ring all-reduce of half the bytes
        br = step_time(prof, {}, opt, hook=False)
        return br.node_net_bytes / 2, "flat"
    else:
        br = step_time(prof, choice, opt, topology="flat" if method.endswith("flat") else "auto")
    return float(br.node_net_bytes), br.topology


def _s_c(a) -> int:
    """The int4 encoding of the gradient (biases, under min_numel, in fp32), as codecs sizes it."""
    from fastml_strategy import RECIPES
    from fastml_strategy.codecs import dense_nbytes

    return sum(dense_nbytes(p.numel(), RECIPES["int4" if p.numel() >= 4096 else "none"])
               for p in _model(a).parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", nargs="+", type=int, default=DEFAULTS["ranks"], help="ranks per machine R")
    ap.add_argument("--links", nargs="+", default=DEFAULTS["links"], help="veth rates (tc's form)")
    ap.add_argument("--methods", nargs="+", default=[m for m, v in METHODS.items() if v],
                    choices=[m for m, v in METHODS.items() if v])
    for k in ("layers", "width", "batch", "steps", "warmup"):
        ap.add_argument(f"--{k}", type=int, default=DEFAULTS[k])
    ap.add_argument("--timeout", type=float, default=900, help="seconds per torchrun job")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_methods", dest="methods_csv", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        _worker(a)
        return
    if os.geteuid() != 0:
        raise SystemExit("bench_topology: needs root (ip netns, veth, tc) for the two emulated machines")
    for rate in a.links:
        bf._rate_bits(rate)
    import _bench

    defaults = all(getattr(a, k) == v for k, v in DEFAULTS.items()) and a.methods == [m for m, v in METHODS.items() if v]
    csv_path = a.csv or _bench.default_csv("bench_topology_cpu.csv", defaults)
    signal.signal(signal.SIGTERM, bf._on_signal)
    machine = bf._machine()
    print(f"bench_topology: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {machine}; "
          f"{_bench.load_line()}", flush=True)
    env0 = _bench.environment()
    S, S_c = 4 * sum(p.numel() for p in _model(a).parameters()), _s_c(a)
    worker = ["--_worker", "--_methods", ",".join(a.methods)] + [
        x for k in ("layers", "width", "batch", "steps", "warmup") for x in (f"--{k}", str(getattr(a, k)))]
    rows = []
    tmp = tempfile.mkdtemp(prefix="fm23_bench_")
    try:
        for R in a.ranks:
            res_by_link = {}
            for link in [None] + list(a.links):
                topo = bf.Topology("topology", link, True, shape=(2, R), prefix="fm23", script=__file__)
                out = os.path.join(tmp, f"r{R}_{link or 'none'}.json")
                t0 = time.monotonic()
                res_by_link[link] = topo.run(worker, out, a.timeout, out + ".log")
                bf._cleanup()
                print(f"  R={R} link={link or 'no limit'}: {time.monotonic() - t0:.0f} s; {_bench.load_line()}",
                      flush=True)
            for link, res in res_by_link.items():
                for m in a.methods:
                    r = res[m]
                    pred, sched = _predicted(a, R, m)
                    wire_ms = 1e3 * 8 * r["node_bytes"] / bf._rate_bits(link) if link else None
                    floor_ms = res_by_link[None][m]["ms"]
                    bound = max(wire_ms or 0.0, floor_ms)
                    rows.append({
                        "ranks_per_node": R, "nodes": 2, "link": link or "no limit", "method": m,
                        "schedule": "hierarchical" if r["hierarchical"] else "flat",
                        "ms_per_step": round(r["ms"], 1),
                        "MB_across_per_node_step": round(r["node_bytes"] / 1e6, 3),
                        "x_S": round(r["node_bytes"] / S, 3), "x_S_c": round(r["node_bytes"] / S_c, 3),
                        "predicted_MB": round(pred / 1e6, 3),
                        "prediction_error_pct": round(100 * (pred - r["node_bytes"]) / r["node_bytes"], 1)
                        if r["node_bytes"] else None,
                        "wire_ms": round(wire_ms, 1) if wire_ms is not None else None,
                        "no_limit_ms": round(floor_ms, 1), "bound_ms": round(bound, 1),
                        "x_bound": round(r["ms"] / bound, 2), "loss": round(r["loss"], 4),
                        "grad_MB": round(S / 1e6, 3), "S_c_MB": round(S_c / 1e6, 3),
                        "target_MB": round(1.15 * S_c / 1e6, 3),  # 1.15 x 2(N-1)/N x S_c, N = 2
                    })
    finally:
        bf._cleanup()
    env1 = _bench.environment()
    env = {**env0, "load_1m_after": env1["load_1m"]}
    _bench.write_csv(csv_path, rows, env)
    print(f"\n{machine}\n")
    cols = ["ranks_per_node", "link", "method", "ms_per_step", "MB_across_per_node_step", "x_S_c", "predicted_MB",
            "prediction_error_pct", "wire_ms", "no_limit_ms", "x_bound", "loss"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("-" if r[c] is None else str(r[c]) for c in cols) + " |")
    for R in a.ranks:
        for link in a.links:
            got = {r["method"]: r for r in rows if r["ranks_per_node"] == R and r["link"] == link}
            if {"fastml-int4-flat", "fastml-int4-hier"} <= got.keys():
                h, f = got["fastml-int4-hier"], got["fastml-int4-flat"]
                print(f"R={R} {link}: hierarchical int4 {h['x_S_c']} x S_c across machines per node "
                      f"(target <= 1.15); {f['ms_per_step'] / h['ms_per_step']:.2f}x faster than flat "
                      f"(target {1.5 if R == 2 else 2.2}x where flat is wire-bound: flat at "
                      f"{f['ms_per_step'] / f['no_limit_ms']:.1f}x its no-limit step)")
    print(f"CSV: {csv_path}")


if __name__ == "__main__":
    main()
