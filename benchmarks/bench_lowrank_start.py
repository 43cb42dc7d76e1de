"""Why the low-rank codec warms up: FastML's ``lowrank{r}`` compressing from the first step
(``start=0``) and after its default two int8 steps (``start=2``), against torch's PowerSGD hook
(``start_powerSGD_iter=2``) and uncompressed DDP, trained side by side from the same weights on the
same batches: validation loss every ``--every`` steps.

    python benchmarks/bench_lowrank_start.py                       # gpt (AdamW) and gpt2 (NAdam), rank 4
    python benchmarks/bench_lowrank_start.py --workloads gpt2 --steps 60 --rank 2

2 gloo ranks x 1 thread on plain loopback (convergence, not speed: no link is emulated), one DDP bucket
(torch's hook aborts on gloo with two). The workloads are ``bench_autotune.py``'s (its
``_training_parts``: model, batches, loss, validation loss and optimizer). Every row carries the machine
and the load; the CSV holds one row per method and evaluation.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _methods(rank: int) -> list[tuple[str, str]]:
    return [(f"fastml lowrank{rank} start 0", f"fastml:{rank}:0"), (f"fastml lowrank{rank} start 2", f"fastml:{rank}:2"),
            (f"torch PowerSGD rank {rank} start 2", f"torch:{rank}:2"), ("DDP fp32", "ddp")]


def _worker(rank: int, world: int, port: int, task: str, methods, steps: int, every: int, q) -> None:
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel as DDP

    import bench_autotune
    from fastml_strategy import CodecConfig, Plan, register_hook

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        new_model, stream, loss_fn, evaluate, optimizer = bench_autotune._training_parts(task, rank, world, 0)
        curves = {}
        for label, spec in methods:
            model = DDP(new_model(), bucket_cap_mb=1000)
            kind, *arg = spec.split(":")
            if kind == "fastml":
                register_hook(model, Plan(default=CodecConfig(codec="lowrank", rank=int(arg[0]), start=int(arg[1])),
                                          name=label))
            elif kind == "torch":
                model.register_comm_hook(ps.PowerSGDState(process_group=None, matrix_approximation_rank=int(arg[0]),
                                                          start_powerSGD_iter=int(arg[1])), ps.powerSGD_hook)
            opt, batches, curve = optimizer(model.parameters()), stream(), []
            for t in range(steps):
                opt.zero_grad(set_to_none=True)
                loss_fn(model, next(batches)).backward()
                opt.step()
                if (t + 1) % every == 0:
                    curve.append((t + 1, float(evaluate(model.module))))
            curves[label] = curve
        q.put((rank, curves))
    finally:
        dist.destroy_process_group()


def run(task: str, rank: int, steps: int, every: int) -> dict[str, list[tuple[int, float]]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29000 + os.getpid() % 2000
    mp.spawn(_worker, args=(2, port, task, _methods(rank), steps, every, q), nprocs=2)
    got = dict(q.get() for _ in range(2))
    return got[0]


def main() -> None:
    from _bench import default_csv, machine_line, write_csv

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="gpt,gpt2", help="bench_autotune workloads, comma-separated")
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--every", type=int, default=10, help="evaluate every this many steps")
    p.add_argument("--csv", default=default_csv("bench_lowrank_start_cpu.csv", documented=False))
    args = p.parse_args()
    rows = []
    for task in args.workloads.split(","):
        t0 = time.perf_counter()
        curves = run(task, args.rank, args.steps, args.every)
        print(f"\n{task}: validation loss every {args.every} steps ({time.perf_counter() - t0:.0f} s)")
        for label, curve in curves.items():
            print(f"  {label:32s} " + " ".join(f"{v:.3f}" for _, v in curve))
            rows += [{"workload": task, "method": label, "rank": args.rank, "step": s, "validation_loss": round(v, 4)}
                     for s, v in curve]
    write_csv(args.csv, rows)
    print(f"\n{machine_line()}; wrote {args.csv}")


if __name__ == "__main__":
    main()
