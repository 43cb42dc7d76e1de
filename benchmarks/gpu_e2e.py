"""CUDA end-to-end check of the FastML hook: NCCL, the comm thread on its own CUDA stream, the codecs on
GPU tensors. One GPU means one rank (NCCL allows one rank per GPU), so this checks the CUDA/NCCL code
path and the codec cost, not the wire.

    torchrun --nproc_per_node 1 benchmarks/gpu_e2e.py --csv out.csv

Per recipe: ms per training step of the 25.2M-parameter MLP (batch 64) with DDP's own all-reduce vs
FastML, the gradients' deviation from the uncompressed ones after one step, and the replicas check.
ms per step: ``ms_per_step`` is the mean (wall time of the timed steps / steps, as in the first H200
runs); ``ms_median`` and ``ms_best`` are the median and the fastest single step, timed with CUDA events
recorded at each step boundary (no extra synchronisation inside the loop).

Every CSV row also records the software and the machine: torch.__version__, torch.version.cuda, the
triton version, the GPU's name, the host CPU (model, SIMD flags, cores), Python and the load average
(``benchmarks/_bench.py``). The CSV (``--csv``, default ``benchmarks/out/gpu_e2e.csv``) is written
atomically; RESULTS.md's copies live in ``benchmarks/results/gpu_e2e_<gpu>.csv``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import fastml_strategy as fm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                               torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()


def run(recipe, steps, x):
    model = mlp()
    ddp = DDP(model, device_ids=[0])
    state = fm.register_hook(ddp, plan=recipe, layer_stats_every=0) if recipe else None
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    grads = None
    marks = []  # a CUDA event at each timed step's boundary: per-step times without extra syncs
    for i in range(steps + 3):
        if i == 3:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        if i >= 3:
            marks.append(torch.cuda.Event(enable_timing=True))
            marks[-1].record()
        loss = ddp(x).square().mean()
        loss.backward()
        if grads is None:
            grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone()
        opt.step()
        opt.zero_grad(set_to_none=False)
    marks.append(torch.cuda.Event(enable_timing=True))
    marks[-1].record()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) / steps * 1000
    per_step = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
    finite = bool(torch.isfinite(torch.cat([p.reshape(-1) for p in model.parameters()])).all())
    if state is not None:
        state.close()
    return ms, per_step, grads, finite


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--csv", default="benchmarks/out/gpu_e2e.csv")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    x = torch.randn(64, 1024, device="cuda")
    env = _bench.environment("cuda:0")
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # not reported by this build
        nccl = ""
    if dist.get_rank() == 0:
        print(f"gpu_e2e: {_bench.machine_line(env=env)}; NCCL {nccl or '?'}, 1 rank; {_bench.load_line()}",
              flush=True)
    stamp = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
    rows = []
    base_g = None
    for recipe in [None, "none", "fp16", "int8", "int4", "int2", "topk1"]:
        ms, per_step, g, finite = run(recipe, args.steps, x)
        if base_g is None:
            base_g = g
        err = float((g - base_g).norm() / base_g.norm())
        rows.append({"method": f"fastml-{recipe}" if recipe else "ddp-fp32", "ms_per_step": ms,
                     "ms_median": statistics.median(per_step), "ms_best": min(per_step), "steps": args.steps,
                     "rel_grad_error": err, "finite": finite, "date_utc": stamp,
                     "nccl": nccl})
    if dist.get_rank() == 0:
        for r in rows:
            print(f"{r['method']:14s} {r['ms_per_step']:8.2f} ms/step (median {r['ms_median']:.2f}, best "
                  f"{r['ms_best']:.2f})  rel. grad error {r['rel_grad_error']:.4f}  finite {r['finite']}")
        _bench.write_csv(args.csv, rows, dict(env, load_1m_end=round(_bench.load()[0], 2)))
        print(f"CSV: {args.csv}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
