"""LocalSGD's outer step on the digits task: test accuracy after the same inner steps as DDP.

2 gloo ranks (CPU), the digits MLP (hidden 128), Adam 1e-3 inside, batch 32 per rank; every
configuration syncs with int4 outer compression. Accuracy is on 359 held-out digits (one digit is 0.28
points); mean over seeds.

Usage::

    python benchmarks/bench_localsgd_outer.py                   # 600 inner steps, 2 seeds: ~4 min on 2 cores
    python benchmarks/bench_localsgd_outer.py --steps 100 --seeds 1   # smoke run

Writes ``benchmarks/results/bench_localsgd_outer_cpu.csv`` (the full run; other settings:
``benchmarks/out/``) and prints a markdown table, with the machine (CPU model, SIMD flags, cores),
Python, torch and the load average in every row (``benchmarks/_bench.py``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
from datetime import date
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _bench  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "benchmarks" / "results" / "bench_localsgd_outer_cpu.csv"
WORLD = 2
AVG = dict(outer="sgd", outer_lr=1.0, outer_momentum=0.0)
CONFIGS = [
    ("DDP (every step, fp32)", None),
    ("H=20, averaging (outer SGD lr 1)", dict(every=20, **AVG)),
    ("H=20, DiLoCo Nesterov lr 0.7 m 0.9 (default)", dict(every=20)),
    ("H=20, Nesterov lr 0.7 m 0.6", dict(every=20, outer_momentum=0.6)),
    ("H=20, averaging, 4 fragments, delay 2", dict(every=20, fragments=4, delay=2, **AVG)),
    ("H=50, averaging", dict(every=50, **AVG)),
    ("H=50, DiLoCo Nesterov lr 0.7 m 0.9", dict(every=50)),
]


def _worker(rank: int, port: int, steps: int, seeds: list, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import fastml_strategy as fm
        from fastml_strategy._digits import accuracy, batches, digits_mlp, load_digits_split
        from torch.nn.parallel import DistributedDataParallel as DDP

        xtr, ytr, xte, yte = load_digits_split()
        rows = []
        for label, kw in CONFIGS:
            for seed in seeds:
                model = digits_mlp(hidden=128, seed=seed)
                net = DDP(model) if kw is None else model
                inner = torch.optim.Adam(net.parameters(), lr=1e-3)
                local = None if kw is None else fm.LocalSGD(model, inner, plan="int4", **kw)
                data = batches(xtr, ytr, 32, rank, WORLD, seed=seed)
                for _ in range(steps):
                    x, y = next(data)
                    torch.nn.functional.cross_entropy(net(x), y).backward()
                    inner.step()
                    inner.zero_grad()
                    if local is not None:
                        local.step()
                ratio = None
                if local is not None:
                    local.synchronize()
                    ratio = local.stats()["ratio_vs_ddp"]
                    local.close()
                rows.append((label, seed, accuracy(model, xte, yte), ratio))
        if rank == 0:
            q.put(rows)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--out", default=None, help=f"default {OUT.relative_to(REPO)} for the full run "
                    f"(--steps 600 --seeds 2), benchmarks/out/bench_localsgd_outer_cpu.csv for any other")
    a = ap.parse_args()
    a.out = a.out or _bench.default_csv("bench_localsgd_outer_cpu.csv", a.steps == 600 and a.seeds == 2)
    print(f"{_bench.machine_line()}; {_bench.load_line()} at the start", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, a.steps, list(range(a.seeds)), q)) for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = q.get(timeout=3600)
    for p in procs:
        p.join()
    by: dict = {}
    for label, seed, acc, ratio in rows:
        by.setdefault(label, []).append((acc, ratio))
    ref = statistics.fmean(r[0] for r in by[CONFIGS[0][0]])
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               "unknown CPU")
    load = os.getloadavg()[0]
    print(f"# LocalSGD outer step on digits ({date.today()}, {cpu}, {WORLD} gloo ranks x 1 thread, load "
          f"{load:.1f}; {a.steps} inner steps, Adam 1e-3, batch 32 per rank, int4 outer compression; mean of "
          f"{a.seeds} seeds)\n")
    print("| configuration | test accuracy | vs DDP | bytes vs DDP fp32 every step |")
    print("|---|---|---|---|")
    out = []
    for label, _ in CONFIGS:
        v = by[label]
        acc = statistics.fmean(r[0] for r in v)
        ratio = v[0][1]
        per = ", ".join(f"{r[0]:.3f}" for r in v)
        print(f"| {label} | {acc:.4f} ({per}) | {100 * (acc - ref):+.2f} pt | "
              f"{'1x' if ratio is None else f'{ratio:.0f}x fewer'} |")
        out.append({"configuration": label, "accuracy_mean": round(acc, 5), "accuracies": per,
                    "vs_ddp_pt": round(100 * (acc - ref), 3), "ratio_vs_ddp_bytes": ratio, "steps": a.steps,
                    "seeds": a.seeds, "cpu": cpu, "date": str(date.today())})
    # every row: the machine (CPU model, SIMD flags, cores), Python, torch and the load average now
    _bench.write_csv(a.out, out)
    print(f"\n{_bench.machine_line()}; {_bench.load_line()} at the end")
    print(f"\nCSV: {a.out}")


if __name__ == "__main__":
    sys.exit(main())
