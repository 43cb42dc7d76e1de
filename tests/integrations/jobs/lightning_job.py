"""Lightning Trainer runs on 2 CPU processes started by Lightning's own launcher (run as a script).

``python lightning_job.py OUT PART[,PART...]``; every rank writes ``OUT/<part>.rank<r>.json``.

Parts (each a sequence of Trainers in the same two processes):

- ``basic``: ``Trainer(strategy="fastml")`` (plan from FASTML_PLAN), CSV logger, then validate / test /
  predict; then a second fit with ``FastMLStrategy(plan=...)``, ``precision="bf16-mixed"`` and
  ``accumulate_grad_batches=2``.
- ``resume``: 20 steps straight (checkpoint at step 10, an epoch boundary), resume from step 10 to 20,
  and resume from the same checkpoint stripped of its FastML state (must differ).
- ``overflow``: fp16 autocast with a GradScaler (on CPU; on CUDA with FASTML_TEST_ACCELERATOR=gpu); the
  last rank alone makes its gradients infinite at one step: every rank must skip that step and halve
  its scale.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from fastml_strategy.lightning import CHECKPOINT_KEY, FastMLStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _task import digits, mlp, param_digest, write_json  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LitLogger.*")


class Net(L.LightningModule):
    def __init__(self, lr: float = 0.05, inject_inf_at: int = -1) -> None:
        super().__init__()
        self.net = mlp()
        self.lr = lr
        self.inject_inf_at = inject_inf_at  # global step at which rank `inject_rank` makes its loss infinite
        self.inject_rank = 1
        self.trace: list[dict] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        # the DDP wrapper the strategy trains with (Lightning unwraps it after fit)
        self.bucket_view = bool(getattr(self.trainer.strategy.model, "gradient_as_bucket_view", False))
        loss = torch.nn.functional.cross_entropy(self(x).float(), y)
        if self.global_step == self.inject_inf_at and self.global_rank == self.inject_rank:
            loss = loss * float("inf")
        self.log("train_loss", loss, on_step=True)
        return loss

    def _eval(self, batch, stage):
        x, y = batch
        logits = self(x).float()
        self.log(f"{stage}_loss", torch.nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.log(f"{stage}_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def validation_step(self, batch, batch_idx):
        self._eval(batch, "val")

    def test_step(self, batch, batch_idx):
        self._eval(batch, "test")

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def on_train_batch_start(self, batch, batch_idx):
        self._before = param_digest(self)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        self.trace.append({"global_step": self.global_step, "epoch": self.current_epoch, "batch_idx": batch_idx,
                           "y": batch[1][:4].tolist(), "before": self._before, "after": param_digest(self),
                           "scale": float(scaler.get_scale()) if scaler is not None else None,
                           "device": str(self.device)})

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def loader(n: int, batch_size: int = 16, shuffle: bool = True):
    return torch.utils.data.DataLoader(digits(n), batch_size=batch_size, shuffle=shuffle)


def trainer(strategy="fastml", **kw) -> L.Trainer:
    base = dict(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    base.update(kw)
    return L.Trainer(**base)


def part_basic(out: str) -> dict:
    L.seed_everything(0)
    model = Net()
    t = trainer(max_steps=6, logger=CSVLogger(out, name="csv", version=0), log_every_n_steps=2)
    t.fit(model, loader(320))
    res = {"strategy": type(t.strategy).__name__, "plan": t.strategy.plan.name,
           "digest": param_digest(model), "stats": t.strategy.compression_stats(),
           "fastml_step": t.strategy.fastml_state.step, "global_step": t.global_step,
           "bucket_view": model.bucket_view}
    # fit, then evaluate: no DDP wrapper, no hook, Lightning's own samplers and metric sync.
    res["validate"] = t.validate(model, loader(128, shuffle=False), verbose=False)
    res["test"] = t.test(model, loader(128, shuffle=False), verbose=False)
    preds = t.predict(model, loader(64, shuffle=False))
    res["predict_rows"] = int(sum(p.numel() for p in preds))
    res["stats_after_eval"] = t.strategy.compression_stats()["steps"]

    # An explicit strategy object, bf16 autocast and gradient accumulation, in the same processes.
    model2 = Net()
    t2 = trainer(strategy=FastMLStrategy(plan="int8", log_every_n_steps=0), max_steps=4,
                 precision="bf16-mixed", accumulate_grad_batches=2)
    t2.fit(model2, loader(320))
    res["accum"] = {"digest": param_digest(model2), "fastml_step": t2.strategy.fastml_state.step,
                    "global_step": t2.global_step, "plan": t2.strategy.plan.name,
                    "stats": t2.strategy.compression_stats(),
                    "changed": sum(1 for s in model2.trace if s["before"] != s["after"]),
                    "batches": len(model2.trace)}
    return res


def part_resume(out: str) -> dict:
    # 320 samples / 2 ranks / 16 per batch = 10 steps per epoch: step 10 ends epoch 0.
    ckpt10 = os.path.join(out, "step10.ckpt")
    L.seed_everything(0)
    first = Net()
    t = trainer(max_epochs=1)
    t.fit(first, loader(320))
    t.save_checkpoint(ckpt10)  # every rank calls it; rank 0 writes every rank's FastML state

    L.seed_everything(1)  # a different init: everything must come from the checkpoint
    resumed = Net()
    L.seed_everything(0)  # Lightning seeds the DistributedSampler's shuffle with the global seed
    t = trainer(max_epochs=2)
    t.fit(resumed, loader(320), ckpt_path=ckpt10)
    res = {"resumed": param_digest(resumed), "resumed_step": t.strategy.fastml_state.step,
           "trace_r": resumed.trace}

    L.seed_everything(0)
    straight = Net()
    t = trainer(max_epochs=2)
    t.fit(straight, loader(320))
    res.update(straight=param_digest(straight), straight_step=t.strategy.fastml_state.step,
               trace_s=straight.trace)

    saved = torch.load(ckpt10, map_location="cpu", weights_only=True)
    fml = saved[CHECKPOINT_KEY]
    res["ckpt"] = {"ranks": [p["rank"] for p in fml["per_rank"]], "step": [p["step"] for p in fml["per_rank"]],
                   "residual_norms": [float(sum(v.float().norm() ** 2 for v in p["residuals"].values()) ** 0.5)
                                      for p in fml["per_rank"]]}
    # Negative control: the same checkpoint without the FastML state must NOT reproduce the run.
    stripped = os.path.join(out, "no_fastml.ckpt")
    if dist.get_rank() == 0:
        del saved[CHECKPOINT_KEY]
        torch.save(saved, stripped)
    dist.barrier()
    L.seed_everything(1)
    control = Net()
    L.seed_everything(0)
    t = trainer(max_epochs=2)
    with warnings.catch_warnings(record=True) as caught:  # rank 0 warns that residuals restart at zero
        warnings.simplefilter("always")
        t.fit(control, loader(320), ckpt_path=stripped)
    res["control"] = param_digest(control)
    res["control_warned"] = any("holds no FastML state" in str(w.message) for w in caught)
    return res


def part_overflow(out: str) -> dict:
    from lightning.pytorch.plugins import MixedPrecision

    # Lightning turns precision="16-mixed" on CPU into bf16; a plugin with a GradScaler keeps fp16.
    # FASTML_TEST_ACCELERATOR=gpu (with FASTML_TEST_DEVICES) runs the same on CUDA with NCCL.
    device = "cuda" if os.environ.get("FASTML_TEST_ACCELERATOR") == "gpu" else "cpu"
    devices = int(os.environ.get("FASTML_TEST_DEVICES", "2"))
    L.seed_everything(0)
    model = Net(inject_inf_at=3)
    model.inject_rank = devices - 1  # the last rank alone overflows
    plugin = MixedPrecision("16-mixed", device, scaler=torch.amp.GradScaler(device, init_scale=1024.0))
    t = trainer(max_steps=6, plugins=[plugin], accelerator="gpu" if device == "cuda" else "cpu", devices=devices)
    t.fit(model, loader(320))
    return {"trace": model.trace, "digest": param_digest(model), "world_size": t.world_size,
            "nonfinite_steps": t.strategy.compression_stats().get("nonfinite_steps"),
            "compression_ratio": t.strategy.compression_stats()["compression_ratio"],
            "scale": float(plugin.scaler.get_scale()),
            "device": model.trace[0]["device"]}  # during training (Lightning moves the model to CPU after fit)


def main() -> None:
    out, parts = sys.argv[1], sys.argv[2].split(",")
    for part in parts:
        res = {"basic": part_basic, "resume": part_resume, "overflow": part_overflow}[part](out)
        write_json(os.path.join(out, f"{part}.rank{dist.get_rank()}.json"), res)


if __name__ == "__main__":
    main()
