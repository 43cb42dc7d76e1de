"""Lightning + FastML: train an MLP on scikit-learn's digits with ``Trainer(strategy="fastml")``.

``import fastml_strategy.lightning`` registers the strategy names (``import fastml_strategy`` does it
only when Lightning was imported before it); the plan comes from ``--plan`` or the
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

Local steps (``strategy="fastml_localsgd"``: no DDP wrapper, every rank trains alone and every
``--every`` H steps the ranks average their compressed pseudo-gradients; for links below 1 Gbit/s)::

    python recipes/train_lightning.py --strategy fastml_localsgd --every 10 --accelerator cpu --devices 2 --max-steps 100

How long: ``--max-steps N`` optimizer steps (the epochs then run as long as needed), else
``--max-epochs`` (default 5 when no ``--max-steps`` is given).

Compression figures go to the logger (``fastml/compression_ratio``, ``fastml/bytes_sent_per_step``,
``fastml/rel_error/<layer>``, and with FSDP ``fastml/residual_bytes``; see ``lightning_logs/``).

Resuming: checkpoints (``OUT/checkpoints``: one at each epoch end, ``last`` when the run stops, and
every ``--ckpt-every N`` steps if asked; ``OUT`` defaults to ``lightning_logs/STRATEGY``, so each
strategy's checkpoints stay apart) carry every rank's FastML state and, because the training
batches come from a resumable loader (``ResumableLoader``: the shuffle order depends on the epoch
only, and its position within the epoch is saved), ``--resume last --max-steps 100`` after a 50-step
run continues at step 51 with the batch an uninterrupted run would have used, and reaches the same
parameters bit for bit (resume with the same number of processes and the same ``--batch-size``)::

    python recipes/train_lightning.py --accelerator cpu --devices 2 --max-steps 50
    python recipes/train_lightning.py --accelerator cpu --devices 2 --max-steps 100 --resume last

``--resume last`` takes the newest ``last*.ckpt`` in ``OUT/checkpoints`` that the same ``--strategy``
wrote (Lightning logs "Restored all states from the checkpoint at PATH"); a checkpoint of another
strategy, or none at all, stops the run with one line that says what to pass instead; so does a
local-steps checkpoint written with another ``--every``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import signal
import sys
import warnings

import torch
from torch import nn

import lightning.pytorch as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

# Importing fastml_strategy.lightning registers strategy="fastml", "fastml_fsdp" and "fastml_localsgd".
from fastml_strategy.lightning import FastMLFSDPStrategy, FastMLLocalSGDStrategy, FastMLStrategy

STRATEGIES = ("fastml", "fastml_fsdp", "fastml_localsgd")
# The key under which a checkpoint of this recipe records the --strategy that wrote it.
STRATEGY_KEY = "recipe_strategy"


def quiet_lightning(resuming: bool) -> None:
    """Silence what this script triggers in Lightning and torch and cannot fix; your own warnings stay.

    - Lightning 2.6's ``_pytree`` calls a torch API that torch 2.13 deprecated (``FutureWarning``, once
      per fit/validate and rank); only warnings raised from that Lightning module are dropped;
    - the "💡 Tip" advertisements Lightning logs at startup;
    - torch.distributed.checkpoint's "Detected an existing checkpoint ... overwriting" for ``last.ckpt``
      (FSDP checkpoints are folders), which ``ModelCheckpoint(save_last=True)`` replaces by design;
    - when resuming into the same ``--out``: "Checkpoint directory ... exists and is not empty".
    """
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning, module=r"lightning\.pytorch\.utilities\._pytree")
    warnings.filterwarnings("ignore", message=r"Detected an existing checkpoint in .*/last(-v\d+)?\.ckpt, ",
                            category=UserWarning)

    class NoTips(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return not str(record.msg).startswith("💡 Tip")

    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(NoTips())
    if resuming:
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")


def fail(message: str) -> None:
    """One line for the whole job: rank 0 prints the error, every rank exits with status 2 (a bad plan
    raises the same error on every rank, before any step)."""
    # torchrun stops the other ranks (SIGTERM) as soon as one has exited: a rank that is already failing
    # then still ends with status 2, not -15
    signal.signal(signal.SIGTERM, lambda *_: os._exit(2))
    # torchrun and SLURM-style launchers set RANK; Lightning's own launcher fails before starting others
    first = os.environ.get("RANK", "0") == "0" and os.environ.get("NODE_RANK", "0") == "0"
    if first and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"{os.path.basename(__file__)}: error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    sys.exit(2)


def checkpoint_strategy(path: str) -> str | None:
    """The --strategy that wrote a checkpoint of this recipe (None: not known, e.g. a checkpoint
    written before the recipe recorded it). FSDP checkpoints are folders of shards."""
    if os.path.isdir(path):
        return "fastml_fsdp"
    try:  # a small file (the digits MLP); mmap: only what is read is loaded
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # not a checkpoint torch can read: Lightning's own error will say so
        return None
    if STRATEGY_KEY in ckpt:
        return str(ckpt[STRATEGY_KEY])
    fml = ckpt.get("fastml_strategy")
    if isinstance(fml, dict) and "per_rank" in fml and all("localsgd" in p for p in fml["per_rank"]):
        return "fastml_localsgd"
    return None


def resume_path(resume: str | None, ckpt_dir: str, strategy: str) -> tuple[str | None, str | None]:
    """(checkpoint to resume from, None) or (None, the one-line reason not to start).

    ``last``: the newest ``last*.ckpt`` in ``ckpt_dir`` written by ``strategy`` (Lightning's own
    ``ckpt_path="last"`` takes the newest of any strategy, and loading an FSDP folder into a DDP run
    fails deep inside ``torch.load``). A path: used if it exists and was written by ``strategy``.
    """
    if resume is None:
        return None, None
    if resume != "last":
        if not os.path.exists(resume):
            return None, f"--resume {resume}: no such checkpoint; pass a checkpoint path or 'last'"
        wrote = checkpoint_strategy(resume)
        if wrote is not None and wrote != strategy:
            return None, (f"--resume {resume} was written by --strategy {wrote}, not {strategy}; resume it "
                          f"with --strategy {wrote}")
        return resume, None
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    last = [os.path.join(ckpt_dir, n) for n in names if re.fullmatch(r"last(-v\d+)?\.ckpt", n)]
    if not last:
        return None, (f"--resume last: no last*.ckpt in {ckpt_dir}; train without --resume first, or give "
                      f"--out of an earlier run")
    # a file that does not say (written before the recipe recorded it) is a DDP one
    wrote = {p: checkpoint_strategy(p) or "fastml" for p in last}
    own = [p for p in last if wrote[p] == strategy]
    if not own:
        others = sorted(set(wrote.values()))
        return None, (f"--resume last: the checkpoints in {ckpt_dir} were written by --strategy "
                      f"{', '.join(others)}, not {strategy}; resume with that --strategy, or give --out of a "
                      f"{strategy} run")
    return max(own, key=os.path.getmtime), None


def saved_every(path: str) -> int | None:
    """The local-steps period H a fastml_localsgd checkpoint was written with (None: not one)."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return int(ckpt["fastml_strategy"]["per_rank"][0]["localsgd"]["every"])
    except Exception:  # not a local-steps checkpoint, or not one torch can read
        return None


def check_plan(plan, model: nn.Module, flag: str | None) -> str | None:
    """The one-line reason the plan does not fit ``model`` (a layer name it lacks), else None.

    FastML refuses such a plan at setup, on every rank alike, but that is inside ``trainer.fit``,
    after Lightning started the other processes, as a traceback per rank; checked here, it stops the
    run before any process starts, like the other plan errors (a bad recipe name, an unreadable file).
    """
    params = dict(model.named_parameters())
    try:
        plan.resolve_names([n for n, p in params.items() if p.requires_grad],
                           frozen=[n for n, p in params.items() if not p.requires_grad])
    except ValueError as e:
        return f"{f'--plan {flag}' if flag else 'FASTML_PLAN=' + os.environ.get('FASTML_PLAN', '')}: {e}"
    return None


def epochs_for(max_steps: int, world_size: int, batch_size: int, accumulate: int, resuming: bool) -> int:
    """Epochs a run bounded by ``max_steps`` takes, for Lightning's ``max_epochs`` (with -1 its bar
    reads "Epoch 2/-2"). An epoch has ``len(DistributedSampler(drop_last=True)) // batch_size``
    batches (DigitsData) and an optimizer step every ``accumulate`` of them, the epoch's last one
    included. A resumed run gets one epoch more: Lightning counts one epoch ahead after resuming from a
    checkpoint that ``max_steps`` wrote mid-epoch (ResumableLoader), and ``max_steps``, not the
    epochs, must end the run."""
    samples = len(torch.utils.data.DistributedSampler(range(TRAIN_SIZE), num_replicas=world_size, rank=0,
                                                      shuffle=False, drop_last=True))
    steps = max(1, -(-(samples // batch_size) // accumulate))
    return -(-max_steps // steps) + (1 if resuming else 0)


class RecordStrategy(Callback):
    """Writes the recipe's --strategy into every checkpoint, so that a resume can check it."""

    def __init__(self, strategy: str) -> None:
        self.strategy = strategy

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[STRATEGY_KEY] = self.strategy


class ResumableLoader:
    """The training batches of one rank, resumable mid-epoch.

    Lightning saves ``state_dict()`` in every checkpoint and hands it back to ``load_state_dict()`` on
    ``fit(ckpt_path=...)``. Without it, a checkpoint taken mid-epoch (``--max-steps`` reached,
    ``--ckpt-every``) resumes with the wrong batches ("your dataloader is not resumable") and the run
    drifts from an uninterrupted one. The order of an epoch comes from a ``DistributedSampler`` seeded
    by (seed, epoch) alone; this loader counts the epochs itself (Lightning's epoch counter is one
    ahead after resuming from a checkpoint written when ``max_steps`` stopped an epoch early) and the
    batches already yielded in the current one. With a known length Lightning fetches no batch ahead,
    so that count is exactly the batches trained on.
    """

    def __init__(self, loader: torch.utils.data.DataLoader) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.epoch = 0  # the epoch being yielded (the sampler's shuffle seed is seed + epoch)
        self.done = 0  # batches of it yielded so far

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        # Lazy: runs at the first batch, after load_state_dict on a resume.
        if self.done >= len(self):  # the previous epoch ran to its end
            self.epoch, self.done = self.epoch + 1, 0
        self.loader.sampler.set_epoch(self.epoch)
        # skip at the index level: the skipped batches are neither loaded nor collated
        for indices in list(self.loader.batch_sampler)[self.done:]:
            self.done += 1
            yield self.loader.collate_fn([self.dataset[i] for i in indices])

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.done = int(state["epoch"]), int(state["batches_done"])


TRAIN_SIZE = 1500  # digits examples trained on (DigitsData.setup); the rest validate


class DigitsData(L.LightningDataModule):
    def __init__(self, batch_size: int) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        from fastml_strategy._digits import digits_table  # scikit-learn's digits, without importing it

        x, y = digits_table()
        x = torch.tensor(x, dtype=torch.float32) / 16.0
        y = torch.tensor(y, dtype=torch.long)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
        x, y = x[perm], y[perm]
        self.train = torch.utils.data.TensorDataset(x[:TRAIN_SIZE], y[:TRAIN_SIZE])
        self.val = torch.utils.data.TensorDataset(x[TRAIN_SIZE:], y[TRAIN_SIZE:])

    def train_dataloader(self):
        # Our own sampler (Trainer(use_distributed_sampler=False)): each rank its shard, the order from
        # (seed, epoch) only, so a resumed run sees the batches the uninterrupted run saw.
        sampler = torch.utils.data.DistributedSampler(
            self.train, num_replicas=self.trainer.world_size, rank=self.trainer.global_rank, shuffle=True,
            seed=0, drop_last=True)
        return ResumableLoader(torch.utils.data.DataLoader(self.train, batch_size=self.batch_size, sampler=sampler,
                                                           drop_last=True))

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val, batch_size=512)  # every rank: the whole validation set


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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=None, help="recipe name or plan JSON (default: $FASTML_PLAN or int4)")
    ap.add_argument("--strategy", default="fastml", choices=STRATEGIES,
                    help="fastml: DDP; fastml_fsdp: FSDP2 (each Linear its own unit); fastml_localsgd: local "
                         "steps, a compressed synchronisation every --every steps")
    ap.add_argument("--replicate-size", type=int, default=None, help="fastml_fsdp: HSDP with this many replicas")
    ap.add_argument("--hybrid", action="store_true", help="fastml_fsdp: HSDP, one replica per node")
    ap.add_argument("--every", type=int, default=None, metavar="H",
                    help="fastml_localsgd: synchronise every H optimizer steps (default: "
                         "$FASTML_LOCALSGD_EVERY, else the plan's, else 50)")
    ap.add_argument("--accelerator", default="auto")
    ap.add_argument("--devices", default="auto", help="processes per node (Lightning launches them)")
    ap.add_argument("--num-nodes", type=int, default=1)
    ap.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed (GPU)")
    ap.add_argument("--max-steps", type=int, default=-1,
                    help="stop after this many optimizer steps (default: none; --max-epochs decides)")
    ap.add_argument("--max-epochs", type=int, default=None,
                    help="stop after this many epochs (default: 5 without --max-steps, else unlimited)")
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--batch-size", type=int, default=32, help="per process")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--out", default=None,
                    help="logs and checkpoints go here (default: lightning_logs/STRATEGY, one folder per strategy)")
    ap.add_argument("--resume", default=None,
                    help="checkpoint path, or 'last' (the newest last*.ckpt of this --strategy in OUT/checkpoints): "
                         "continues exactly")
    ap.add_argument("--ckpt-every", type=int, default=None, metavar="N",
                    help="also checkpoint every N optimizer steps (mid-epoch too; each resumes exactly)")
    ap.add_argument("--summary", default=None, help="write final figures to SUMMARY.rank<R>.json")
    return ap


def output_dir(args: argparse.Namespace) -> str:
    """--out, else one folder per strategy: an FSDP run's checkpoint (a folder of shards) never becomes
    the "last" of a DDP run, nor the other way round."""
    return args.out if args.out is not None else os.path.join("lightning_logs", args.strategy)


def main() -> None:
    args = build_parser().parse_args()
    out = output_dir(args)
    ckpt_dir = os.path.join(out, "checkpoints")

    quiet_lightning(resuming=args.resume is not None)
    if args.every is not None and args.strategy != "fastml_localsgd":
        fail(f"--every {args.every} sets the local-steps period: add --strategy fastml_localsgd, or drop --every")
    devices = int(args.devices) if args.devices.isdigit() else args.devices
    try:
        if args.strategy == "fastml":
            strategy = FastMLStrategy(plan=args.plan)  # or strategy="fastml" (plan from FASTML_PLAN)
        elif args.strategy == "fastml_fsdp":  # or strategy="fastml_fsdp" (default wrap rule, plan from FASTML_PLAN)
            strategy = FastMLFSDPStrategy(plan=args.plan, auto_wrap_policy={nn.Linear},
                                          replicate_size=args.replicate_size, hybrid=args.hybrid)
        else:  # or strategy="fastml_localsgd" (H from FASTML_LOCALSGD_EVERY, plan from FASTML_PLAN)
            strategy = FastMLLocalSGDStrategy(plan=args.plan, every=args.every)
    except ValueError as e:  # a bad plan or setting: before any process group or step
        fail(str(e))
    ckpt_path, refused = resume_path(args.resume, ckpt_dir, args.strategy)
    if refused:
        fail(refused)
    if ckpt_path and args.strategy == "fastml_localsgd":  # LocalSGD resumes only with the same H
        every, saved = strategy.settings["every"], saved_every(ckpt_path)
        if saved is not None and saved != every:
            fail(f"--resume {ckpt_path} was written with --every {saved}, this run has {every}; resume with "
                 f"--every {saved}")
    L.seed_everything(0)
    max_epochs = args.max_epochs if args.max_epochs is not None else (5 if args.max_steps < 0 else -1)
    checkpoints = [ModelCheckpoint(dirpath=ckpt_dir, save_last=True)]
    if args.ckpt_every:
        checkpoints.append(ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1, every_n_train_steps=args.ckpt_every))
    trainer = L.Trainer(
        strategy=strategy,
        accelerator=args.accelerator, devices=devices, num_nodes=args.num_nodes, precision=args.precision,
        max_steps=args.max_steps, max_epochs=max_epochs, accumulate_grad_batches=args.accumulate,
        use_distributed_sampler=False,  # DigitsData shards the data itself, resumably
        logger=CSVLogger(out, name="digits"), log_every_n_steps=10,
        callbacks=[*checkpoints, RecordStrategy(args.strategy)],
    )
    model, data = DigitsMLP(args.hidden, args.lr), DigitsData(args.batch_size)
    refused = check_plan(strategy.plan, model, args.plan)
    if refused:
        fail(refused)
    if max_epochs == -1 and args.max_steps > 0:  # the bar then reads "Epoch 2/3", not "Epoch 2/-2"
        trainer.fit_loop.max_epochs = epochs_for(args.max_steps, trainer.world_size, args.batch_size,
                                                 args.accumulate, resuming=ckpt_path is not None)
    trainer.fit(model, data, ckpt_path=ckpt_path)

    stats = trainer.strategy.compression_stats()
    steps = stats["inner_steps"] if args.strategy == "fastml_localsgd" else stats["steps"]
    model.eval()
    with torch.no_grad():  # every rank (an FSDP model gathers its shards): the whole validation set
        xv, yv = data.val.tensors
        val_acc = (model(xv.to(model.device)).argmax(-1).cpu() == yv).float().mean().item()
    if trainer.is_global_zero:
        if args.strategy == "fastml_localsgd":
            print(f"local steps: {stats['outer_steps']} synchronisations every {stats['every']} of "
                  f"{steps} steps, {stats['ratio_vs_ddp']:.0f}x fewer bytes than DDP's fp32 all-reduce "
                  f"(step {trainer.global_step}), validation accuracy {val_acc:.3f}", flush=True)
        else:
            print(f"compression {stats['compression_ratio']:.2f}x over {steps} steps (step "
                  f"{trainer.global_step}), validation accuracy {val_acc:.3f}", flush=True)
    if args.summary:
        from torch.distributed.tensor import DTensor

        h = hashlib.sha256()
        for name, p in sorted(model.state_dict().items()):  # FSDP: gather the shards (every rank)
            t = p.full_tensor() if isinstance(p, DTensor) else p
            h.update(name.encode() + t.detach().cpu().contiguous().numpy().tobytes())
        os.makedirs(os.path.dirname(os.path.abspath(args.summary)), exist_ok=True)
        with open(f"{args.summary}.rank{trainer.global_rank}.json", "w") as f:
            json.dump({"rank": trainer.global_rank, "world_size": trainer.world_size, "step": trainer.global_step,
                       "val_acc": val_acc, "params_sha256": h.hexdigest(), "plan": stats["plan"],
                       "fastml_step": steps, "compression_ratio": stats["compression_ratio"]}, f)


if __name__ == "__main__":
    main()
