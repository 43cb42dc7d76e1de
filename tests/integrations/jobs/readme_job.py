"""Run every ```python block of README.md, as written and in order, on this rank (under torchrun).

The blocks read like one session (later ones use earlier imports), so they share one namespace. The
reader's own objects are stood in for by small ones, set before each block (a block that defines one
replaces it): ``MyModel`` (two blocks of >= 4096 weights, so plans compress them, and a head),
``model`` (a fresh ``MyModel()``), ``inner_optimizer`` (SGD over it), ``lit_model`` (a LightningModule
around another), ``loader`` (a DataLoader of 3 batches) and ``loss_fn``. ``lightning.Trainer`` is
the real Trainer with 2 steps and no files or progress bars by default, so that ``trainer.fit``
finishes here in seconds.

After each block one check looks at what the block claims to do (a hook that compressed, a strategy
that is FastML's, a step that trains); a block no check recognises fails the job, so a new block in the
README needs a check here. Writes ``OUT/readme.rank<R>.json``: per block, its first line and figures.

    torchrun --nproc_per_node 2 tests/integrations/jobs/readme_job.py README.md OUT
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)  # every rank the same initial weights
        self.blocks = nn.ModuleList([nn.Linear(32, 128), nn.Linear(128, 128)])
        self.head = nn.Linear(128, 4)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def make_loader(rank: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1 + rank)
    x, y = torch.randn(48, 32, generator=g), torch.randint(0, 4, (48,), generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def one_step(model, opt, loader, backward=None) -> None:
    x, y = next(iter(loader))
    loss = nn.functional.cross_entropy(model(x), y)
    (backward or (lambda t: t.backward()))(loss)
    opt.step()
    opt.zero_grad()


def main() -> None:
    readme, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ["RANK"])

    import lightning

    class LitModel(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = MyModel()

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, i):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)  # through forward: FSDP's root unit gathers

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class ShortTrainer(lightning.Trainer):
        def __init__(self, *args, **kwargs) -> None:
            for k, v in (("max_steps", 2), ("logger", False), ("enable_checkpointing", False),
                         ("enable_progress_bar", False), ("enable_model_summary", False)):
                kwargs.setdefault(k, v)
            super().__init__(*args, **kwargs)

    lightning.Trainer = ShortTrainer

    import fastml_strategy as fm
    from fastml_strategy.fsdp import FSDPState

    def check_ddp(ns):
        s = ns["state"].stats()
        assert s["steps"] == len(ns["loader"]) and s["compression_ratio"] > 4, s  # int4 on the blocks
        return {"steps": s["steps"], "ratio": s["compression_ratio"]}

    def check_plan(ns):
        assert fm.Plan.load("plan.json") == ns["plan"]
        return {"layers": len(ns["plan"].layers)}

    def check_trainer(kind):
        def check(ns):
            t = ns["trainer"]
            assert type(t.strategy).__name__ == kind, type(t.strategy)
            s = t.strategy.compression_stats()
            assert s["steps"] == 2 and s["compression_ratio"] > 1, s
            if kind == "FastMLFSDPStrategy":
                assert type(ns["fabric"].strategy).__name__ == "FastMLFSDPFabricStrategy"
            return {"steps": s["steps"], "ratio": s["compression_ratio"]}
        return check

    def check_fabric(ns):
        fabric = ns["fabric"]
        assert type(fabric.strategy).__name__ == "FastMLFabricStrategy", type(fabric.strategy)
        one_step(ns["model"], ns["opt"], ns["loader"], fabric.backward)
        s = fabric.strategy.compression_stats()
        assert s["steps"] == 1 and s["compression_ratio"] > 4, s
        return {"steps": s["steps"], "ratio": s["compression_ratio"]}

    def check_accelerate(ns):
        state = ns["state"]
        assert isinstance(state, fm.FastMLState), type(state)  # the state; `model` stays the model
        one_step(ns["model"], ns["opt"], ns["loader"], ns["accelerator"].backward)
        s = state.stats()
        assert s["steps"] == 1 and s["compression_ratio"] > 4, s
        return {"steps": s["steps"], "ratio": s["compression_ratio"]}

    def check_fsdp(ns):
        state = ns["state"]
        assert isinstance(state, FSDPState), type(state)
        opt = torch.optim.SGD(ns["model"].parameters(), lr=0.01)
        one_step(ns["model"], opt, ns["loader"])
        s = state.stats()
        assert s["steps"] == 1 and s["compression_ratio"] > 1, s
        return {"steps": s["steps"], "ratio": s["compression_ratio"]}

    def check_local_sgd(ns):
        local, model, opt = ns["local"], ns["model"], ns["inner_optimizer"]
        assert isinstance(local, fm.LocalSGD), type(local)
        batches = list(ns["loader"])
        while local.stats()["inner_steps"] < local.every:  # to the first synchronisation
            x, y = batches[local.stats()["inner_steps"] % len(batches)]
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            local.step()
        s = local.stats()
        assert s["outer_steps"] == 1 and s["compression_ratio"] > 4, s
        digest = torch.cat([p.detach().flatten() for p in model.parameters()]).double().sum().reshape(1)
        both = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
        dist.all_gather(both, digest)
        assert both[0].item() == both[1].item(), both  # the replicas agree after the sync
        return {"steps": s["inner_steps"], "ratio": s["compression_ratio"]}

    def check_local_sgd_integrations(ns):
        t = ns["trainer"]
        assert type(t.strategy).__name__ == "FastMLLocalSGDStrategy", type(t.strategy)
        assert t.strategy.localsgd.inner_steps == 2 and type(t.strategy.model).__name__ == "LitModel"
        local = ns["local"]
        assert isinstance(local, fm.LocalSGD), type(local)
        one_step(ns["model"], ns["opt"], ns["loader"], ns["accelerator"].backward)
        local.step()
        assert local.inner_steps == 1 and local.every == 50
        local.close()
        return {"steps": t.strategy.localsgd.inner_steps}

    checks = [  # (text that identifies the block, its check)
        ("fm.register_hook(model", check_ddp),
        ("fm.Plan.from_recipe(", check_plan),
        ('Trainer(strategy="fastml",', check_trainer("FastMLStrategy")),
        ('Fabric(strategy="fastml",', check_fabric),
        ("fastml_strategy.accelerate.setup(", check_accelerate),
        ('Trainer(strategy="fastml_fsdp"', check_trainer("FastMLFSDPStrategy")),
        ("ff.register(model", check_fsdp),
        ("fastml_strategy.LocalSGD(", check_local_sgd),
        ('Trainer(strategy="fastml_localsgd"', check_local_sgd_integrations),
    ]

    ns: dict = {}
    report = []
    for i, code in enumerate(python_blocks(readme.read_text())):
        model = MyModel()
        ns.update(MyModel=MyModel, model=model, lit_model=LitModel(), loader=make_loader(rank),
                  loss_fn=nn.functional.cross_entropy,
                  inner_optimizer=torch.optim.SGD(model.parameters(), lr=0.01))
        matched = [c for key, c in checks if key in code]
        assert len(matched) == 1, f"README python block {i + 1} has {len(matched)} checks:\n{code}"
        try:
            exec(compile(code, f"README.md python block {i + 1}", "exec"), ns)
            figures = matched[0](ns)
        except BaseException as e:
            raise AssertionError(f"README python block {i + 1} failed: {type(e).__name__}: {e}\n{code}") from e
        report.append({"block": i + 1, "first_line": code.splitlines()[0], **figures})
    with open(out / f"readme.rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "blocks": report}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
