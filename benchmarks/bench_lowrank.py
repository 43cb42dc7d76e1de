"""FastML's low-rank codec (``lowrank{r}``, PowerSGD) against torch's own PowerSGD hook at the same rank:
bytes and milliseconds per step on the 3.3M-parameter GPT of ``gpt_workload.py``, 2 gloo ranks.

    python benchmarks/bench_lowrank.py --rate 50mbit          # in a private namespace (root), shaped lo
    python benchmarks/bench_lowrank.py --rate none            # plain loopback

Both run in one bucket (``DDP(bucket_cap_mb=100)``: torch's hook aborts on gloo with two), torch's with
``start_powerSGD_iter=2`` (the least its error feedback allows) and warm start, so that every timed step
(after ``--warm`` untimed ones) compresses. The methods alternate, ``--reps`` times, and the figures are
medians over all timed steps of a method; every row carries the machine and the load average.
Bytes: FastML's ``stats()["bytes_sent"]`` per step (headers included), torch's the tensors its hook hands
to ``torch.distributed.all_reduce`` (``_bench.CollectiveBytes``) times a ring's 2(W-1)/W.

Link emulation (DESIGN.md, "Measuring on one machine"): a network namespace ``i36l-lowrank`` whose
loopback is shaped with ``tc qdisc add dev lo root tbf rate RATE burst 512kb latency 100ms``; both ranks
share that one link, as in the issue's measurement. Removed on exit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
NETNS = "i36l-lowrank"


def _worker(rank, world_size, port, methods, steps, warm, q):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastml_strategy as fm
    import gpt_workload
    from _bench import CollectiveBytes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    rows = []
    for kind, r in methods:
        wl = gpt_workload.make()
        model = wl.model
        ddp = DDP(model, bucket_cap_mb=100)
        state = None
        if kind == "fastml":
            state = fm.register_hook(ddp, plan=f"lowrank{r}")
        else:
            ddp.register_comm_hook(ps.PowerSGDState(process_group=None, matrix_approximation_rank=r,
                                                    start_powerSGD_iter=2, warm_start=True,
                                                    use_error_feedback=True), ps.powerSGD_hook)
        opt = wl.optimizer(model.parameters())
        batches = iter(wl.batches())
        times, sent, loss = [], [], float("nan")
        with CollectiveBytes() as cb:
            for i in range(warm + steps):
                b = next(batches)
                dist.barrier()
                t0 = time.perf_counter()
                before = state.stats()["bytes_sent"] if state else cb.bytes
                lossv = wl.loss_fn(ddp, b)
                lossv.backward()
                opt.step()
                opt.zero_grad()
                t1 = time.perf_counter()
                after = state.stats()["bytes_sent"] if state else cb.bytes
                if i >= warm:
                    times.append(t1 - t0)
                    sent.append(after - before if state else (after - before) * 2 * (world_size - 1) / world_size)
                loss = float(lossv)
        if state is not None:
            state.close()
        rows.append({"method": f"{kind}-powersgd" if kind == "torch" else "fastml-lowrank", "rank": r,
                     "step_ms": [1e3 * t for t in times], "bytes_per_step": statistics.median(sent), "loss": loss})
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        q.put(rows)


def _run(args) -> list[dict]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = [int(x) for x in args.ranks.split(",")]
    methods = [(kind, r) for _ in range(args.reps) for r in ranks for kind in ("fastml", "torch")]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(k, 2, port, methods, args.steps, args.warm, q)) for k in range(2)]
    for p in procs:
        p.start()
    rows = q.get(timeout=args.timeout)
    for p in procs:
        p.join(60)
    merged: dict = {}
    for row in rows:
        m = merged.setdefault((row["method"], row["rank"]), {**row, "step_ms": []})
        m["step_ms"] = m["step_ms"] + row["step_ms"]
        m["loss"] = row["loss"]
    out = []
    for (method, r), m in merged.items():
        out.append({"method": method, "rank": r, "link": args.rate, "ms_per_step": round(statistics.median(m["step_ms"]), 1),
                    "bytes_per_step": int(m["bytes_per_step"]), "timed_steps": len(m["step_ms"]),
                    "loss_last": round(m["loss"], 4)})
    for r in ranks:
        fm_row = next(o for o in out if o["method"] == "fastml-lowrank" and o["rank"] == r)
        th_row = next(o for o in out if o["method"] == "torch-powersgd" and o["rank"] == r)
        fm_row["ms_ratio_vs_torch"] = round(fm_row["ms_per_step"] / th_row["ms_per_step"], 3)
        fm_row["bytes_ratio_vs_torch"] = round(fm_row["bytes_per_step"] / th_row["bytes_per_step"], 4)
    return out


def _in_namespace(args) -> int:
    """Re-run this script inside a fresh namespace whose loopback is shaped to ``args.rate``."""
    sh = lambda *c: subprocess.run(c, check=True)  # noqa: E731
    subprocess.run(["ip", "netns", "del", NETNS], stderr=subprocess.DEVNULL)
    sh("ip", "netns", "add", NETNS)
    try:
        sh("ip", "-n", NETNS, "link", "set", "lo", "up")
        sh("ip", "netns", "exec", NETNS, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", args.rate,
           "burst", "512kb", "latency", "100ms")
        cmd = ["ip", "netns", "exec", NETNS, sys.executable, __file__, "--_inside", *sys.argv[1:]]
        return subprocess.run(cmd, env=os.environ).returncode
    finally:
        subprocess.run(["ip", "netns", "del", NETNS])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", default="50mbit", help="tbf rate of the shared link, or 'none' for plain loopback")
    ap.add_argument("--ranks", default="1,2,4")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per method and repetition")
    ap.add_argument("--warm", type=int, default=4, help="untimed steps first (torch compresses from step 2)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=1500)
    ap.add_argument("--csv", default=None)
    ap.add_argument("--_inside", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rate != "none" and not args._inside:
        return _in_namespace(args)
    from _bench import load_line, machine_line, write_csv

    print(machine_line(), "|", load_line(), "| link", args.rate, flush=True)
    rows = _run(args)
    for row in rows:
        print(row, flush=True)
    print(load_line())
    path = args.csv or str(HERE / "results" / f"bench_lowrank_{args.rate}.csv")
    write_csv(path, rows)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
