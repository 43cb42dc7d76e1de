"""TARGET loading: files, modules, LightningModules, and the one-line errors for bad targets."""

import sys
from pathlib import Path

import pytest
import torch

from fastml_strategy.autotune.workload import Workload, load_target

HERE = Path(__file__).parent


def test_file_target_builds_a_workload():
    wl = load_target(f"{HERE / 'tiny_workload.py'}:workload")
    assert isinstance(wl, Workload) and wl.name == "tiny"
    batch = next(wl.batch_stream())
    assert wl.loss_fn(wl.model, batch).ndim == 0
    assert 0.0 <= wl.eval_fn(wl.model) <= 1.0


def test_module_target(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    wl = load_target("tiny_workload:workload")
    assert isinstance(wl.model, torch.nn.Module)


def test_batch_stream_restarts_an_exhausted_iterable():
    wl = load_target(f"{HERE / 'tiny_workload.py'}:workload")
    n = len(wl.batches)
    stream = wl.batch_stream()
    seen = [next(stream) for _ in range(n + 2)]
    assert seen[n][0] is wl.batches[0][0]


@pytest.mark.parametrize("spec,needle", [
    ("no_colon_here", "':factory'"),
    ("/nonexistent/dir/x.py:workload", "does not exist"),
    ("definitely_not_a_module_xyz:workload", "not found"),
    ("{tiny}:missing_factory", "has no 'missing_factory'"),
    ("{tiny}:not_a_workload", "returned a int"),
])
def test_bad_targets_are_one_line_errors(spec, needle):
    spec = spec.format(tiny=HERE / "tiny_workload.py")
    with pytest.raises(ValueError) as e:
        load_target(spec)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_factory_that_raises(tmp_path):
    f = tmp_path / "boom.py"
    f.write_text("def make():\n    raise RuntimeError('no data here\\nsecond line')\n")
    with pytest.raises(ValueError, match=r"make\(\) raised RuntimeError: no data here$"):
        load_target(f"{f}:make")


def test_loss_that_fails_is_caught_before_profiling(tmp_path):
    f = tmp_path / "bad_loss.py"
    f.write_text(
        "import torch\nfrom fastml_strategy.autotune import Workload\n"
        "def make():\n"
        "    return Workload(model=torch.nn.Linear(4, 2), batches=[torch.zeros(3, 5)],\n"
        "                    loss_fn=lambda m, b: m(b).sum())\n")
    with pytest.raises(ValueError, match="one training step failed"):
        load_target(f"{f}:make")


def test_lightning_module_with_datamodule(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    f = tmp_path / "lit.py"
    f.write_text('''
import torch
import lightning.pytorch as pl
from torch.utils.data import DataLoader, TensorDataset

class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 96), torch.nn.ReLU(), torch.nn.Linear(96, 2))
    def training_step(self, batch, i):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return {"loss": loss}
    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_acc", (self.net(x).argmax(1) == y).float().mean())
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

class Data(pl.LightningDataModule):
    def setup(self, stage):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(256, 8, generator=g)
        self.ds = TensorDataset(x, (x[:, 0] > 0).long())
    def train_dataloader(self):
        return DataLoader(self.ds, batch_size=32)
    def val_dataloader(self):
        return DataLoader(self.ds, batch_size=64)

def make():
    return Net(), Data()
''')
    wl = load_target(f"{f}:make")
    model = wl.fresh_model()
    opt = wl.make_optimizer(model)
    assert isinstance(opt, torch.optim.SGD)
    stream = wl.batch_stream()
    before = wl.eval_fn(model)
    for _ in range(30):
        opt.zero_grad()
        wl.loss_fn(model, next(stream)).backward()
        opt.step()
    after = wl.eval_fn(model)
    assert after > max(before, 0.8)  # it trained, and the logged val_acc is the eval metric
    sys.modules.pop("lit", None)
