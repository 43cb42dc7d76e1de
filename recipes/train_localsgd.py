"""Local steps with compressed outer synchronisation (DiLoCo-style) with plain torch.distributed: train an
MLP on scikit-learn's digits, launched by torchrun, for links too slow to all-reduce every step.

The model is NOT wrapped in DDP: every rank trains its own copy for ``--every`` = H inner steps with no
communication, then FastML averages the pseudo-gradients (last shared parameters minus the local ones,
compressed with ``--plan`` and error feedback) and an outer optimizer applies the average on every
rank. The whole integration::

    local = fastml_strategy.LocalSGD(model, inner, every=H, plan="int4")  # every rank; broadcasts rank 0's weights
    ... loss.backward(); inner.step(); inner.zero_grad(); local.step()     # per inner step

Run (CPU, 2 processes on this machine; on GPUs the backend becomes NCCL by itself)::

    torchrun --nproc_per_node 2 recipes/train_localsgd.py --max-steps 300
    torchrun --nproc_per_node 2 recipes/train_localsgd.py --every 50 --fragments 2 --delay 5
    torchrun --nproc_per_node 2 recipes/train_localsgd.py --outer nesterov --outer-lr 0.7 --outer-momentum 0.9

The outer step's default here is plain averaging (``--outer sgd --outer-lr 1 --outer-momentum 0``),
because that is what measured best on this task: with 2 ranks, Adam 1e-3, H=20 and int4, averaging
stayed within 0.3 points of DDP's accuracy, DiLoCo's Nesterov (lr 0.7, momentum 0.9) lost about 2.5
points and Nesterov with momentum 0.6 about 0.55. Measure the outer settings on your own task
(``benchmarks/bench_localsgd.py`` does it for a small language model).

``--fragments F --delay D`` (Streaming DiLoCo): the parameters are synchronised in F fragments at
staggered steps, each on a communication thread while training goes on, applied D inner steps later
(D < H / F).

Checkpoints (``--ckpt``, written at the end or after ``--ckpt-at`` steps) hold, for EVERY rank, its
model, its inner optimizer and its ``local.state_dict()`` (shared parameters, outer optimizer,
error-feedback residuals, counters and any fragment update still waiting for its delay): between two
synchronisations the ranks' models and optimizers differ, so all of it is per rank. Rank 0 gathers
them and writes one file atomically (beside the target, then renamed: never a torn or half-written
checkpoint). ``--resume`` continues the same trajectory exactly; resume with the same number of
processes and the same ``--every``, ``--fragments`` and ``--plan``.
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
from torch.utils.data import TensorDataset

import fastml_strategy
from fastml_strategy._digits import load_digits_split


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

    LocalSGD checks its arguments and agrees on the plan across ranks in its constructor, so every
    rank raises the same error; printing it once (not a traceback per rank) is the whole report.

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


def _cpu(obj):
    """A copy of a (nested) state dict with every tensor on the CPU, to gather and save."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def save_checkpoint(path: str, model: nn.Module, inner, local, step: int, args) -> None:
    """Every rank's model, inner optimizer and LocalSGD state in one file, written by rank 0.

    A collective: every rank calls it at the same inner step.
    """
    own = _cpu({"rank": dist.get_rank(), "model": model.state_dict(), "inner_optimizer": inner.state_dict(),
                "localsgd": local.state_dict()})  # waits for a pending fragment's communication first
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(own, gathered, dst=0)
    if dist.get_rank() == 0:
        ckpt = {"step": step, "world_size": dist.get_world_size(), "per_rank": gathered,
                "settings": {k: getattr(args, k) for k in ("every", "fragments", "delay", "outer", "outer_lr",
                                                           "outer_momentum", "mix", "lr", "batch_size",
                                                           "hidden")}}
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".ckpt.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:  # write beside the target, then rename: never a torn file
                torch.save(ckpt, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    dist.barrier()


def load_checkpoint(path: str, model: nn.Module, inner, local, device: torch.device) -> int:
    """This rank's part of a checkpoint; returns the inner step to continue from."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if ckpt["world_size"] != dist.get_world_size():
        fail(f"--resume {path}: saved by {ckpt['world_size']} processes, this job has {dist.get_world_size()}; "
             f"resume with --nproc_per_node {ckpt['world_size']}")
    own = ckpt["per_rank"][dist.get_rank()]
    model.load_state_dict(own["model"])
    inner.load_state_dict(own["inner_optimizer"])  # moves its state to the parameters' device
    try:
        local.load_state_dict(own["localsgd"])  # checks world size, every, fragments and plan
    except ValueError as e:
        fail(f"--resume {path}: {e}")
    return int(ckpt["step"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=int, default=20, help="inner steps between two synchronisations (H)")
    ap.add_argument("--fragments", type=int, default=1, help="streaming: synchronise the model in F fragments")
    ap.add_argument("--delay", type=int, default=0,
                    help="streaming: apply a fragment's outer update this many inner steps after its "
                         "synchronisation starts (its communication overlaps them); < every / fragments")
    ap.add_argument("--mix", type=float, default=1.0,
                    help="share of the new shared value a delayed fragment takes (1: replicas identical)")
    ap.add_argument("--plan", default=None, help="compression of the pseudo-gradients: recipe name or plan "
                    "JSON (default: $FASTML_PLAN or int4)")
    ap.add_argument("--outer", default="sgd", choices=["sgd", "nesterov"],
                    help="outer optimizer (default sgd with --outer-lr 1 --outer-momentum 0: averaging)")
    ap.add_argument("--outer-lr", type=float, default=1.0)
    ap.add_argument("--outer-momentum", type=float, default=0.0)
    ap.add_argument("--max-steps", type=int, default=300, help="inner steps to train")
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3, help="inner optimizer (Adam) learning rate")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--ckpt", default=None, help="save a checkpoint here (at the end, or at --ckpt-at)")
    ap.add_argument("--ckpt-at", type=int, default=None, help="save --ckpt after this many inner steps, then go on")
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

    xtr, ytr, xte, yte = load_digits_split()
    train = TensorDataset(xtr, ytr)
    sampler = torch.utils.data.DistributedSampler(train, shuffle=True, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler)
    model = make_model(args.hidden).to(device)  # no DDP: LocalSGD synchronises it every H steps
    inner = torch.optim.Adam(model.parameters(), lr=args.lr)

    try:  # checks the arguments and the plan on every rank, then broadcasts rank 0's weights
        local = fastml_strategy.LocalSGD(model, inner, every=args.every, outer=args.outer, outer_lr=args.outer_lr,
                                         outer_momentum=args.outer_momentum, plan=args.plan,
                                         fragments=args.fragments, delay=args.delay, mix=args.mix)
    except ValueError as e:  # the same error on every rank, before any step
        fail(str(e))

    step = load_checkpoint(args.resume, model, inner, local, device) if args.resume else 0
    steps_per_epoch = len(loader)
    while step < args.max_steps:
        sampler.set_epoch(step // steps_per_epoch)
        for i, (x, y) in enumerate(loader):
            if i < step % steps_per_epoch:  # resuming mid-epoch: skip what was already seen
                continue
            loss = nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()  # no communication: the gradients stay on this rank
            inner.step()
            inner.zero_grad(set_to_none=True)
            local.step()  # every H steps (per fragment): the compressed outer synchronisation
            step += 1
            if rank == 0 and (step % args.log_every == 0 or step == args.max_steps):
                s = local.stats()
                # the counters continue from the checkpoint when resuming: like with like
                print(f"step {step} loss {loss.item():.4f} outer steps {s['outer_steps']} "
                      f"{s['bytes_per_inner_step'] / 1024:.2f} KiB sent per inner step, "
                      f"{s['ratio_vs_ddp']:.0f}x fewer bytes than DDP fp32 "
                      f"(compression {s['compression_ratio']:.2f}x)", flush=True)
            if args.ckpt and step == args.ckpt_at:
                save_checkpoint(args.ckpt, model, inner, local, step, args)
            if step >= args.max_steps:
                break

    local.synchronize()  # apply a fragment update still waiting for its delay
    # Each rank evaluates its own model: identical across ranks right after a synchronisation of the
    # whole model (a multiple of --every without streaming), otherwise they differ by the local steps since.
    model.eval()
    with torch.no_grad():
        acc = (model(xte.to(device)).argmax(-1).cpu() == yte).float().mean().item()
    accs = [None] * world
    dist.all_gather_object(accs, acc)
    if rank == 0:
        s = local.stats()
        print(f"validation accuracy {acc:.3f} (rank 0; all ranks: {' '.join(f'{a:.3f}' for a in accs)}); "
              f"{s['inner_steps']} inner steps, {s['outer_steps']} fragment synchronisations, "
              f"{s['bytes_per_inner_step'] / 1024:.2f} KiB sent per inner step, {s['ratio_vs_ddp']:.0f}x fewer "
              f"bytes than DDP fp32", flush=True)
    if args.ckpt and args.ckpt_at is None:
        save_checkpoint(args.ckpt, model, inner, local, step, args)
    if args.summary:
        s = local.stats()
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(f"{args.summary}.rank{rank}.json", "w") as f:
            json.dump({"rank": rank, "world_size": world, "step": step, "val_acc": acc,
                       "params_sha256": params_sha256(model), **{k: s[k] for k in (
                           "inner_steps", "outer_steps", "every", "fragments", "plan", "bytes_sent",
                           "bytes_per_inner_step", "ratio_vs_ddp", "compression_ratio", "residual_bytes")}}, f)
    local.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
