"""Lightning Fabric + FastML: your own training loop, ``Fabric(strategy="fastml")``.

``import fastml_strategy.lightning`` registers the names with Fabric (``import fastml_strategy`` does it
only when Lightning was imported before it); ``fabric.setup(model, optimizer)`` wraps
the model in DDP and registers FastML's hook; ``fabric.save``/``fabric.load`` carry the FastML state of
every rank automatically (under the key ``"fastml_strategy"``).

Run (Fabric starts the processes itself)::

    python recipes/train_fabric.py --accelerator cpu --devices 2 --max-steps 50
    python recipes/train_fabric.py --devices 8 --precision bf16-mixed
    FASTML_PLAN=int2 python recipes/train_fabric.py --accelerator cpu --devices 2

FSDP2 (``strategy="fastml_fsdp"``: the model sharded, each Linear its own unit; ``--replicate-size``
for HSDP; ``--ckpt`` becomes a folder of per-rank shards, FastML's included)::

    python recipes/train_fabric.py --strategy fastml_fsdp --accelerator cpu --devices 2 --max-steps 50
    python recipes/train_fabric.py --strategy fastml_fsdp --accelerator cpu --devices 4 --replicate-size 2

Local steps (``strategy="fastml_localsgd"``: no DDP wrapper; every ``optimizer.step()`` counts an
inner step and every ``--every`` H steps the ranks average their compressed pseudo-gradients, so the
loop below is unchanged; ``--ckpt`` holds every rank's model, optimizer and LocalSGD state)::

    python recipes/train_fabric.py --strategy fastml_localsgd --every 10 --accelerator cpu --devices 2 --max-steps 100

Two nodes: ``torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST0:29400
--rdzv_id digits recipes/train_fabric.py --num-nodes 2 --devices 8``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import warnings

import torch
from torch import nn

import lightning.fabric as LF
from lightning.fabric.loggers import CSVLogger

# Importing fastml_strategy.lightning registers strategy="fastml", "fastml_fsdp" and "fastml_localsgd".
from fastml_strategy.lightning import FastMLFabricStrategy, FastMLFSDPFabricStrategy, FastMLLocalSGDFabricStrategy


def digits_split():
    from fastml_strategy._digits import digits_table  # scikit-learn's digits, without importing it

    x, y = digits_table()
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return torch.utils.data.TensorDataset(x[:1500], y[:1500]), torch.utils.data.TensorDataset(x[1500:], y[1500:])


def fail(message: str) -> None:
    """One line for the whole job: rank 0 prints the error, every rank exits with status 2 (a bad plan
    raises the same error on every rank, before any step)."""
    # torchrun stops the other ranks (SIGTERM) as soon as one has exited: a rank that is already failing
    # then still ends with status 2, not -15
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    # torchrun and SLURM-style launchers set RANK; Fabric's own launcher fails before starting others
    first = os.environ.get("RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"
    if first and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"{os.path.basename(__file__)}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def quiet_lightning() -> None:
    """Silence what this script triggers in Lightning and torch and cannot fix (Lightning 2.6's
    ``_pytree`` FutureWarning about a torch 2.13 deprecation); your own warnings stay."""
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.(pytorch|fabric)\.utilities\._pytree")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=None, help="recipe name or plan JSON (default: $FASTML_PLAN or int4)")
    ap.add_argument("--strategy", default="fastml", choices=["fastml", "fastml_fsdp", "fastml_localsgd"],
                    help="fastml: DDP; fastml_fsdp: FSDP2 (each Linear its own unit); fastml_localsgd: local "
                         "steps, a compressed synchronisation every --every steps")
    ap.add_argument("--replicate-size", type=int, default=None, help="fastml_fsdp: HSDP with this many replicas")
    ap.add_argument("--every", type=int, default=None, metavar="H",
                    help="fastml_localsgd: synchronise every H optimizer steps (default: "
                         "$FASTML_LOCALSGD_EVERY, else the plan's, else 50)")
    ap.add_argument("--accelerator", default="auto")
    ap.add_argument("--devices", default="auto")
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--precision", default="32-true")
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", default="fabric_logs")
    ap.add_argument("--ckpt", default=None, help="save a checkpoint here at the end")
    ap.add_argument("--resume", default=None, help="resume from this checkpoint")
    ap.add_argument("--summary", default=None, help="write final figures to SUMMARY.rank<R>.json")
    return ap


def main() -> None:
    args = build_parser().parse_args()
    quiet_lightning()
    if args.every is not None and args.strategy != "fastml_localsgd":
        fail(f"--every {args.every} sets the local-steps period: add --strategy fastml_localsgd, or drop --every")
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    try:
        if args.strategy == "fastml":
            strategy = FastMLFabricStrategy(plan=args.plan)  # or strategy="fastml"
        elif args.strategy == "fastml_fsdp":  # or strategy="fastml_fsdp"
            strategy = FastMLFSDPFabricStrategy(plan=args.plan, auto_wrap_policy={nn.Linear},
                                                replicate_size=args.replicate_size)
        else:  # or strategy="fastml_localsgd" (H from FASTML_LOCALSGD_EVERY)
            strategy = FastMLLocalSGDFabricStrategy(plan=args.plan, every=args.every)
    except ValueError as e:  # a bad plan or setting: before any process group or step
        fail(str(e))
    fabric = LF.Fabric(strategy=strategy,
                       accelerator=args.accelerator, devices=devices, num_nodes=args.num_nodes,
                       precision=args.precision, loggers=CSVLogger(args.out, name="digits"))
    fabric.launch()
    fabric.seed_everything(0)

    train, val = digits_split()
    # Our own DistributedSampler (not fabric.setup_dataloaders, which sets the sampler's epoch to the
    # number of passes made in THIS process), so that a resumed run sees the batches it would have seen.
    sampler = torch.utils.data.DistributedSampler(train, num_replicas=fabric.world_size, rank=fabric.global_rank,
                                                  shuffle=True, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 10))
    if args.strategy != "fastml_fsdp":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        model, optimizer = fabric.setup(model, optimizer)  # DDP + FastML hook (fastml_localsgd: LocalSGD, no DDP)
    else:  # sharding replaces the parameters: create the optimizer from the sharded model
        model = fabric.setup(model)  # fully_shard + FastML's compressed reduce-scatter
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9))

    state = {"model": model, "optimizer": optimizer, "step": 0}
    if args.resume:
        fabric.load(args.resume, state)  # restores the FastML state too
    strategy = fabric.strategy
    first_step = step = state["step"]
    epoch = step // len(loader)
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if epoch * len(loader) + i < step:  # resuming mid-epoch: skip what was already seen
                continue
            x, y = fabric.to_device(batch)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            fabric.backward(loss)
            optimizer.step()
            step += 1
            if step % 10 == 0:
                fabric.log_dict({"train_loss": loss.item(), **strategy.compression_metrics()}, step=step)
            if step >= args.max_steps:
                break
        epoch += 1

    model.eval()
    with torch.no_grad():
        xv, yv = (t.to(fabric.device) for t in val.tensors)
        acc = (model(xv).argmax(-1) == yv).float().mean().item()
    stats = strategy.compression_stats()
    if args.strategy == "fastml_localsgd":
        fabric.print(f"local steps: {stats['outer_steps']} synchronisations every {stats['every']} of "
                     f"{stats['inner_steps']} steps, {stats['ratio_vs_ddp']:.0f}x fewer bytes than DDP's fp32 "
                     f"all-reduce, validation accuracy {acc:.3f}")
    else:
        fabric.print(f"compression {stats['compression_ratio']:.2f}x over {step - first_step} steps, "
                     f"validation accuracy {acc:.3f}")
    if args.ckpt:
        state["step"] = step
        fabric.save(args.ckpt, state)  # every rank calls it (DDP: rank 0 writes one file, atomically;
        #                                 FSDP: a folder, each rank its shards and FastML state)
    if args.summary:
        from torch.distributed.tensor import DTensor

        h = hashlib.sha256()
        for name, p in sorted(model.state_dict().items()):  # FSDP: gather the shards (every rank)
            t = p.full_tensor() if isinstance(p, DTensor) else p
            h.update(name.encode() + t.detach().cpu().contiguous().numpy().tobytes())
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(f"{args.summary}.rank{fabric.global_rank}.json", "w") as f:
            json.dump({"rank": fabric.global_rank, "world_size": fabric.world_size, "step": step, "val_acc": acc,
                       "params_sha256": h.hexdigest(), "plan": stats["plan"],
                       "fastml_step": stats.get("steps", stats.get("inner_steps")),
                       "compression_ratio": stats["compression_ratio"]}, f)
    fabric.logger.finalize("success")
    if args.strategy == "fastml_localsgd":
        strategy.teardown()  # LocalSGD's communication thread and process group


if __name__ == "__main__":
    main()
