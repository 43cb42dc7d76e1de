"""What the autotuner trains: a :class:`Workload`, and how a ``TARGET`` string becomes one.

``TARGET`` is ``path/to/file.py:factory`` or ``package.module:factory``. The factory takes no
arguments and returns either

- a :class:`Workload` (model, batches, loss function, optionally an eval function and an optimizer), or
- a LightningModule, or a ``(LightningModule, LightningDataModule)`` pair: the module's
  ``training_step`` gives the loss, ``configure_optimizers`` the optimizer, the datamodule's (or the
  module's) ``train_dataloader`` the batches; an accuracy-like value the module logs in
  ``validation_step`` (a logged name containing ``acc``) becomes the eval function, or
- a Hugging Face ``transformers.Trainer`` (or a subclass: TRL's ``SFTTrainer``...), built as your training
  script builds it, or a ``(model, train_dataset)`` / ``(model, train_dataset, data_collator)`` tuple of a
  ``transformers`` model (a ``Trainer`` with default ``TrainingArguments`` is built around it). The
  batches are ``trainer.get_train_dataloader()``'s (Trainer's collator, batch size, column removal and
  seeded shuffling, this rank's shard under torchrun), ``gradient_accumulation_steps`` micro-batches to
  a step; the loss is ``Trainer.compute_loss`` (the model's loss, ``label_smoothing_factor``,
  ``compute_loss_func``); the optimizer is ``trainer.create_optimizer`` on each fresh model copy
  (``optim``, ``learning_rate``, ``weight_decay`` groups, or the class and defaults of the optimizer
  you passed). Not taken from it: the learning-rate schedule (the tuner trains at the initial rate)
  and evaluation (the accuracy rule compares final losses; return a Workload with ``eval_fn`` for a
  metric). A subclass's own ``compute_loss`` is not used: its loss must be the model's (as
  ``SFTTrainer``'s is); for another loss (``DPOTrainer``) return a Workload.

When the autotuner runs distributed (torchrun), the factory runs on every rank: shard the data there
(a ``DistributedSampler``) as in your training script.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import inspect
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["Workload", "load_target", "as_workload"]


@dataclass
class Workload:
    """A model and how to train it for a few steps.

    ``batches`` is an iterable re-iterated when exhausted (a DataLoader), or a zero-argument callable
    returning an iterator. ``loss_fn(model, batch)`` returns the scalar loss of one batch.
    ``eval_fn(model)``, if given, returns a quality metric where higher is better (accuracy); the
    accuracy-loss limit is measured with it. ``optimizer(params)`` builds the optimizer (default:
    Adam, lr 1e-3).
    """

    model: torch.nn.Module
    batches: Iterable[Any] | Callable[[], Iterator[Any]]
    loss_fn: Callable[[torch.nn.Module, Any], torch.Tensor]
    eval_fn: Callable[[torch.nn.Module], float] | None = None
    optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer] | None = None
    name: str = "workload"
    # What the target was, so the report names the call that trains with the plan: "workload" (a
    # Workload: register_hook on your DDP model), "trainer" (transformers.setup), "lightning"
    # (FastMLStrategy). Set by as_workload.
    kind: str = "workload"
    # Filled by as_workload for LightningModules: builds the optimizer from a fresh model copy.
    _optimizer_from_model: Callable[[torch.nn.Module], torch.optim.Optimizer] | None = field(
        default=None, repr=False)
    # Filled by load_target: the TARGET's factory, so every calibration run is built afresh (a
    # deterministic factory then replays the same batches: runs are paired, see calibrate.runs_paired).
    factory: Callable[[], Any] | None = field(default=None, repr=False)
    # Set by the autotuner (--calibration-ranks): the data-parallel ranks a calibration run stands in
    # for. Each of its steps averages the gradients of this many batches, as DDP's all-reduce does,
    # before the simulated compression: a codec that compresses the mean (the low-rank codec, exactly)
    # converges with the ranks' mean gradient, not one rank's noisier one.
    ranks: int = field(default=1, repr=False)

    def rebuild(self) -> "Workload":
        """A new Workload from the factory (the same one when there is no factory): its model in its
        initial state and its batches from the start, whatever earlier runs drew."""
        if self.factory is None:
            return self
        wl = as_workload(self.factory(), name=self.name)
        wl.factory = self.factory
        wl.ranks = self.ranks
        return wl

    # -- helpers the profiler and the calibration use ------------------------------------------------
    def batch_stream(self) -> Iterator[Any]:
        """An endless stream of batches (re-iterating ``batches`` when it runs out)."""
        src = self.batches
        while True:
            it = iter(src()) if callable(src) else iter(src)
            got = False
            for b in it:
                got = True
                yield b
            if not got:
                raise ValueError(f"workload {self.name!r}: the batch iterator yielded no batches; "
                                 f"give a non-empty DataLoader or iterable")

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        if self._optimizer_from_model is not None:
            return self._optimizer_from_model(model)
        if self.optimizer is not None:
            return self.optimizer(model.parameters())
        return torch.optim.Adam(model.parameters(), lr=1e-3)

    def fresh_model(self) -> torch.nn.Module:
        """A deep copy of the model in its initial state (every calibration trial starts here)."""
        return copy.deepcopy(self.model)

    def validate(self) -> None:
        """Run one forward/backward on a copy, so a broken workload fails before profiling."""
        where = f"workload {self.name!r}"
        if not isinstance(self.model, torch.nn.Module):
            raise ValueError(f"{where}: model is a {type(self.model).__name__}, not a torch.nn.Module")
        params = [n for n, p in self.model.named_parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{where}: the model has no trainable parameters; there is nothing to tune")
        if not callable(self.loss_fn):
            raise ValueError(f"{where}: loss_fn is not callable; give loss_fn(model, batch) -> scalar")
        model = self.fresh_model()
        try:
            batch = next(self.batch_stream())
            loss = self.loss_fn(model, batch)
        except ValueError:
            raise
        except Exception as e:  # the user's code: name what failed, in one line
            raise ValueError(f"{where}: one training step failed ({type(e).__name__}: "
                             f"{_first_line(e)}); check the batch iterator and loss_fn") from None
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"{where}: loss_fn returned {type(loss).__name__}"
                             f"{tuple(loss.shape) if isinstance(loss, torch.Tensor) else ''}; "
                             f"return a scalar tensor")
        if not math.isfinite(float(loss.detach())):
            raise ValueError(f"{where}: the first loss is {float(loss.detach())}; fix the model or data "
                             f"first")
        loss.backward()
        if self.eval_fn is not None and not callable(self.eval_fn):
            raise ValueError(f"{where}: eval_fn is not callable; give eval_fn(model) -> float or None")


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


def _lightning_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    mods, dms = [], []
    for pkg in ("lightning.pytorch", "pytorch_lightning"):
        if pkg in sys.modules or importlib.util.find_spec(pkg.split(".")[0]) is not None:
            try:
                m = importlib.import_module(pkg)
            except Exception:
                continue
            mods.append(m.LightningModule)
            dms.append(m.LightningDataModule)
    return tuple(mods), tuple(dms)


def _lightning_workload(module: Any, datamodule: Any | None, name: str) -> Workload:
    """Adapt a LightningModule (+ datamodule) to a Workload without a Trainer."""
    src = datamodule if datamodule is not None else module
    if datamodule is not None:
        try:
            datamodule.prepare_data()
            datamodule.setup("fit")
        except Exception as e:
            raise ValueError(f"target {name!r}: datamodule.setup('fit') failed "
                             f"({type(e).__name__}: {_first_line(e)})") from None
    if not hasattr(src, "train_dataloader"):
        raise ValueError(f"target {name!r}: neither the datamodule nor the module has train_dataloader()")

    def batches() -> Iterator[Any]:
        return iter(src.train_dataloader())

    def silent_log(*args: Any, **kwargs: Any) -> None:  # no Trainer: logging goes nowhere
        return None

    def loss_fn(model: Any, batch: Any) -> torch.Tensor:
        model.log = silent_log
        model.log_dict = silent_log
        out = model.training_step(batch, 0)
        if isinstance(out, dict):
            out = out["loss"]
        return out

    return Workload(model=module, batches=batches, loss_fn=loss_fn,
                    eval_fn=_lightning_eval_fn(module, datamodule), name=name, kind="lightning",
                    _optimizer_from_model=_lightning_optimizer)


def _lightning_optimizer(model: Any) -> torch.optim.Optimizer:
    """The (first) optimizer of ``configure_optimizers()``, whichever of Lightning's forms it returns."""
    cfg = model.configure_optimizers()
    if isinstance(cfg, dict):
        cfg = cfg["optimizer"]
    if isinstance(cfg, (list, tuple)):
        cfg = cfg[0]
        if isinstance(cfg, (list, tuple)):
            cfg = cfg[0]
        if isinstance(cfg, dict):
            cfg = cfg["optimizer"]
    return cfg


def _lightning_eval_fn(module: Any, datamodule: Any | None) -> Callable[[Any], float | None] | None:
    """An eval function from the module's ``validation_step`` over the validation batches: the mean
    of the first logged metric whose name has "acc" (None: the module validates nothing)."""
    val_src = datamodule if datamodule is not None and hasattr(datamodule, "val_dataloader") else module
    base = next((c for c in type(module).__mro__ if c.__name__ == "LightningModule"), None)
    has_val = base is not None and type(module).validation_step is not base.validation_step
    if not (has_val and hasattr(val_src, "val_dataloader")):
        return None

    def eval_fn(model: Any) -> float | None:
        logged: dict[str, list[float]] = {}

        def log(name: str, value: Any, *a: Any, **k: Any) -> None:
            logged.setdefault(name, []).append(float(value))

        model.log = log
        model.log_dict = lambda d, *a, **k: [log(n, v) for n, v in d.items()]
        was = model.training
        model.eval()
        with torch.no_grad():
            for i, b in enumerate(val_src.val_dataloader()):
                model.validation_step(b, i)
        model.train(was)
        accs = sorted(n for n in logged if "acc" in n.lower())
        if not accs:
            return None
        vals = logged[accs[0]]
        return sum(vals) / len(vals)

    return eval_fn


def _transformers_classes() -> tuple[type, type] | None:
    """(Trainer, PreTrainedModel) when transformers is already imported (a factory that built either has
    imported it), else None: transformers is never imported here."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers import PreTrainedModel, Trainer
    except ImportError:  # a broken or partial install: not a Trainer workload
        return None
    return Trainer, PreTrainedModel


def _trainer_from_parts(parts: tuple, name: str) -> Any:
    """A ``Trainer`` with default ``TrainingArguments`` around ``(model, train_dataset[, data_collator])``."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    model, dataset = parts[0], parts[1]
    collator = parts[2] if len(parts) == 3 else None
    if dataset is None:
        raise ValueError(f"target {name!r} returned (model, None, ...); give the training dataset second")
    args = TrainingArguments(output_dir=str(Path(tempfile.gettempdir()) / "fastml-autotune-trainer"),
                             report_to="none", save_strategy="no", disable_tqdm=True,
                             use_cpu=not torch.cuda.is_available())
    return Trainer(model=model, args=args, train_dataset=dataset, data_collator=collator)


def _trainer_workload(trainer: Any, name: str) -> Workload:
    """Adapt a ``transformers.Trainer`` to a Workload without training it (see the module docstring)."""
    from transformers import Trainer

    where = f"target {name!r}"
    if trainer.train_dataset is None:
        raise ValueError(f"{where}: the Trainer has no train_dataset; build it with Trainer(..., "
                         f"train_dataset=...) as your training script does")
    loader = trainer.get_train_dataloader()
    if type(loader).__name__ == "DataLoaderDispatcher":  # Accelerate broadcasts each batch: a collective
        raise ValueError(f"{where}: Trainer dispatches the batches of this iterable dataset from the main "
                         f"process (a collective, which the tuner's single-process calibration cannot "
                         f"join); pass TrainingArguments(accelerator_config={{'dispatch_batches': False}}) "
                         f"and shard the dataset per rank, or give a map-style dataset")
    accumulate = max(1, int(trainer.args.gradient_accumulation_steps))
    given_optimizer = trainer.optimizer  # Trainer(optimizers=(opt, scheduler)), else None

    def batches() -> Iterator[Any]:
        it = iter(loader)
        if accumulate == 1:
            return it
        return _grouped(it, accumulate)  # one optimizer step: its micro-batches, one backward

    def loss_fn(model: Any, batch: Any) -> torch.Tensor:
        # Trainer's own compute_loss (not a subclass's: TRL's adds metrics, which gather across ranks);
        # a shallow copy, since it pops "labels" when smoothing
        if accumulate == 1:
            return Trainer.compute_loss(trainer, model, dict(batch))
        return sum(Trainer.compute_loss(trainer, model, dict(b)) for b in batch) / len(batch)

    def optimizer(model: Any) -> torch.optim.Optimizer:
        if given_optimizer is not None:
            return type(given_optimizer)(model.parameters(), **given_optimizer.defaults)
        trainer.optimizer = None  # create_optimizer builds one only when the Trainer has none
        try:
            return trainer.create_optimizer(model)
        finally:
            trainer.optimizer = given_optimizer

    return Workload(model=trainer.model, batches=batches, loss_fn=loss_fn, name=name, kind="trainer",
                    _optimizer_from_model=optimizer)


def _grouped(it: Iterator[Any], n: int) -> Iterator[list]:
    while True:
        group = [b for _, b in zip(range(n), it)]
        if len(group) < n:  # an epoch's last, incomplete step: as Trainer, start the next epoch
            return
        yield group


def as_workload(obj: Any, name: str = "workload") -> Workload:
    """Turn what a factory returned into a Workload (or raise ValueError saying what is accepted)."""
    if isinstance(obj, Workload):
        if obj.name == "workload":
            obj.name = name
        return obj
    hf = _transformers_classes()
    if hf is not None:
        trainer_cls, model_cls = hf
        if isinstance(obj, tuple) and len(obj) in (2, 3) and isinstance(obj[0], model_cls):
            obj = _trainer_from_parts(obj, name)
        if isinstance(obj, trainer_cls):
            return _trainer_workload(obj, name)
    mod_cls, dm_cls = _lightning_classes()
    if mod_cls:
        if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], mod_cls) and (
                obj[1] is None or isinstance(obj[1], dm_cls)):
            return _lightning_workload(obj[0], obj[1], name)
        if isinstance(obj, mod_cls):
            return _lightning_workload(obj, None, name)
    raise ValueError(
        f"target {name!r} returned a {type(obj).__name__}; return a "
        f"fastml_strategy.autotune.Workload, a LightningModule, (LightningModule, LightningDataModule), a "
        f"transformers.Trainer, or (transformers model, train_dataset[, data_collator])"
    )


def _import_target(spec: str, where: str) -> Any:
    """The module of a target: a file (``path/to/file.py``, imported under a private name) or an
    importable module path."""
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"target {spec!r}: file {where!r} does not exist; check the path")
        modname = f"_fastml_autotune_target_{abs(hash(str(path.resolve())))}"
        sys.path.insert(0, str(path.resolve().parent))
        try:
            s = importlib.util.spec_from_file_location(modname, path)
            module = importlib.util.module_from_spec(s)  # type: ignore[arg-type]
            sys.modules[modname] = module
            s.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as e:
            sys.modules.pop(modname, None)
            raise ValueError(f"target {spec!r}: importing {where!r} failed ({type(e).__name__}: "
                             f"{_first_line(e)})") from None
        finally:
            sys.path.remove(str(path.resolve().parent))
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise ValueError(f"target {spec!r}: module {e.name!r} not found; check the module path or "
                         f"give path/to/file.py:factory") from None
    except Exception as e:
        raise ValueError(f"target {spec!r}: importing {where!r} failed ({type(e).__name__}: "
                         f"{_first_line(e)})") from None


def load_target(spec: str) -> Workload:
    """Import ``file.py:factory`` or ``package.module:factory``, call the factory, return a Workload.

    Every failure is a ValueError with a one-line message that names the problem and the fix.
    """
    if ":" not in spec:
        raise ValueError(f"target {spec!r} has no ':factory' part; write path/to/file.py:factory "
                         f"or package.module:factory")
    where, _, attr = spec.rpartition(":")
    if not where or not attr.isidentifier():
        raise ValueError(f"target {spec!r}: {attr!r} is not a function name; write file.py:factory")
    module = _import_target(spec, where)
    factory = getattr(module, attr, None)
    if factory is None:
        public = [n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
                  and getattr(v, "__module__", None) == module.__name__]
        raise ValueError(f"target {spec!r}: {where!r} has no {attr!r}"
                         + (f"; it defines {', '.join(sorted(public)[:8])}" if public else ""))
    if not callable(factory):
        raise ValueError(f"target {spec!r}: {attr!r} is a {type(factory).__name__}, not a function")
    try:
        required = [p for p in inspect.signature(factory).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        required = []
    if required:
        raise ValueError(f"target {spec!r}: {attr}() needs argument(s) {[p.name for p in required]}; "
                         f"the factory must take no arguments")
    try:
        obj = factory()
    except Exception as e:
        raise ValueError(f"target {spec!r}: {attr}() raised {type(e).__name__}: {_first_line(e)}") from None
    wl = as_workload(obj, name=attr)
    wl.validate()
    wl.factory = factory
    return wl
