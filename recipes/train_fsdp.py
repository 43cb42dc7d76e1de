"""FSDP2 + FastML with plain torch.distributed: ``fully_shard`` each layer, then the root, then register.

The whole integration is one line after sharding::

    state = fastml_strategy.fsdp.register(model, plan)   # every rank, before the first backward

FastML then compresses each FSDP unit's gradient reduce-scatter (FSDP), or, with ``--replicate-size
R`` (HSDP: the model sharded inside groups of world/R consecutive ranks, e.g. a node, and replicated R
times), the cross-replica all-reduce of the reduced shards, which crosses the slow link.

Run (CPU, gloo; on GPUs the backend becomes NCCL by itself)::

    torchrun --nproc_per_node 2 recipes/train_fsdp.py --max-steps 50                     # FSDP
    torchrun --nproc_per_node 4 recipes/train_fsdp.py --replicate-size 2 --max-steps 50  # HSDP 2 x 2
    FASTML_PLAN=int2 torchrun --nproc_per_node 2 recipes/train_fsdp.py

Two nodes, HSDP (shard inside each node, replicate across the two)::

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST0:29400 \\
        --rdzv_id digits recipes/train_fsdp.py --replicate-size 2

Checkpoints (``--ckpt DIR``, a folder): one ``torch.distributed.checkpoint`` with the model and optimizer
shards and every rank's FastML state (``state.distributed_state_dict()``: its error-feedback residuals
are its own). ``--resume DIR`` continues the same trajectory exactly; resume with the same number of
processes and the same ``--replicate-size``. Both lines below end with the same ``parameters sha256``::

    torchrun --nproc_per_node 2 recipes/train_fsdp.py --max-steps 20 --ckpt fsdp-ck --ckpt-at 8
    torchrun --nproc_per_node 2 recipes/train_fsdp.py --max-steps 20 --resume fsdp-ck
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import TensorDataset

import fastml_strategy.fsdp
from fastml_strategy._digits import load_digits_split


def make_model(hidden: int, mesh) -> nn.Module:
    # The two hidden weight matrices are large enough for the plan to compress (>= 4096 elements);
    # the output layer and the biases travel uncompressed.
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                          nn.Linear(hidden, 10))
    for layer in model:  # every Linear its own FSDP unit, then the root: inner modules first
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def params_sha256(model: nn.Module) -> str:
    """sha256 of the full parameters (sharded ones gathered: every rank must call it)."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode() + t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def fail(message: str) -> None:
    """One line for the whole job: rank 0 prints the error, every rank exits with status 2.

    FastML agrees on the plan across ranks before the first step, so every rank raises the same error;
    printing it once (not a traceback per rank) is the whole report.

    torchrun stops the remaining ranks (SIGTERM) as soon as one has exited, sooner than a normal
    interpreter exit takes: so each rank leaves with os._exit(2) once its output is flushed, and a
    SIGTERM that comes first ends it with status 2 too.
    """
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{os.path.basename(__file__)}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(2)  # nothing to save or close: no step has run, or the resume failed before one


def save_checkpoint(folder: str, model: nn.Module, opt, step: int, state) -> None:
    """Every rank writes its model and optimizer shards and its own FastML state (its residuals, step,
    plans) into one distributed checkpoint; rank 0 says where, at which step."""
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optimizer": optim_sd, "fastml": state.distributed_state_dict(),
              "step": step}, checkpoint_id=folder)
    if dist.get_rank() == 0:
        print(f"saved checkpoint {folder} at step {step}", flush=True)


def checkpoint_problem(folder: str) -> str | None:
    """Why ``folder`` is not a checkpoint this recipe can resume from (one line), or None. Agreed by
    every rank (a collective), so that every rank stops alike, with status 2, before loading."""
    why = None
    if not os.path.isdir(folder):
        why = f"--resume {folder}: no such checkpoint folder; pass the --ckpt folder of an earlier run, or drop --resume"
    elif not os.path.isfile(os.path.join(folder, ".metadata")):
        why = (f"--resume {folder}: not a checkpoint of this recipe (no .metadata in it); pass the --ckpt folder "
               f"of an earlier run, or drop --resume")
    whys = [None] * dist.get_world_size()
    dist.all_gather_object(whys, why)
    bad = [r for r, w in enumerate(whys) if w is not None]
    if not bad:
        return None
    return whys[bad[0]] + ("" if len(bad) == len(whys) else f" (on rank(s) {bad}: is {folder} on a shared disk?)")


def load_checkpoint(folder: str, model: nn.Module, opt, state) -> int:
    """Load ``folder`` in place (model and optimizer shards, every rank's FastML state); rank 0 says
    what, at which step. A checkpoint that does not fit this run (another model size, world size,
    --replicate-size or plan) stops every rank with its one-line reason, status 2."""
    model_sd, optim_sd = get_state_dict(model, opt)
    # loads in place into this template: a fresh FastML state already holds every residual
    loaded = {"model": model_sd, "optimizer": optim_sd, "fastml": state.distributed_state_dict(), "step": 0}
    try:
        dcp.load(loaded, checkpoint_id=folder)
        set_state_dict(model, opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
        state.load_state_dict(loaded["fastml"])  # checks world size, shard size and plan
    except Exception as e:  # noqa: BLE001 - every rank loads the same files: each fails alike
        failures = getattr(e, "failures", None)  # dcp's CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, dict) and failures:
            e = failures[min(failures)][0]
        first = (str(e).strip().splitlines() or [""])[0]
        fail(f"--resume {folder}: cannot load it into this run ({type(e).__name__}: {first}); resume with the "
             f"settings it was saved with (--hidden, --replicate-size, number of processes, --plan)")
    step = int(loaded["step"])
    if dist.get_rank() == 0:
        print(f"resumed from checkpoint {folder} at step {step}", flush=True)
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=None, help="recipe name or plan JSON (default: $FASTML_PLAN or int4)")
    ap.add_argument("--replicate-size", type=int, default=1, help="HSDP: number of replicas (1: FSDP)")
    ap.add_argument("--max-steps", type=int, default=300, help="optimizer steps to train")
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ckpt", default=None, help="save a checkpoint folder here (at the end, or at --ckpt-at)")
    ap.add_argument("--ckpt-at", type=int, default=None, help="save --ckpt after this many steps, then go on")
    ap.add_argument("--resume", default=None, help="resume from this checkpoint folder")
    ap.add_argument("--summary", default=None, help="write final figures to SUMMARY.rank<R>.json")
    args = ap.parse_args()

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    r = args.replicate_size
    if r < 1 or world % r:
        raise SystemExit(f"--replicate-size {r} must divide the world size {world}")
    # FSDP: one mesh dimension over every rank. HSDP: (replicate, shard); consecutive ranks shard together.
    mesh = (init_device_mesh(device.type, (world,)) if r == 1 else
            init_device_mesh(device.type, (r, world // r), mesh_dim_names=("replicate", "shard")))

    if args.resume:  # before any work: a missing checkpoint is one line and status 2 on every rank
        why = checkpoint_problem(args.resume)
        if why:
            fail(why)
    xtr, ytr, xte, yte = load_digits_split()
    train, val = TensorDataset(xtr, ytr), TensorDataset(xte, yte)
    sampler = torch.utils.data.DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    with torch.device(device):
        model = make_model(args.hidden, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)  # after fully_shard: its parameters

    try:
        state = fastml_strategy.fsdp.register(model, args.plan)  # validates the plan on every rank first
    except ValueError as e:  # a bad plan or plan file: the same error on every rank, before any step
        fail(str(e))

    step = load_checkpoint(args.resume, model, opt, state) if args.resume else 0
    steps_per_epoch = len(loader)
    while step < args.max_steps:
        sampler.set_epoch(step // steps_per_epoch)
        for i, (x, y) in enumerate(loader):
            if i < step % steps_per_epoch:  # resuming mid-epoch: skip what was already seen
                continue
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()  # FSDP calls FastML's reduce-scatter (or cross-replica all-reduce) per unit
            opt.step()
            step += 1
            if rank == 0 and (step % 50 == 0 or step == args.max_steps):
                s = state.stats()
                # bytes_sent and steps both continue from the checkpoint when resuming
                print(f"step {step} loss {loss.item():.4f} compression {s['compression_ratio']:.2f}x "
                      f"({s['bytes_sent'] / s['steps'] / 1024:.1f} KiB sent per step, "
                      f"{s['residual_bytes'] / 1024:.0f} KiB of residuals)", flush=True)
            if args.ckpt and step == args.ckpt_at:
                save_checkpoint(args.ckpt, model, opt, step, state)
            if step >= args.max_steps:
                break

    model.eval()
    with torch.no_grad():
        xv, yv = val.tensors
        acc = (model(xv.to(device)).argmax(-1).cpu() == yv).float().mean().item()
    if rank == 0:
        print(f"validation accuracy {acc:.3f}", flush=True)
    if args.ckpt and args.ckpt_at is None:
        save_checkpoint(args.ckpt, model, opt, step, state)
    digest = params_sha256(model)  # a collective: every rank
    if rank == 0:  # a resumed run that ends where an uninterrupted one did prints the same digest
        print(f"parameters sha256 {digest[:16]} at step {step}", flush=True)
    if args.summary:
        stats = state.stats()
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(f"{args.summary}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "world_size": world, "step": step, "val_acc": acc, "params_sha256": digest,
                       "fastml_step": state.step, "compression_ratio": stats["compression_ratio"],
                       "plan": stats["plan"], "shard_size": stats["shard_size"],
                       "replicate_size": stats["replicate_size"], "residual_bytes": stats["residual_bytes"]}, f)
    state.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
