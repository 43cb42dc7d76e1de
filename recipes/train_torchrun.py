"""Plain torch.distributed + DDP + FastML: train an MLP on scikit-learn's digits, launched by torchrun.

The whole integration is one line after the DDP wrapper::

    state = fastml_strategy.register_hook(model, plan)   # every rank, before the first backward

Run (CPU, 2 processes on this machine; on GPUs the backend becomes NCCL by itself)::

    torchrun --nproc_per_node 2 recipes/train_torchrun.py --max-steps 50
    FASTML_PLAN=int2 torchrun --nproc_per_node 2 recipes/train_torchrun.py

Two nodes (run one command per node; any free port, the same --rdzv_id on both)::

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST0:29400 \\
        --rdzv_id digits recipes/train_torchrun.py

Checkpoints (``--ckpt``) hold model, optimizer, step and the FastML state of EVERY rank (the
error-feedback residuals differ per rank), written by rank 0 atomically; ``--resume`` continues the
same trajectory exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fastml_strategy


def digits_split():
    from fastml_strategy._digits import digits_table  # scikit-learn's digits, without importing it

    x, y = digits_table()
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    train = torch.utils.data.TensorDataset(x[:1500], y[:1500])
    val = torch.utils.data.TensorDataset(x[1500:], y[1500:])
    return train, val


def make_model(hidden: int) -> nn.Module:
    # The two hidden weight matrices are large enough for the plan to compress (>= 4096 elements);
    # the output layer and the biases travel uncompressed.
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 10))


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode() + p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def fail(message: str) -> None:
    """One line for the whole job: rank 0 prints the error, every rank exits with status 2.

    FastML agrees on the plan across ranks before the first step, so every rank raises the same error;
    printing it once (not a traceback per rank) is the whole report. torchrun stops the remaining ranks
    (SIGTERM) as soon as one rank has exited, and a normal interpreter exit (torch's teardown) takes
    long enough for that to happen: so each rank leaves with os._exit(2) once its output is flushed,
    and a SIGTERM that arrives first ends it with status 2 too.
    """
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{os.path.basename(__file__)}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)  # nothing to save or close: this runs before the first step


def save_checkpoint(path: str, model: DDP, opt, step: int, state) -> None:
    fml = state.state_dict(all_ranks=True)  # a collective: every rank calls save_checkpoint
    if dist.get_rank() == 0:
        ckpt = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "step": step, "fastml": fml}
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".ckpt.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:  # write beside the target, then rename: never a torn file
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    dist.barrier()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=None, help="recipe name or plan JSON (default: $FASTML_PLAN or int4)")
    ap.add_argument("--max-steps", type=int, default=300, help="optimizer steps to train")
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ckpt", default=None, help="save a checkpoint here at the end")
    ap.add_argument("--resume", default=None, help="resume from this checkpoint")
    ap.add_argument("--summary", default=None, help="write final figures to SUMMARY.rank<R>.json")
    args = ap.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)

    train, val = digits_split()
    sampler = torch.utils.data.DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    model = DDP(make_model(args.hidden).to(device), device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    try:
        state = fastml_strategy.register_hook(model, args.plan)  # validates the plan on every rank first
    except ValueError as e:  # a bad plan or plan file: the same error on every rank, before any step
        fail(str(e))

    step = 0
    if args.resume:
        ckpt = torch.load(args.resume, map_location=device, weights_only=True)
        model.module.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        state.load_state_dict(ckpt["fastml"])  # picks this rank's residuals
        step = ckpt["step"]

    steps_per_epoch = len(loader)
    while step < args.max_steps:
        sampler.set_epoch(step // steps_per_epoch)
        for i, (x, y) in enumerate(loader):
            if i < step % steps_per_epoch:  # resuming mid-epoch: skip what was already seen
                continue
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()  # DDP calls FastML's hook per bucket: compressed all-reduce
            opt.step()
            step += 1
            if rank == 0 and (step % 50 == 0 or step == args.max_steps):
                s = state.stats()
                # bytes_sent and steps both continue from the checkpoint when resuming: like with like
                print(f"step {step} loss {loss.item():.4f} compression {s['compression_ratio']:.2f}x "
                      f"({s['bytes_sent'] / s['steps'] / 1024:.1f} KiB sent per step)", flush=True)
            if step >= args.max_steps:
                break

    model.eval()
    with torch.no_grad():
        xv, yv = val.tensors
        acc = (model.module(xv.to(device)).argmax(-1).cpu() == yv).float().mean().item()
    if rank == 0:
        print(f"validation accuracy {acc:.3f}", flush=True)
    if args.ckpt:
        save_checkpoint(args.ckpt, model, opt, step, state)
    if args.summary:
        stats = state.stats()
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(f"{args.summary}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "world_size": world, "step": step, "val_acc": acc,
                       "params_sha256": params_sha256(model.module), "fastml_step": state.step,
                       "compression_ratio": stats["compression_ratio"], "plan": stats["plan"]}, f)
    state.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
