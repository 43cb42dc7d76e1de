"""Lightning + FastML: train an MLP on scikit-learn's digits with ``Trainer(strategy="fastml")``.

``import fastml_strategy`` registers the strategy name; the plan comes from ``--plan`` or the
environment variable ``FASTML_PLAN`` (a recipe name such as ``int4``/``int2``/``topk1``, or a plan
JSON written by ``fastml-autotune``), default ``int4``.

Run (Lightning starts the processes itself)::

    python recipes/train_lightning.py --accelerator cpu --devices 2 --max-steps 50
    python recipes/train_lightning.py --devices 8 --precision bf16-mixed          # one GPU node
    FASTML_PLAN=plan.json python recipes/train_lightning.py --devices 8

Two nodes (torchrun starts one process per device; Lightning detects it)::

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST0:29400 \\
        --rdzv_id digits recipes/train_lightning.py --num-nodes 2 --devices 8

FSDP2 (the model sharded; FastML compresses each unit's reduce-scatter, or with ``--replicate-size``
HSDP's cross-replica all-reduce; checkpoints are folders of per-rank shards, FastML's included)::

    python recipes/train_lightning.py --strategy fastml_fsdp --accelerator cpu --devices 2 --max-steps 50
    python recipes/train_lightning.py --strategy fastml_fsdp --accelerator cpu --devices 4 --replicate-size 2
    torchrun --nnodes 2 --nproc_per_node 8 ... recipes/train_lightning.py --strategy fastml_fsdp \\
        --num-nodes 2 --devices 8 --hybrid      # shard inside a node, replicate across nodes

Compression figures go to the logger (``fastml/compression_ratio``, ``fastml/bytes_sent_per_step``,
``fastml/rel_error/<layer>``, and with FSDP ``fastml/residual_bytes``; see ``lightning_logs/``).
Checkpoints carry every rank's FastML state, so ``--resume last`` continues exactly where the last run
stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
from torch import nn

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

import fastml_strategy  # noqa: F401  registers strategy="fastml" and "fastml_fsdp"
from fastml_strategy.lightning import FastMLFSDPStrategy, FastMLStrategy


class DigitsData(L.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        y = torch.tensor(y, dtype=torch.long)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[perm], y[perm]
        self.train = torch.utils.data.TensorDataset(x[:1500], y[:1500])
        self.val = torch.utils.data.TensorDataset(x[1500:], y[1500:])

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self.train, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val, batch_size=256)


class DigitsMLP(L.LightningModule):
    def __init__(self, hidden: int = 256, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        # The hidden weight matrices (>= 4096 elements) are compressed; output layer and biases are not.
        self.net = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                 nn.Linear(hidden, 10))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True, prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=None, help="recipe name or plan JSON (default: $FASTML_PLAN or int4)")
    ap.add_argument("--strategy", default="fastml", choices=["fastml", "fastml_fsdp"],
                    help="fastml: DDP; fastml_fsdp: FSDP2 (each Linear its own unit)")
    ap.add_argument("--replicate-size", type=int, default=None, help="fastml_fsdp: HSDP with this many replicas")
    ap.add_argument("--hybrid", action="store_true", help="fastml_fsdp: HSDP, one replica per node")
    ap.add_argument("--accelerator", default="auto")
    ap.add_argument("--devices", default="auto", help="processes per node (Lightning launches them)")
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed (GPU)")
    ap.add_argument("--max-steps", type=int, default=-1, help="stop after this many optimizer steps")
    ap.add_argument("--max-epochs", type=int, default=5)
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", default="lightning_logs", help="logs and checkpoints go here")
    ap.add_argument("--resume", default=None, help="checkpoint path, or 'last'")
    ap.add_argument("--summary", default=None, help="write final figures to SUMMARY.rank<R>.json")
    args = ap.parse_args()

    L.seed_everything(0)
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    if args.strategy == "fastml":
        strategy = FastMLStrategy(plan=args.plan)  # or strategy="fastml" (plan from FASTML_PLAN)
    else:  # or strategy="fastml_fsdp" (default wrap rule, plan from FASTML_PLAN)
        strategy = FastMLFSDPStrategy(plan=args.plan, auto_wrap_policy={nn.Linear},
                                      replicate_size=args.replicate_size, hybrid=args.hybrid)
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator, devices=devices, num_nodes=args.num_nodes, precision=args.precision,
        max_steps=args.max_steps, max_epochs=args.max_epochs, accumulate_grad_batches=args.accumulate,
        logger=CSVLogger(args.out, name="digits"), log_every_n_steps=10,
        callbacks=[ModelCheckpoint(dirpath=os.path.join(args.out, "checkpoints"), save_last=True)],
    )
    model, data = DigitsMLP(args.hidden, args.lr), DigitsData(args.batch_size)
    trainer.fit(model, data, ckpt_path=args.resume)

    stats = trainer.strategy.compression_stats()
    metrics = trainer.validate(model, data, verbose=False)[0]
    if trainer.is_global_zero:
        print(f"compression {stats['compression_ratio']:.2f}x over {stats['steps']} steps, "
              f"validation accuracy {metrics['val_acc']:.3f}", flush=True)
    if args.summary:
        from torch.distributed.tensor import DTensor

        h = hashlib.sha256()
        for name, p in sorted(model.state_dict().items()):  # FSDP: gather the shards (every rank)
            t = p.full_tensor() if isinstance(p, DTensor) else p
            h.update(name.encode() + t.detach().cpu().contiguous().numpy().tobytes())
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(f"{args.summary}.rank{trainer.global_rank}.json", "w") as f:
            json.dump({"rank": trainer.global_rank, "world_size": trainer.world_size, "step": trainer.global_step,
                       "val_acc": metrics["val_acc"], "params_sha256": h.hexdigest(), "plan": stats["plan"],
                       "fastml_step": stats["steps"], "compression_ratio": stats["compression_ratio"]}, f)


if __name__ == "__main__":
    main()
