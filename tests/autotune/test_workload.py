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


# -- Hugging Face Trainer targets ------------------------------------------------------------------------------
ROOT = HERE.parents[1]


def _first_batches(wl: Workload, n: int) -> list:
    stream = wl.batch_stream()
    return [next(stream)["input_ids"].clone() for _ in range(n)]


def test_transformers_trainer_target_is_a_paired_workload_that_trains():
    """recipes/autotune_transformers.py:workload returns the Trainer of recipes/train_transformers.py: its model,
    Trainer's batches (the same ones on every rebuild, whatever the global RNG did), Trainer's loss and the
    optimizer Trainer would create."""
    pytest.importorskip("transformers")
    wl = load_target(f"{ROOT / 'recipes' / 'autotune_transformers.py'}:workload")
    assert type(wl.model).__name__ == "LlamaForCausalLM" and wl.name == "workload" and wl.eval_fn is None
    first = _first_batches(wl, 2)
    assert first[0].shape == (8, 64)  # per_device_train_batch_size x the recipe's window
    torch.manual_seed(123), torch.rand(7)  # the tuner's runs move the global RNG between rebuilds
    again = wl.rebuild()
    assert again.model is not wl.model
    assert all(torch.equal(a, b) for a, b in zip(first, _first_batches(again, 2)))  # paired runs
    model = again.fresh_model()
    opt = again.make_optimizer(model)
    assert type(opt).__name__ == "AdamW" and opt.defaults["lr"] == 3e-3  # TrainingArguments' optim and lr
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    stream = again.batch_stream()
    losses = []
    for _ in range(4):
        loss = again.loss_fn(model, next(stream))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5, losses  # it trains (byte-level loss starts near ln 256 = 5.5)


TRAINER_TARGETS = '''
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, i):
        ids = (torch.arange(8) + i) % 32
        return {"input_ids": ids, "labels": ids.clone()}

def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))

def args(**kw):
    return TrainingArguments(output_dir=str(Path(__file__).parent / "out"), use_cpu=True, report_to="none", save_strategy="no", **kw)

def parts():
    return model(), Ids()

def accumulating():
    return Trainer(model=model(), args=args(per_device_train_batch_size=4, gradient_accumulation_steps=2),
                   train_dataset=Ids())

def own_optimizer():
    m = model()
    return Trainer(model=m, args=args(), train_dataset=Ids(), optimizers=(torch.optim.SGD(m.parameters(), lr=0.25), None))

def no_data():
    return Trainer(model=model(), args=args())
'''


def test_trainer_parts_accumulation_own_optimizer_and_a_trainer_without_data(tmp_path):
    pytest.importorskip("transformers")
    f = tmp_path / "hf_targets.py"
    f.write_text(TRAINER_TARGETS)
    wl = load_target(f"{f}:parts")  # (model, dataset): a Trainer with default TrainingArguments around it
    assert next(wl.batch_stream())["input_ids"].shape == (8, 8)  # Trainer's default batch size, 8
    assert type(wl.make_optimizer(wl.fresh_model())).__name__ == "AdamW"

    acc = load_target(f"{f}:accumulating")  # a step is gradient_accumulation_steps micro-batches
    step = next(acc.batch_stream())
    assert isinstance(step, list) and len(step) == 2 and step[0]["input_ids"].shape == (4, 8)
    model = acc.fresh_model()
    each = [model(**b).loss for b in step]
    assert torch.allclose(acc.loss_fn(model, step), (each[0] + each[1]) / 2)

    own = load_target(f"{f}:own_optimizer")  # rebuilt on each fresh model from its class and defaults
    fresh = own.fresh_model()
    opt = own.make_optimizer(fresh)
    assert type(opt) is torch.optim.SGD and opt.defaults["lr"] == 0.25
    assert opt.param_groups[0]["params"][0] is next(fresh.parameters())

    with pytest.raises(ValueError) as e:
        load_target(f"{f}:no_data")
    assert "the Trainer has no train_dataset" in str(e.value) and "\n" not in str(e.value)
    sys.modules.pop("hf_targets", None)
