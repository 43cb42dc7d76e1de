"""Trainer(strategy="fastml_fsdp") on 2 CPU processes started by Lightning's own launcher (run as a script).

``python fsdp_lightning_job.py OUT PART[,PART...]``; every rank writes ``OUT/<part>.rank<r>.json``.

Parts (each a sequence of Trainers in the same two processes):

- ``basic``: ``strategy="fastml_fsdp"`` (plan from FASTML_PLAN, default wrap policy: the digits MLP is
  one root unit) with a CSV logger; ``auto_wrap_policy={nn.Linear}`` with gradient accumulation and a
  quantized parameter all-gather (``all_gather_bits=8``); a
  ``configure_model`` that shards two layers itself (the strategy adds the root).
- ``resume``: 20 steps straight (a distributed checkpoint at step 10, an epoch boundary), resume from
  step 10 to 20; the same through a single-file checkpoint (``save_distributed_checkpoint=False``);
  and resume from the distributed checkpoint without its FastML subfolder (must differ).
- ``errors``: FSDP1 inside ``strategy="fastml_fsdp"``, and ``fully_shard`` inside ``strategy="fastml"``
  (last: a failed fit tears its Trainer down).
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn

import lightning.pytorch as L
from lightning.pytorch.loggers import CSVLogger

from fastml_strategy.lightning import CHECKPOINT_KEY, FastMLFSDPStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _task import digits, full_digest, mlp, units, write_json  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LitLogger.*")
warnings.filterwarnings("ignore", ".*LeafSpec.*")
warnings.filterwarnings("ignore", ".*weights_only.*")


class Net(L.LightningModule):
    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = mlp()
        self.lr = lr
        self.changed = 0

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True)
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.changed += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class SelfSharded(Net):
    """Shards two layers itself, on the strategy's mesh; the strategy adds the root unit."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net[0], mesh=self.device_mesh)
        fully_shard(self.net[2], mesh=self.device_mesh)


class FSDP1Inside(Net):
    def configure_model(self):
        from torch.distributed.fsdp import FullyShardedDataParallel

        self.net[2] = FullyShardedDataParallel(self.net[2], device_id=torch.device("cpu"))


class FullyShardInside(Net):
    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.net[2])


def loader(n: int, batch_size: int = 16):
    return torch.utils.data.DataLoader(digits(n), batch_size=batch_size, shuffle=True)


def trainer(strategy="fastml_fsdp", **kw) -> L.Trainer:
    base = dict(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    base.update(kw)
    return L.Trainer(**base)


def summary(t: L.Trainer, model: Net) -> dict:
    return {"strategy": type(t.strategy).__name__, "plan": t.strategy.plan.name, "digest": full_digest(model),
            "stats": t.strategy.compression_stats(), "fastml_step": t.strategy.fastml_state.step,
            "global_step": t.global_step, "units": units(model), "changed": model.changed,
            "mesh": list(t.strategy.device_mesh.mesh_dim_names)}


def part_basic(out: str) -> dict:
    L.seed_everything(0)
    model = Net()
    t = trainer(max_steps=6, logger=CSVLogger(out, name="csv", version=0), log_every_n_steps=2)
    t.fit(model, loader(320))
    res = {"default": summary(t, model)}

    L.seed_everything(0)
    model = Net()
    t = trainer(strategy=FastMLFSDPStrategy(plan="int8", auto_wrap_policy={nn.Linear}, all_gather_bits=8,
                                            log_every_n_steps=0),
                max_steps=4, accumulate_grad_batches=2)
    t.fit(model, loader(320))
    res["accum"] = summary(t, model)

    L.seed_everything(0)
    model = SelfSharded()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = trainer(strategy=FastMLFSDPStrategy(plan="int4", auto_wrap_policy=1), max_steps=3)
        t.fit(model, loader(320))
    res["self_sharded"] = summary(t, model)
    res["self_sharded"]["warned"] = any("auto_wrap_policy is not applied" in str(w.message) for w in caught)
    return res


def part_resume(out: str) -> dict:
    # 320 samples / 2 ranks / 16 per batch = 10 steps per epoch: step 10 ends epoch 0.
    ckpt10 = os.path.join(out, "step10.ckpt")
    L.seed_everything(0)
    first = Net()
    t = trainer(max_epochs=1)
    t.fit(first, loader(320))
    t.save_checkpoint(ckpt10)  # a folder: Lightning's shards + fastml_strategy/ (every rank's FastML state)
    res = {"ckpt_files": sorted(os.listdir(ckpt10)),
           "fastml_files": sorted(os.listdir(os.path.join(ckpt10, CHECKPOINT_KEY))),
           "first_digest": full_digest(first)}

    L.seed_everything(1)  # a different init: everything must come from the checkpoint
    resumed = Net()
    L.seed_everything(0)  # Lightning seeds the DistributedSampler's shuffle with the global seed
    t = trainer(max_epochs=2)
    t.fit(resumed, loader(320), ckpt_path=ckpt10)
    res.update(resumed=full_digest(resumed), resumed_step=t.strategy.fastml_state.step,
               resumed_residual_bytes=t.strategy.compression_stats()["residual_bytes"])

    L.seed_everything(0)
    straight = Net()
    t = trainer(max_epochs=2)
    t.fit(straight, loader(320))
    res.update(straight=full_digest(straight), straight_step=t.strategy.fastml_state.step)

    # A single-file checkpoint (save_distributed_checkpoint=False): every rank's FastML state gathered into it.
    full = os.path.join(out, "full.ckpt")
    L.seed_everything(0)
    first = Net()
    t = trainer(strategy=FastMLFSDPStrategy(save_distributed_checkpoint=False), max_epochs=1)
    t.fit(first, loader(320))
    t.save_checkpoint(full)
    saved = torch.load(full, map_location="cpu", weights_only=True)
    res["full_ckpt"] = {"is_file": os.path.isfile(full),
                        "ranks": [p["rank"] for p in saved[CHECKPOINT_KEY]["per_rank"]],
                        "steps": [p["step"] for p in saved[CHECKPOINT_KEY]["per_rank"]]}
    L.seed_everything(1)
    resumed = Net()
    L.seed_everything(0)
    t = trainer(strategy=FastMLFSDPStrategy(save_distributed_checkpoint=False), max_epochs=2)
    t.fit(resumed, loader(320), ckpt_path=full)
    res["full_ckpt"]["resumed"] = full_digest(resumed)

    # Negative control: the same checkpoint without the FastML subfolder must NOT reproduce the run.
    stripped = os.path.join(out, "no_fastml.ckpt")
    if dist.get_rank() == 0:
        shutil.copytree(ckpt10, stripped)
        shutil.rmtree(os.path.join(stripped, CHECKPOINT_KEY))
    dist.barrier()
    L.seed_everything(1)
    control = Net()
    L.seed_everything(0)
    t = trainer(max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.fit(control, loader(320), ckpt_path=stripped)
    res["control"] = full_digest(control)
    res["control_warned"] = any("holds no FastML state" in str(w.message) for w in caught)
    return res


def part_errors(out: str) -> dict:
    res = {}
    cases = (("fsdp1", "fastml_fsdp", FSDP1Inside()), ("ddp_sharded", "fastml", FullyShardInside()))
    for key, strategy, model in cases:
        try:
            trainer(strategy=strategy, max_steps=2).fit(model, loader(64))
            res[key] = None
        except TypeError as e:
            res[key] = str(e)
    return res


def main() -> None:
    out, parts = sys.argv[1], sys.argv[2].split(",")
    for part in parts:
        res = {"basic": part_basic, "resume": part_resume, "errors": part_errors}[part](out)
        write_json(os.path.join(out, f"{part}.rank{dist.get_rank()}.json"), res)


if __name__ == "__main__":
    main()
