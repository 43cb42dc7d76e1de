"""A small compressed DDP job that survives losing a rank: torchrun restarts it, it resumes from its
last checkpoint, and ends bit-identical to a run that never failed.

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node 2 --max-restarts 1 \\
        tests/faults/elastic_train.py --dir /tmp/job --steps 10 --every 2 --kill-at 3

(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torch 2.13 and gloo, a restarted attempt otherwise
reads the dead attempt's addresses from torchrun's shared store and fails to connect.)

Every ``--every`` steps rank 0 writes one checkpoint (model, optimizer, and FastML's state of every
rank: error-feedback residuals, step counter) atomically, so a crash mid-write leaves the previous
one. With ``--kill-at N``, rank 1 SIGKILLs itself at step N of the first attempt; the other rank fails
with FastML's CompressionError (or is stopped by torchrun), torchrun starts both again, and they
resume from the checkpoint. Each rank writes ``result-rank{R}.json`` at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _fault_helpers import flat_params, loss_of, mlp  # noqa: E402

import fastml_strategy as fm  # noqa: E402
from fastml_strategy._io import atomic_open  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="checkpoint and result directory")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=2, help="checkpoint every N steps")
    ap.add_argument("--kill-at", type=int, default=-1, help="rank 1 dies at this step (first attempt)")
    ap.add_argument("--plan", default="int4")
    ap.add_argument("--timeout", type=float, default=20, help="process group timeout (s)")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.dir)
    ckpt = out / "checkpoint.pt"

    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = fm.register_hook(ddp, plan=args.plan)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)

    start = 0
    if ckpt.exists():
        sd = torch.load(ckpt, weights_only=True)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optimizer"])
        state.load_state_dict(sd["fastml"])
        start = sd["step"]
    print(f"[rank {rank}] attempt {attempt}: starting at step {start}", flush=True)

    for step in range(start, args.steps):
        if step == args.kill_at and attempt == 0 and rank == 1:
            print(f"[rank {rank}] killing myself at step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        loss_of(ddp, rank, step).backward()
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every == 0:
            fastml_sd = state.state_dict(all_ranks=True)  # a collective: every rank calls it
            if rank == 0:
                with atomic_open(ckpt, "wb") as f:
                    torch.save({"step": step + 1, "model": model.state_dict(),
                                "optimizer": opt.state_dict(), "fastml": fastml_sd}, f)

    params = flat_params(model)
    gathered = [torch.zeros_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    result = {
        "rank": rank,
        "attempt": attempt,
        "resumed_from": start,
        "steps": state.stats()["steps"],
        "identical": all(torch.equal(gathered[0], g) for g in gathered[1:]),
        "params_sha256": hashlib.sha256(params.numpy().tobytes()).hexdigest(),
    }
    with atomic_open(out / f"result-rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
