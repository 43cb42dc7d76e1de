"""Fabric(strategy=FastMLFSDPFabricStrategy(...)) on CPU processes started by Fabric's own launcher.

``python fsdp_fabric_job.py OUT DEVICES REPLICATE_SIZE``; every rank writes ``OUT/fabric.rank<r>.json``.

In the same processes: the model and optimizer set up together (must fail, naming the order); 2N steps
straight with ``fabric.save`` at step N (a distributed checkpoint with every rank's FastML state); a
fresh model and optimizer that ``fabric.load`` step N and train N more (must equal the straight run);
the same from a copy of the checkpoint without its FastML subfolder (must differ).
"""

from __future__ import annotations

import os
import shutil
import sys
import warnings

import torch
from torch import nn

import lightning.fabric as LF

from fastml_strategy.lightning import CHECKPOINT_KEY, FastMLFSDPFabricStrategy

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _task import digits, full_digest, mlp, units, write_json  # noqa: E402

torch.set_num_threads(1)
warnings.filterwarnings("ignore", ".*weights_only.*")
STEPS = 6  # N: checkpoint after N steps, 2N in all


def batches(fabric: LF.Fabric, start: int, stop: int):
    """The batches of steps [start, stop) of this rank: the order depends on the step only."""
    data = digits(512)
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=fabric.world_size, rank=fabric.global_rank,
                                                  shuffle=True, seed=0, drop_last=True)
    loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler, drop_last=True)
    step, epoch = 0, 0
    while step < stop:
        sampler.set_epoch(epoch)
        for batch in loader:
            if step >= start:
                yield batch
            step += 1
            if step >= stop:
                return
        epoch += 1


def build(fabric: LF.Fabric, seed: int):
    torch.manual_seed(seed)
    model = fabric.setup(mlp())  # shards (nn.Linear units, then the root) and registers FastML
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return model, optimizer


def train(fabric, model, optimizer, start: int, stop: int) -> None:
    for x, y in batches(fabric, start, stop):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        fabric.backward(loss)
        optimizer.step()


def main() -> None:
    out, devices, replicas = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    strategy = FastMLFSDPFabricStrategy(plan="int4", auto_wrap_policy={nn.Linear},
                                        replicate_size=replicas if replicas > 1 else None)
    fabric = LF.Fabric(accelerator="cpu", devices=devices, strategy=strategy)
    fabric.launch()
    res = {"world_size": fabric.world_size, "mesh": list(strategy.device_mesh.mesh_dim_names)}

    try:  # the optimizer must be created from the sharded parameters
        fabric.setup(mlp(), torch.optim.SGD(mlp().parameters(), lr=0.1))
        res["joint_setup_error"] = None
    except RuntimeError as e:
        res["joint_setup_error"] = str(e)

    ckpt = os.path.join(out, "fabric.ckpt")
    model, optimizer = build(fabric, seed=0)
    train(fabric, model, optimizer, 0, STEPS)
    fabric.save(ckpt, {"model": model, "optimizer": optimizer, "step": STEPS})
    res["saved_files"] = sorted(os.listdir(ckpt))
    res["saved_fastml_files"] = sorted(os.listdir(os.path.join(ckpt, CHECKPOINT_KEY)))
    train(fabric, model, optimizer, STEPS, 2 * STEPS)
    res.update(straight=full_digest(model), stats=fabric.strategy.compression_stats(), units=units(model),
               metrics=fabric.strategy.compression_metrics(layers=True))

    model, optimizer = build(fabric, seed=1)  # a different init: everything must come from the checkpoint
    state = {"model": model, "optimizer": optimizer, "step": 0}
    left = fabric.load(ckpt, state)
    res["loaded_step"], res["leftover"] = state["step"], sorted(left)
    train(fabric, model, optimizer, state["step"], 2 * STEPS)
    res.update(resumed=full_digest(model), resumed_step=fabric.strategy.fastml_state.step)

    stripped = os.path.join(out, "no_fastml.ckpt")  # negative control
    if fabric.global_rank == 0:
        shutil.copytree(ckpt, stripped)
        shutil.rmtree(os.path.join(stripped, CHECKPOINT_KEY))
    fabric.barrier()
    model, optimizer = build(fabric, seed=1)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric.load(stripped, state)
    train(fabric, model, optimizer, state["step"], 2 * STEPS)
    res.update(control=full_digest(model),
               control_warned=any("holds no FastML state" in str(w.message) for w in caught))
    write_json(os.path.join(out, f"fabric.rank{fabric.global_rank}.json"), res)


if __name__ == "__main__":
    main()
