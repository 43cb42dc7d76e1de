"""Hugging Face Accelerate + FastML: one call after ``accelerator.prepare``.

FastML settings travel as environment variables (``FASTML_PLAN``, ``FASTML_CHECK_REPLICAS_EVERY``,
``FASTML_LAYER_STATS_EVERY``), because Accelerate's config files reject unknown keys; every launcher
passes the environment through.

Run::

    # 2 CPU processes on this machine (`accelerate launch --cpu --num_processes 2` starts only ONE):
    torchrun --nproc_per_node 2 recipes/train_accelerate.py --cpu --max-steps 50
    # 2 CPU processes through accelerate + Open MPI (Debian: apt-get install openmpi-bin):
    accelerate launch --config_file recipes/accelerate/multi_cpu.yaml recipes/train_accelerate.py --cpu
    # one GPU node, 8 GPUs:
    FASTML_PLAN=int4 accelerate launch --config_file recipes/accelerate/single_node_multi_gpu.yaml \\
        recipes/train_accelerate.py --mixed-precision bf16
    # two nodes: the same command on each, with machine_rank 0 / 1 (see multi_node.yaml)

``--ckpt DIR`` saves with ``accelerator.save_state`` (model, optimizer, RNG and the FastML state of
every rank); ``--resume DIR`` restores with ``accelerator.load_state`` and continues exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
from torch import nn

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed

import fastml_strategy.accelerate


def digits_split():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32) / 16.0
    y = torch.tensor(y, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    return torch.utils.data.TensorDataset(x[:1500], y[:1500]), torch.utils.data.TensorDataset(x[1500:], y[1500:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=None, help="recipe name or plan JSON (default: $FASTML_PLAN or int4)")
    ap.add_argument("--cpu", action="store_true", help="train on CPU even if a GPU is present")
    ap.add_argument("--mixed-precision", default="no", choices=["no", "fp16", "bf16"])
    ap.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    ap.add_argument("--max-steps", type=int, default=300, help="optimizer steps to train")
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--ckpt", default=None, help="accelerator.save_state here at the end")
    ap.add_argument("--resume", default=None, help="accelerator.load_state from here")
    ap.add_argument("--summary", default=None, help="write final figures to SUMMARY.rank<R>.json")
    args = ap.parse_args()

    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.accumulate,
                              # shuffle order from (seed, epoch), not from the RNG's position: a resumed
                              # run then sees the batches the uninterrupted run saw
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    train, val = digits_split()
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True)
    model = nn.Sequential(nn.Linear(64, args.hidden), nn.ReLU(), nn.Linear(args.hidden, args.hidden), nn.ReLU(),
                          nn.Linear(args.hidden, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    # The one FastML line: registers the hook on the DDP model (None in a single process) and its state
    # for save_state/load_state.
    state = fastml_strategy.accelerate.setup(accelerator, model, plan=args.plan)

    step = 0
    if args.resume:
        accelerator.load_state(args.resume)
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
                step += 1
                if state is not None and step % 50 == 0:
                    s = state.stats()
                    accelerator.print(f"step {step} loss {loss.item():.4f} compression {s['compression_ratio']:.2f}x")
                if step >= args.max_steps:
                    break

    model.eval()
    with torch.no_grad():
        xv, yv = (t.to(accelerator.device) for t in val.tensors)
        acc = (model(xv).argmax(-1) == yv).float().mean().item()
    stats = state.stats() if state is not None else {"compression_ratio": 1.0, "plan": None, "steps": 0}
    accelerator.print(f"compression {stats['compression_ratio']:.2f}x over {step - first_step} steps, "
                      f"validation accuracy {acc:.3f}")
    if args.ckpt:
        accelerator.save_state(args.ckpt)  # every process calls it; FastML gathers every rank's state
        if accelerator.is_main_process:
            with open(os.path.join(args.ckpt, "progress.json"), "w") as f:
                json.dump({"step": step}, f)
        accelerator.wait_for_everyone()
    if args.summary:
        h = hashlib.sha256()
        for name, p in sorted(accelerator.unwrap_model(model).state_dict().items()):
            h.update(name.encode() + p.detach().cpu().contiguous().numpy().tobytes())
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(f"{args.summary}.rank{accelerator.process_index}.json", "w") as f:
            json.dump({"rank": accelerator.process_index, "world_size": accelerator.num_processes, "step": step,
                       "val_acc": acc, "params_sha256": h.hexdigest(), "plan": stats["plan"],
                       "fastml_step": stats["steps"], "compression_ratio": stats["compression_ratio"],
                       "distributed_type": str(accelerator.distributed_type)}, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
