"""What error feedback's memory buys under FSDP: accuracy on the digits task against residual bytes.

A compressed reduce-scatter keeps, on every rank, an error-feedback residual as large as the unsharded
gradient. ``CodecConfig(residual_dtype="bf16")`` halves it, ``error_feedback=False`` removes it. This
script trains the digits MLP (hidden 256: 84K parameters) with FSDP2 on 2 gloo ranks (CPU), for each
choice and several seeds, and reports test accuracy, final training loss and the residual bytes per
parameter per rank beside FSDP's own memory per parameter per rank (fp32 parameter shard + gradient
shard + Adam's two moments: 16 / W bytes).

Usage::

    python benchmarks/bench_fsdp_residuals.py                 # 3 seeds, 300 steps: ~3 minutes on 2 cores
    python benchmarks/bench_fsdp_residuals.py --seeds 1 --steps 60   # smoke run

Writes ``benchmarks/results/bench_fsdp_residuals_cpu.csv`` (the full run; other settings:
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
OUT = REPO / "benchmarks" / "results" / "bench_fsdp_residuals_cpu.csv"
WORLD = 2

# (label, plan recipe or None for FSDP's own, CodecConfig overrides)
CHOICES = [
    ("FSDP (no FastML)", None, None),
    ("int4, fp32 residual", "int4", {}),
    ("int4, bf16 residual", "int4", {"residual_dtype": "bf16"}),
    ("int4, no error feedback", "int4", {"error_feedback": False}),
    ("int2, fp32 residual", "int2", {}),
    ("int2, bf16 residual", "int2", {"residual_dtype": "bf16"}),
    ("int2, no error feedback", "int2", {"error_feedback": False}),
    ("topk1-int4, fp32 residual", "topk1-int4", {}),
    ("topk1-int4, bf16 residual", "topk1-int4", {"residual_dtype": "bf16"}),
    ("topk1-int4, no error feedback", "topk1-int4", {"error_feedback": False}),
]


def _plan(recipe: str, overrides: dict):
    import dataclasses

    import fastml_strategy as fm

    cfg = dataclasses.replace(fm.RECIPES[recipe], **overrides)
    return fm.Plan(default=cfg, name=f"{recipe}{''.join(f'-{k}={v}' for k, v in overrides.items())}")


def _worker(rank: int, port: int, steps: int, seeds: list[int], q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import fastml_strategy.fsdp as ff
        from fastml_strategy._digits import accuracy, batches, digits_mlp, load_digits_split
        from torch.distributed.fsdp import fully_shard

        xtr, ytr, xte, yte = load_digits_split()
        rows = []
        for label, recipe, overrides in CHOICES:
            for seed in seeds:
                model = digits_mlp(hidden=256, seed=seed)
                for layer in model:
                    if any(True for _ in layer.parameters()):
                        fully_shard(layer)
                fully_shard(model)
                state = ff.register(model, plan=_plan(recipe, overrides)) if recipe else None
                opt = torch.optim.Adam(model.parameters(), lr=1e-3)
                data = batches(xtr, ytr, 32, rank, WORLD, seed=seed)
                losses = []
                for _ in range(steps):
                    x, y = next(data)
                    loss = torch.nn.functional.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    losses.append(float(loss.detach()))
                acc = accuracy(model, xte, yte)
                nparams = sum(p.numel() for p in model.parameters())
                res = state.stats()["residual_bytes"] if state else 0
                rows.append((label, seed, acc, statistics.fmean(losses[-20:]), res, nparams))
                if state:
                    state.close()
        if rank == 0:
            q.put(rows)
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default=None, help=f"default {OUT.relative_to(REPO)} for the full run "
                    f"(--steps 300 --seeds 3), benchmarks/out/bench_fsdp_residuals_cpu.csv for any other")
    a = ap.parse_args()
    a.out = a.out or _bench.default_csv("bench_fsdp_residuals_cpu.csv", a.steps == 300 and a.seeds == 3)
    print(f"{_bench.machine_line()}; {_bench.load_line()} at the start", flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, port, a.steps, list(range(a.seeds)), q))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    rows = q.get(timeout=3600)
    for p in procs:
        p.join()
    by: dict[str, list] = {}
    for label, seed, acc, loss, res, nparams in rows:
        by.setdefault(label, []).append((acc, loss, res, nparams))
    ref = statistics.fmean(r[0] for r in by[CHOICES[0][0]])
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               "unknown CPU")
    flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    isa = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    print(f"# FSDP residual choices on digits ({date.today()}, {cpu}, {isa}; {WORLD} gloo ranks x 1 "
          f"thread; {a.steps} steps, Adam 1e-3, batch 32 per rank; mean of {a.seeds} seeds)\n")
    print("| choice | test accuracy | vs FSDP | final loss | residual bytes / parameter / rank | "
          "FSDP's own bytes / parameter / rank |")
    print("|---|---|---|---|---|---|")
    out_rows = []
    for label, _, _ in CHOICES:
        v = by[label]
        acc = statistics.fmean(r[0] for r in v)
        accs = ", ".join(f"{r[0]:.3f}" for r in v)
        loss = statistics.fmean(r[1] for r in v)
        per_param = v[0][2] / v[0][3]
        print(f"| {label} | {acc:.4f} ({accs}) | {100 * (acc - ref):+.2f} pt | {loss:.4f} | "
              f"{per_param:.2f} | {16 / WORLD:.2f} |")
        out_rows.append({"choice": label, "accuracy_mean": round(acc, 5), "accuracies": accs,
                         "accuracy_vs_fsdp_pt": round(100 * (acc - ref), 3), "final_loss": round(loss, 5),
                         "residual_bytes_per_param_per_rank": round(per_param, 3),
                         "fsdp_bytes_per_param_per_rank": 16 / WORLD, "steps": a.steps,
                         "seeds": a.seeds, "world_size": WORLD, "cpu": cpu, "isa": isa,
                         "date": str(date.today())})
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    # every row: the machine (CPU model, SIMD flags, cores), Python, torch and the load average now
    _bench.write_csv(a.out, out_rows)
    print(f"\n{_bench.machine_line()}; {_bench.load_line()} at the end")
    print(f"\nCSV: {a.out}")


if __name__ == "__main__":
    sys.exit(main())
