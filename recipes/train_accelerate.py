"""Hugging Face Accelerate + FastML: one call after ``accelerator.prepare``.

FastML settings travel as environment variables (``FASTML_PLAN``, ``FASTML_CHECK_REPLICAS_EVERY``,
``FASTML_LAYER_STATS_EVERY``), because Accelerate's config files reject unknown keys; every launcher
passes the environment through.

Run::

    # 2 CPU processes on this machine (`accelerate launch --cpu --num_processes 2` starts only ONE):
    torchrun --nproc_per_node 2 recipes/train_accelerate.py --cpu --max-steps 50
    # 2 CPU processes through accelerate + Open MPI (Debian: apt-get install openmpi-bin):
    accelerate launch --config_file recipes/accelerate/multi_cpu.yaml recipes/train_accelerate.py --cpu
    # ... as root, Open MPI refuses to start unless both variables are set:
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \\
        accelerate launch --config_file recipes/accelerate/multi_cpu.yaml recipes/train_accelerate.py --cpu
    # one GPU node, 8 GPUs:
    FASTML_PLAN=int4 accelerate launch --config_file recipes/accelerate/single_node_multi_gpu.yaml \\
        recipes/train_accelerate.py --mixed-precision bf16
    # two nodes: the same command on each, with machine_rank 0 / 1 (see multi_node.yaml)

FSDP2 (the model sharded; FastML compresses the reduce-scatter, or HSDP's cross-replica all-reduce)::

    # GPUs: Accelerate's FSDP plugin with fsdp_version: 2 shards the model in prepare()
    FASTML_PLAN=int4 accelerate launch --config_file recipes/accelerate/fsdp2.yaml recipes/train_accelerate.py
    # CPU: Accelerate 1.15 ignores its FSDP plugin on CPU (it trains DDP instead), so shard yourself:
    torchrun --nproc_per_node 2 recipes/train_accelerate.py --cpu --fully-shard --max-steps 50

Local steps (below 1 Gbit/s: no DDP wrapper, every process trains alone and every ``--every`` H steps
the processes average their compressed pseudo-gradients; ``prepare_local_sgd`` then ``local.step()``)::

    torchrun --nproc_per_node 2 recipes/train_accelerate.py --cpu --every 10 --max-steps 100

``--ckpt DIR`` saves with ``accelerator.save_state`` (model, optimizer, RNG and the FastML state of
every rank; with ``--fully-shard`` model and optimizer go to ``DIR/model_optimizer`` through
``torch.distributed.checkpoint``, since Accelerate does not know the model); ``--resume DIR``
restores with ``accelerator.load_state`` and continues exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys

import torch
from torch import nn

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, DistributedDataParallelKwargs, DistributedType, set_seed

import fastml_strategy.accelerate


def digits_split():
    from fastml_strategy._digits import digits_table  # scikit-learn's digits, without importing it

    x, y = digits_table()
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return torch.utils.data.TensorDataset(x[:1500], y[:1500]), torch.utils.data.TensorDataset(x[1500:], y[1500:])


def shard_yourself(model: nn.Sequential) -> nn.Sequential:
    """FSDP2 without Accelerate's plugin: each Linear its own unit, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def model_optimizer_checkpoint(model, optimizer, folder: str, load: bool) -> None:
    """--fully-shard: model and optimizer shards through torch.distributed.checkpoint (every rank its own)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    if not load:
        dcp.save(state, checkpoint_id=folder)
        return
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def params_sha256(model) -> str:
    """sha256 of the full parameters (sharded ones gathered: every process must call it)."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        t = p.full_tensor() if isinstance(p, DTensor) else p
        h.update(name.encode() + t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=None, help="recipe name or plan JSON (default: $FASTML_PLAN or int4)")
    ap.add_argument("--cpu", action="store_true", help="train on CPU even if a GPU is present")
    ap.add_argument("--fully-shard", action="store_true",
                    help="shard the model with FSDP2's fully_shard yourself (FSDP2 on CPU, where Accelerate "
                         "ignores its FSDP plugin); prepare() then gets the data loader only")
    ap.add_argument("--every", type=int, default=None, metavar="H",
                    help="local steps instead of DDP: prepare the model without the DDP wrapper and "
                         "synchronise it every H optimizer steps (fastml_strategy.accelerate.prepare_local_sgd)")
    ap.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    ap.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--max-steps", type=int, default=300, help="optimizer steps to train")
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ckpt", default=None, help="accelerator.save_state here (at the end, or at --ckpt-at)")
    ap.add_argument("--ckpt-at", type=int, default=None, help="save --ckpt after this many steps, then go on")
    ap.add_argument("--resume", default=None, help="accelerator.load_state from here")
    ap.add_argument("--summary", default=None, help="write final figures to SUMMARY.rank<R>.json")
    args = ap.parse_args()

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.accumulate,
                              # shuffle order from (seed, epoch), not from the RNG's position: a resumed
                              # run then sees the batches the uninterrupted run saw
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
                              # gradients as views into DDP's buckets: DDP copies none into its buckets
                              # and back (FastMLStrategy does this by default; Accelerate cannot)
                              kwargs_handlers=[DistributedDataParallelKwargs(gradient_as_bucket_view=True)])
    if args.fully_shard and args.every is not None:
        raise SystemExit("--fully-shard and --every: local steps train a whole replica per process; drop one")
    if args.fully_shard and accelerator.distributed_type == DistributedType.FSDP:
        raise SystemExit("--fully-shard is for runs where Accelerate does not shard (CPU); with an FSDP "
                         "config (recipes/accelerate/fsdp2.yaml) prepare() shards the model itself: drop it")
    set_seed(0)
    train, val = digits_split()
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 10))
    if args.fully_shard:
        model = shard_yourself(model)  # before the optimizer: fully_shard replaces the parameters
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        loader = accelerator.prepare(loader)
    elif args.every is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    # The one FastML line: registers on the DDP or FSDP2 model (None in a single process) and its state
    # for save_state/load_state. With --every: prepare without DDP and build LocalSGD on the model (its
    # state registered for save_state/load_state too); local.step() after each optimizer step.
    local = None
    try:
        if args.every is None:
            state = fastml_strategy.accelerate.setup(accelerator, model, plan=args.plan)
        else:
            model, optimizer, loader = fastml_strategy.accelerate.prepare_local_sgd(
                accelerator, model, optimizer, loader, plan=args.plan, every=args.every)
            state = local = accelerator.fastml_localsgd  # None in a single process
    except ValueError as e:  # a bad plan (or FASTML_PLAN): the same error on every process, before any step
        # one line for the whole job: the main process prints it, every process exits with status 2 by
        # itself (torchrun stops the others with SIGTERM once one has exited, sooner than a normal
        # interpreter exit takes: hence os._exit, and a SIGTERM handler for one that comes first)
        signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
        if accelerator.is_main_process:
            print(f"{os.path.basename(__file__)}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        accelerator.end_training()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)

    def save(folder: str, at_step: int) -> None:
        accelerator.save_state(folder)  # every process calls it; FastML gathers every rank's state
        if args.fully_shard:
            model_optimizer_checkpoint(model, optimizer, os.path.join(folder, "model_optimizer"), load=False)
        if accelerator.is_main_process:
            with open(os.path.join(folder, "progress.json"), "w") as f:
                json.dump({"step": at_step}, f)
        accelerator.wait_for_everyone()

    step = 0
    if args.resume:
        accelerator.load_state(args.resume)
        if args.fully_shard:
            model_optimizer_checkpoint(model, optimizer, os.path.join(args.resume, "model_optimizer"), load=True)
        with open(os.path.join(args.resume, "progress.json")) as f:
            step = json.load(f)["step"]
    first_step = step
    batches_per_epoch = len(loader)
    micro = step * args.accumulate  # micro-batches consumed so far
    while step < args.max_steps:
        epoch = micro // batches_per_epoch
        loader.set_epoch(epoch)
        # Resuming mid-epoch: skip the micro-batches already seen (Accelerate's skip_first_batches).
        skipped = accelerator.skip_first_batches(loader, micro % batches_per_epoch) if micro % batches_per_epoch \
            else loader
        for x, y in skipped:
            with accelerator.accumulate(model):  # no_sync micro-batches call no hook
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            micro += 1
            if accelerator.sync_gradients:
                if local is not None:
                    local.step()  # an inner step; every H of them, the compressed synchronisation
                step += 1
                if state is not None and step % 50 == 0:
                    s = state.stats()
                    accelerator.print(f"step {step} loss {loss.item():.4f} compression {s['compression_ratio']:.2f}x")
                if args.ckpt and step == args.ckpt_at:
                    save(args.ckpt, step)
                if step >= args.max_steps:
                    break

    model.eval()
    with torch.no_grad():
        xv, yv = (t.to(accelerator.device) for t in val.tensors)
        acc = (model(xv).argmax(-1) == yv).float().mean().item()
    stats = state.stats() if state is not None else {"compression_ratio": 1.0, "plan": None, "steps": 0}
    if local is not None:
        accelerator.print(f"local steps: {stats['outer_steps']} synchronisations every {stats['every']} of "
                          f"{stats['inner_steps']} steps, {stats['ratio_vs_ddp']:.0f}x fewer bytes than DDP's "
                          f"fp32 all-reduce, validation accuracy {acc:.3f}")
    else:
        accelerator.print(f"compression {stats['compression_ratio']:.2f}x over {step - first_step} steps, "
                          f"validation accuracy {acc:.3f}")
    if args.ckpt and args.ckpt_at is None:
        save(args.ckpt, step)
    if args.summary:
        digest = params_sha256(accelerator.unwrap_model(model))
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(f"{args.summary}.rank{accelerator.process_index}.json", "w") as f:
            json.dump({"rank": accelerator.process_index, "world_size": accelerator.num_processes, "step": step,
                       "val_acc": acc, "params_sha256": digest, "plan": stats["plan"],
                       "fastml_step": stats.get("steps", stats.get("inner_steps")),
                       "compression_ratio": stats["compression_ratio"],
                       "fastml_kind": type(state).__name__ if state is not None else None,
                       "residual_bytes": stats.get("residual_bytes"),
                       "model_type": type(accelerator.unwrap_model(model)).__name__,
                       "distributed_type": str(accelerator.distributed_type)}, f)
    if state is not None:
        state.close()  # FastML's hooks (and, for DDP, its process group and thread) go first
    accelerator.wait_for_everyone()  # no rank tears its groups down while another still uses them
    accelerator.end_training()


if __name__ == "__main__":
    main()
