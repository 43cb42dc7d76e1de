"""LocalSGD in Lightning, Fabric and Accelerate, on 2 CPU ranks started by torchrun (run as a script).

``torchrun --nproc_per_node 2 localsgd_job.py OUT PART[,PART...]``; every rank writes
``OUT/<part>.rank<r>.json``. The frameworks share the two processes (and torchrun's process group):
their imports, not the training, dominate the cost on a 2-core machine.

Parts:

- ``trainer``: ``FastMLLocalSGDStrategy(every=4)`` on digits (each rank its own shard), CSV logger; a
  parameter digest after every optimizer step; then ``strategy="fastml_localsgd"`` by name, with
  ``FASTML_LOCALSGD_EVERY=2`` and ``accumulate_grad_batches=2``; manual optimization stepping every other
  batch; then a strategy whose LocalSGD cannot be
  built (more fragments than parameters): every rank must raise the same error.
- ``resume``: Adam, ``every=4, fragments=2, delay=1``: 20 steps straight against 10 steps (a fragment's
  update still pending, the ranks' models apart), ``trainer.save_checkpoint``, and a resume to 20.
- ``fabric``: ``Fabric(strategy=FastMLLocalSGDFabricStrategy(every=3))``: 6 steps, ``fabric.save``, 4 more;
  against a second model set up from scratch, ``fabric.load`` and the same 4 steps.
- ``accelerate``: ``prepare_local_sgd(every=4, fragments=2, delay=1)``: 6 steps (a fragment's update
  pending), ``save_state``, 4 more; against a fresh model, ``load_state`` and the same 4 steps.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _task import digits, mlp, param_digest, write_json  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*LitLogger.*")


def _threads() -> int:
    return sum(t.name.startswith("fastml-localsgd") for t in threading.enumerate())


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)  # test-only peek: LocalSGD's own groups must not pile up


def _batch(rank: int, step: int, size: int = 16):
    """A different batch on every rank and step (so local models drift apart between synchronisations)."""
    x, y = digits().tensors
    i = torch.arange(size) + (step * 2 + rank) * size
    return x[i % len(x)], y[i % len(y)]


# -- Lightning Trainer ---------------------------------------------------------------------------------------
def _lightning():
    import lightning.pytorch as L

    class Net(L.LightningModule):
        def __init__(self, adam: bool = False) -> None:
            super().__init__()
            self.net = mlp()
            self.adam = adam
            self.trace: list[str] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_acc", (self.net(x).argmax(-1) == y).float().mean(), sync_dist=True)

        def on_train_batch_end(self, outputs, batch, batch_idx):
            self.trace.append(param_digest(self))

        def configure_optimizers(self):
            if self.adam:
                return torch.optim.Adam(self.parameters(), lr=1e-3)
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return L, Net


def _loader(n: int = 320):
    return torch.utils.data.DataLoader(digits(n), batch_size=16, shuffle=True)


def _trainer(L, strategy, **kw):
    base = dict(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_progress_bar=False,
                enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0)
    base.update(kw)
    return L.Trainer(**base)


def part_trainer(out: str) -> dict:
    from lightning.pytorch.loggers import CSVLogger

    from fastml_strategy.lightning import FastMLLocalSGDStrategy

    L, Net = _lightning()
    L.seed_everything(0)
    model = Net()
    strategy = FastMLLocalSGDStrategy(plan="int4", every=4, outer="sgd", outer_lr=1.0, outer_momentum=0.0)
    t = _trainer(L, strategy, max_steps=10, logger=CSVLogger(out, name="csv", version=0), log_every_n_steps=2)
    t.fit(model, _loader())
    res = {"strategy": type(t.strategy).__name__, "wrapped": type(t.strategy.model).__name__,
           "trace": model.trace, "stats": {k: v for k, v in t.strategy.compression_stats().items() if k != "layers"},
           "global_step": t.global_step, "settings": t.strategy.settings}
    # evaluation after fit works on the unwrapped model (Lightning's own metric sync)
    res["validate"] = t.validate(model, _loader(64), verbose=False)
    groups0 = _groups()  # torchrun's default group (Lightning made it in the first fit), LocalSGD's gone

    # By name, H from the environment, with gradient accumulation: 8 batches -> 4 inner steps -> 2 syncs.
    os.environ["FASTML_LOCALSGD_EVERY"] = "2"
    L.seed_everything(0)
    model2 = Net()
    t2 = _trainer(L, "fastml_localsgd", max_steps=4, accumulate_grad_batches=2)
    t2.fit(model2, _loader())
    del os.environ["FASTML_LOCALSGD_EVERY"]
    s2 = t2.strategy.compression_stats()
    res["accum"] = {"strategy": type(t2.strategy).__name__, "every": t2.strategy.settings["every"],
                    "inner_steps": s2["inner_steps"], "outer_steps": s2["outer_steps"],
                    "batches": len(model2.trace), "digest": param_digest(model2)}
    # Manual optimization, stepping every other batch: one inner step per opt.step(), not per batch.
    class Manual(Net):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.manual_backward(torch.nn.functional.cross_entropy(self.net(x), y))
            if batch_idx % 2 == 1:
                opt = self.optimizers()
                opt.step()
                opt.zero_grad()

    L.seed_everything(0)
    model4 = Manual()
    t4 = _trainer(L, FastMLLocalSGDStrategy(plan="int4", every=3), max_steps=3)
    t4.fit(model4, _loader())
    s4 = t4.strategy.compression_stats()
    res["manual"] = {"batches": len(model4.trace), "inner_steps": s4["inner_steps"],
                     "outer_steps": s4["outer_steps"], "digest": param_digest(model4)}
    res["threads_after_fits"] = _threads()
    res["groups_added"] = _groups() - groups0

    # A setting that only the model can refute (4 fragments of a 6-parameter MLP is fine, 99 is not):
    # every rank raises the same error from fit(), before the first step, and nobody hangs.
    L.seed_everything(0)
    model3 = Net()
    t3 = _trainer(L, FastMLLocalSGDStrategy(plan="int4", every=200, fragments=99), max_steps=2)
    try:
        t3.fit(model3, _loader())
        res["bad"] = None
    except ValueError as e:
        res["bad"] = str(e)
    res["bad_steps"] = len(model3.trace)
    return res


def part_resume(out: str) -> dict:
    from fastml_strategy.lightning import CHECKPOINT_KEY, FastMLLocalSGDStrategy

    L, Net = _lightning()
    ckpt = os.path.join(out, "step10.ckpt")

    def strategy():
        return FastMLLocalSGDStrategy(plan="int4", every=4, fragments=2, delay=1)

    # 320 samples / 2 ranks / 16 per batch = 10 steps per epoch: the checkpoint is at an epoch end.
    L.seed_everything(0)
    first = Net(adam=True)
    t = _trainer(L, strategy(), max_epochs=1)
    t.fit(first, _loader())
    t.save_checkpoint(ckpt)  # every rank calls it; rank 0 writes every rank's part
    res = {"at_save": param_digest(first), "pending_at_save": t.strategy.localsgd.state_dict()["pending"] != {}}

    L.seed_everything(1)  # another init: everything must come from the checkpoint
    resumed = Net(adam=True)
    L.seed_everything(0)
    t = _trainer(L, strategy(), max_epochs=2)
    t.fit(resumed, _loader(), ckpt_path=ckpt)
    res.update(resumed=param_digest(resumed), resumed_inner=t.strategy.localsgd.inner_steps, trace_r=resumed.trace)

    L.seed_everything(0)
    straight = Net(adam=True)
    t = _trainer(L, strategy(), max_epochs=2)
    t.fit(straight, _loader())
    res.update(straight=param_digest(straight), straight_inner=t.strategy.localsgd.inner_steps,
               trace_s=straight.trace)
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    parts = saved[CHECKPOINT_KEY]["per_rank"]
    res["ckpt"] = {"ranks": [p["rank"] for p in parts], "inner": [p["localsgd"]["inner_steps"] for p in parts],
                   "models_differ": any(not torch.equal(parts[0]["state_dict"][k], parts[1]["state_dict"][k])
                                        for k in parts[0]["state_dict"]),
                   "adam_state": "state" in parts[1]["optimizer_states"][0]}
    return res


# -- Fabric -------------------------------------------------------------------------------------------------
def part_fabric(out: str) -> dict:
    import lightning.fabric as LF

    from fastml_strategy.lightning import FastMLLocalSGDFabricStrategy

    fabric = LF.Fabric(accelerator="cpu", devices=2,
                       strategy=FastMLLocalSGDFabricStrategy(plan="int8", every=3, outer="sgd", outer_lr=1.0,
                                                             outer_momentum=0.0))
    fabric.launch()
    rank = fabric.global_rank

    def setup(seed: int):
        torch.manual_seed(seed)
        model = mlp()
        return fabric.setup(model, torch.optim.Adam(model.parameters(), lr=1e-3))

    def train(model, opt, steps):
        digests = []
        for s in steps:
            x, y = _batch(rank, s)
            with fabric.no_backward_sync(model):  # nothing to block: must not raise
                fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()  # LocalSGD counts the inner step and synchronises when due
            opt.zero_grad()
            digests.append(param_digest(model))
        return digests

    model, opt = setup(rank)  # different inits: LocalSGD starts every rank from rank 0's weights
    local = fabric.strategy.localsgd
    res = {"start": param_digest(model), "wrapped": type(model.module).__name__}
    res["trace"] = train(model, opt, range(8))
    path = os.path.join(out, "fabric.ckpt")
    fabric.save(path, {"model": model, "optimizer": opt, "step": 8})
    res["continued"] = train(model, opt, range(8, 12))
    res["stats"] = {k: v for k, v in local.stats().items() if k != "layers"}
    res["metrics"] = fabric.strategy.compression_metrics()

    model2, opt2 = setup(100 + rank)  # closes the first LocalSGD, builds a new one
    state = {"model": model2, "optimizer": opt2, "step": 0}
    left = fabric.load(path, state)
    res["loaded_step"], res["left"] = state["step"], sorted(left)
    res["resumed"] = train(model2, opt2, range(8, 12))
    res["resumed_inner"] = fabric.strategy.localsgd.inner_steps
    fabric.strategy.teardown()
    res["threads_after_teardown"] = _threads()
    return res


# -- Accelerate ---------------------------------------------------------------------------------------------
def part_accelerate(out: str) -> dict:
    from accelerate import Accelerator

    import fastml_strategy.accelerate as fa

    acc = Accelerator(cpu=True)
    rank = acc.process_index

    def prepare(seed: int):
        torch.manual_seed(seed)
        model = mlp()
        return fa.prepare_local_sgd(acc, model, torch.optim.Adam(model.parameters(), lr=1e-3), plan="int4",
                                    every=4, fragments=2, delay=1)

    def train(model, opt, local, steps):
        digests = []
        for s in steps:
            x, y = _batch(rank, s)
            acc.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            local.step()
            digests.append(param_digest(model))
        return digests

    model, opt = prepare(rank)
    local = acc.fastml_localsgd
    res = {"distributed_type": str(acc.distributed_type), "wrapped": type(model).__name__,
           "trace": train(model, opt, local, range(6))}
    acc.save_state(os.path.join(out, "acc_state"))
    res["continued"] = train(model, opt, local, range(6, 10))
    res["stats"] = {k: v for k, v in local.stats().items() if k != "layers"}
    local.close()

    acc2 = acc  # the same Accelerator: a second model replaces the first in what save/load_state track
    acc2._models.clear(), acc2._optimizers.clear(), acc2._custom_objects.clear()
    model2, opt2 = prepare(100 + rank)
    acc2.load_state(os.path.join(out, "acc_state"))
    res["resumed"] = train(model2, opt2, acc2.fastml_localsgd, range(6, 10))
    acc2.fastml_localsgd.close()
    try:
        fa.local_sgd(acc, torch.nn.parallel.DistributedDataParallel(mlp()))
        res["ddp_error"] = None
    except TypeError as e:
        res["ddp_error"] = str(e)
    return res


def main() -> None:
    out, parts = sys.argv[1], sys.argv[2].split(",")
    import fastml_strategy.lightning  # noqa: F401  registers strategy="fastml_localsgd"

    for part in parts:
        res = {"trainer": part_trainer, "resume": part_resume, "fabric": part_fabric,
               "accelerate": part_accelerate}[part](out)
        write_json(os.path.join(out, f"{part}.rank{dist.get_rank()}.json"), res)


if __name__ == "__main__":
    main()
