"""Hugging Face ``transformers.Trainer`` (and TRL's trainers built on it): one added line.

``Trainer`` builds its DDP model inside ``train()`` (through Accelerate) and offers no comm hook:
``TrainingArguments`` has no such field and Accelerate's ``DistributedDataParallelKwargs.comm_hook``
takes only its closed enum. What it does offer is the callback system, and ``trainer.model_wrapped``
(documented: "always points to the most external model"), which is the DDP wrapper by the time
``on_train_begin`` runs, before the first forward. So FastML attaches itself as a callback::

    trainer = Trainer(model=model, args=args, train_dataset=ds)        # or SFTTrainer(...)
    fastml_strategy.transformers.setup(trainer, plan="int4")           # the one added line
    trainer.train()                                                    # torchrun / accelerate launch

What the callback (:class:`FastMLCallback`) does, on every process:

1. ``setup`` resolves the plan (the argument, else ``FASTML_PLAN``: a recipe name or a plan JSON; default
   ``int4``) and checks it against ``trainer.model``'s parameters at once (a tied weight's other name,
   ``lm_head.weight`` of GPT-2, is accepted with a note, as ``register_hook`` does), so a typo fails on
   the line that names it, before any step. When the launcher's process group is up (``Trainer(...)``
   starts it), the ranks agree there: a bad plan file on one rank, or ranks given different plans,
   raise the same one-line ValueError on every rank, before DDP is built. A launch of several
   processes whose Trainer would train each alone (``TrainingArguments.parallel_mode`` not
   distributed: on a machine without GPUs, ``use_cpu=True`` is missing) raises there too, naming
   the fix, instead of training uncompressed and reporting a plan it never ran.
2. ``on_train_begin`` (after ``accelerator.prepare``, before the first backward) hands
   ``trainer.model_wrapped`` to :func:`fastml_strategy.accelerate.setup`: FastML's comm hook on a DDP
   model (every rank agrees on the plan first, or every rank raises the same one-line ValueError),
   FSDP2's compressed reduce-scatter on an FSDP2 model, nothing in one process. Plan names are the
   names of ``trainer.model.named_parameters()``: for a PEFT model, the adapter names you see
   (``base_model.model....lora_A.default.weight``), only the trainable ones compressed. LoRA's
   matrices (r x width) are under a recipe's ``min_numel`` of 4096 elements, so for a model that
   trains PEFT adapters a recipe name (or the default) gets ``min_numel`` lowered to the smallest
   adapter matrix, said in one INFO line; a Plan, dict or plan JSON keeps its own ``min_numel``.
3. ``on_log``, at the logging interval, adds ``fastml/compression_ratio`` and ``fastml/bytes_per_step``
   (this rank's bytes on the wire per optimizer step since the last log, against a ring all-reduce of
   fp32) and ``fastml/error/<parameter>`` (the relative compression error of each compressed
   parameter, measured every ``layer_stats_every`` steps: logged once, at the first logging step after
   each measurement, never repeated in between) to the logs: they reach
   ``trainer.state.log_history`` and the reporting callbacks (TensorBoard, W&B), which run after it.
4. ``on_save`` writes every rank's FastML state (error-feedback residuals, step, plan) into the
   checkpoint folder (``checkpoint-N/fastml_state.pt``, atomically; gathering it is a collective, and
   Trainer calls ``on_save`` on every process). ``trainer.train(resume_from_checkpoint=...)`` loads it
   back in ``on_train_begin``, so the resumed run continues on the same trajectory as an uninterrupted
   one, bit for bit. A checkpoint saved under another plan is refused, naming the file and the
   ``setup(trainer, plan=...)`` that resumes it (or deleting the file, to start error feedback anew).

Gradient accumulation (``gradient_accumulation_steps``) needs nothing: Trainer runs the micro-batches
before the last inside ``accelerator.no_sync``, which calls no comm hook, so only the synchronising
micro-batch is compressed (``state.step`` counts optimizer steps). ``ddp_bucket_cap_mb`` is DDP's to
use and FastML keeps it; without it, a model that DDP's default 25 MB cap packs into fewer than three
buckets gets a warning (once, rank 0) with the ``ddp_bucket_cap_mb`` that :func:`~fastml_strategy.hook.suggest_bucket_cap_mb`
computes (communication then overlaps backward). ``bf16=True`` mixed precision, gradient checkpointing
and ``torch_compile=True`` (Accelerate compiles the DDP model; FastML finds DDP inside it) change nothing
here. DeepSpeed has no DDP model: FastML warns and training runs uncompressed.

FSDP2 (``TrainingArguments(fsdp=True, fsdp_config={"version": 2, ...})``): Accelerate shards the model in
``train()`` and the callback registers :func:`fastml_strategy.fsdp.register` on it (with HSDP, a
``parallelism_config`` of ``dp_replicate_size`` > 1, FastML compresses the cross-replica all-reduce). On
CPU, Accelerate (1.15) ignores its FSDP plugin and would build DDP; ``setup`` then switches Accelerate's
state to its own FSDP2 path before ``train()`` (:func:`_shard_on_cpu`), so that the same
``TrainingArguments`` shard on gloo as on NCCL. HSDP cannot be configured on CPU: Accelerate's
``ParallelismConfig`` check raises in ``Trainer(...)`` there, before FastML runs.

Local steps (below 1 Gbit/s): ``setup(trainer, plan="int4", every=H)`` switches DDP's all-reduce off (a
comm hook that hands every bucket back as it is: each rank keeps its own gradients) and runs
:class:`~fastml_strategy.LocalSGD` on the module inside DDP: ``local.step()`` at every ``on_step_end``,
so the ranks average their compressed pseudo-gradients every H optimizer steps and apply an outer step
(``outer``, ``outer_lr``, ``outer_momentum``, ``fragments``, ``delay``: LocalSGD's, else
``FASTML_LOCALSGD_*``). Between two synchronisations every rank's model and optimizer are its own, so
the checkpoint's ``fastml_state.pt`` then holds every rank's model, optimizer and LocalSGD state, and a
resume gives each rank its own back over the rank-0 state Trainer loaded.

Why ``setup(trainer)`` and not ``callbacks=[FastMLCallback()]``: a callback's events are handed the
unwrapped model, never the DDP wrapper or the Trainer, so the callback must know its Trainer; ``setup``
binds it (``FastMLCallback(plan).bind(trainer)`` does the same by hand). Resuming looks for the FastML
state in ``TrainingArguments.resume_from_checkpoint`` and in ``output_dir/checkpoint-<global step>``
(where ``resume_from_checkpoint=True`` and Trainer's own folders are); a resume from a folder elsewhere
warns that the residuals start from zero unless ``TrainingArguments(resume_from_checkpoint=...)`` names it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("fastml_strategy.transformers needs Hugging Face transformers: pip install "
                      "'fastml-strategy[transformers]' (or pip install transformers)") from e

from fastml_strategy.comm._distributed import checked_plan
from fastml_strategy._io import atomic_open
from fastml_strategy._integration import TRAINER_KEYS, counters, find_ddp, metrics, setting
from fastml_strategy.integrations.accelerate import LocalSGDCheckpoint
from fastml_strategy.integrations.accelerate import setup as accelerate_setup
from fastml_strategy.config import DEFAULT_RECIPE, RECIPES, Plan, resolve_plan
from fastml_strategy._advice import advise, unactionable
from fastml_strategy.hook import suggest_bucket_cap_mb
from fastml_strategy.localsgd import LocalSGD, resolve_settings

__all__ = ["setup", "FastMLCallback", "STATE_FILE"]

log = logging.getLogger(__name__)

STATE_FILE = "fastml_state.pt"  # in each checkpoint-N folder
_FORMAT_VERSION = 1
# DDP's default bucket_cap_mb, and the smallest gradient for which the bucket advice matters (as in hook.py)
_DDP_DEFAULT_CAP_MB = 25
_ADVISE_BYTES = 8 << 20


def _callbacks_first(trainer: Any, callback: "FastMLCallback") -> None:
    """Put ``callback`` first in the Trainer's callback list, so that the reporting callbacks
    (TensorBoard, W&B...) run after its ``on_log`` and see FastML's figures. Reads
    ``trainer.callback_handler.callbacks`` (not underscored, but not documented either):
    tests/test_upstream_internals.py fails if transformers renames it; here a missing list falls back to
    ``add_callback`` (the figures then still reach ``state.log_history``)."""
    handler = getattr(trainer, "callback_handler", None)
    cbs = getattr(handler, "callbacks", None)
    if not isinstance(cbs, list):
        log.warning("FastML: trainer.callback_handler.callbacks is not a list in this transformers; adding "
                    "the FastML callback last (reporting callbacks that run before it miss its figures)")
        trainer.add_callback(callback)
        return
    cbs.insert(0, callback)


class FastMLCallback(TrainerCallback):
    """Registers FastML on the Trainer's DDP (or FSDP2) model at ``on_train_begin``, logs its figures,
    checkpoints and restores its state. Build it with :func:`setup`; see the module docstring."""

    def __init__(self, plan: Plan | str | os.PathLike | dict | None = None, *,
                 layer_stats_every: int | None = None, check_replicas_every: int | None = None,
                 layer_metrics: bool = True, every: int | None = None, **localsgd: Any) -> None:
        # -- tuned by the user --------------------------------------------------------------------
        if every is None and localsgd:
            raise TypeError(f"FastMLCallback: {sorted(localsgd)} are LocalSGD settings; they need every=H "
                            f"(local steps between synchronisations), which turns LocalSGD on")
        self.localsgd: dict | None = None  # LocalSGD's settings (every=H opts in), else None: DDP's hook
        if every is not None:
            self.plan, self.localsgd = resolve_settings(plan, every=every, **localsgd)
        else:
            self.plan = resolve_plan(plan)  # a bad plan or FASTML_PLAN fails here, naming it
        self.layer_stats_every = layer_stats_every  # None: FASTML_LAYER_STATS_EVERY, else 10
        self.check_replicas_every = check_replicas_every  # None: FASTML_CHECK_REPLICAS_EVERY, else 0
        self.layer_metrics = layer_metrics  # fastml/error/<parameter> in the logs: one entry per layer
        # -- internal state -------------------------------------------------------------------------
        self.trainer: Any = None
        self.state: Any = None  # FastMLState (DDP), FSDPState (FSDP2), LocalSGD, or None (one process)
        self._local_ckpt: LocalSGDCheckpoint | None = None  # every rank's model/optimizer/LocalSGD state
        self._model: Any = None  # the wrapped model the state belongs to
        self._last = (0, 0, 0.0)  # (steps, bytes_sent, bytes_uncompressed) at the last log
        self._logged_errors: dict[str, float] = {}  # fastml/error/<layer> as last logged (not logged again)

    def bind(self, trainer: Any) -> "FastMLCallback":
        """Attach to ``trainer`` (first in its callback list); returns self."""
        self.trainer = trainer
        _callbacks_first(trainer, self)
        return self

    # -- registration ------------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self.trainer
        if trainer is None:
            raise TypeError("FastMLCallback was not bound to its Trainer (callback events are handed the "
                            "unwrapped model, not the DDP one); instead of callbacks=[FastMLCallback()], "
                            "call fastml_strategy.transformers.setup(trainer, plan=...) after building the "
                            "Trainer")
        wrapped = trainer.model_wrapped
        if self.state is not None and wrapped is self._model:
            return  # a second train() on the same prepared model: the hook is registered already
        ddp = find_ddp(wrapped)
        try:
            if self.localsgd is not None:
                self.state = self._start_local_sgd(trainer, wrapped, ddp)
            else:
                unactionable("gradient_as_bucket_view")  # no TrainingArguments field sets it
                self.state = accelerate_setup(trainer.accelerator, wrapped, self.plan, checkpoint=False,
                                              layer_stats_every=self.layer_stats_every,
                                              check_replicas_every=self.check_replicas_every)
        except ValueError as e:  # the same one-line error on every rank, before the first step
            raise ValueError(f"fastml_strategy.transformers: {' '.join(str(e).split())}") from None
        self._model = wrapped
        if ddp is not None and getattr(args, "fsdp", None) and args.should_log:
            warnings.warn("FastML: TrainingArguments ask for FSDP (fsdp/fsdp_config) but Trainer's model is a "
                          "DistributedDataParallel: Accelerate did not shard it, so FastML compresses DDP's "
                          "all-reduce of the full gradients. Call fastml_strategy.transformers.setup(trainer) "
                          "before trainer.train() with fsdp_config={'version': 2} (on CPU setup switches "
                          "Accelerate to FSDP2)", stacklevel=2)
        if ddp is not None and self.localsgd is None:
            self._advise_buckets(args, ddp)
        if self.state is not None and state.global_step > 0:
            self._resume(args, state)
        self._last = self._counters()
        self._logged_errors = {}
        log.debug("FastMLCallback: registered on a %s (plan %s)", type(wrapped).__name__, self.plan.name)

    def _start_local_sgd(self, trainer, wrapped, ddp) -> LocalSGD | None:
        """LocalSGD on the module inside Trainer's DDP model, whose own all-reduce is switched off by a
        comm hook that hands each bucket back as it is (this rank's gradients): the ranks then
        communicate only in the outer synchronisations, every ``every`` optimizer steps
        (``on_step_end``)."""
        if ddp is None:
            if _is_distributed(trainer):
                raise ValueError(f"LocalSGD (every=H) needs Trainer's DDP model; this one is a "
                                 f"{type(wrapped).__name__} (FSDP or DeepSpeed): drop every= to compress "
                                 f"its gradients instead")
            checked_plan(self.plan, trainer.model)  # one process: nothing to agree with
            return None
        ddp.register_comm_hook(None, _local_gradients_hook)
        layer_every = setting("layer_stats_every", self.layer_stats_every, owner="fastml_strategy.transformers",
                              localsgd=True)
        inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # under Accelerate's wrapper
        local = LocalSGD(ddp.module, inner, plan=self.plan, layer_stats_every=layer_every, **self.localsgd)
        self._local_ckpt = LocalSGDCheckpoint(local, ddp.module, [trainer.optimizer])
        return local

    def on_step_end(self, args, state, control, **kwargs):
        if isinstance(self.state, LocalSGD):
            self.state.step()  # after the optimizer step: synchronises every `every` steps

    def _advise_buckets(self, args, ddp) -> None:
        if args.ddp_bucket_cap_mb is not None or not args.should_log:
            return
        module = ddp.module
        nbytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
        if nbytes >= _ADVISE_BYTES and nbytes / (_DDP_DEFAULT_CAP_MB << 20) < 3:
            advise("bucket_cap_mb",
                   f"FastML: DDP's default bucket_cap_mb=25 packs this model's {nbytes / 1e6:.1f} MB of gradients "
                   "into fewer than 3 buckets, so communication starts only when backward is (nearly) done; "
                   f"TrainingArguments(ddp_bucket_cap_mb={suggest_bucket_cap_mb(module):.2f}) gives about 4 "
                   "buckets whose all-reduce overlaps the rest of backward")

    # -- metrics -----------------------------------------------------------------------------------------
    def _counters(self) -> tuple:
        return (0, 0, 0.0) if self.state is None else counters(self.state.stats())

    def metrics(self) -> dict:
        """FastML's figures since the last call (what ``on_log`` adds to the logs). A layer's error is
        measured every ``layer_stats_every`` steps: it is in the figures of the first call after each
        measurement only, so a dashboard shows each measurement once, at about the step it was made,
        and no stale value repeated at the logging steps in between."""
        if self.state is None:
            return {}
        s = self.state.stats()
        out = metrics(s, TRAINER_KEYS, since=self._last, layers=self.layer_metrics)
        self._last = counters(s)
        prefix = f"fastml/{TRAINER_KEYS.layer_error}"
        for key in [k for k in out if k.startswith(prefix)]:
            if self._logged_errors.get(key) == out[key]:
                del out[key]  # the same measurement as at the last log: not measured since
            else:
                self._logged_errors[key] = out[key]
        return out

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is None or "loss" not in logs or self.state is None:
            return  # only the training logs of the logging interval (not eval or the final summary)
        figures = self.metrics()
        logs.update(figures)
        # Trainer appended a copy of the logs to log_history just before on_log: add them there too
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)

    # -- checkpoints -------------------------------------------------------------------------------------
    def on_save(self, args, state, control, **kwargs):
        if self.state is None:
            return
        if self._local_ckpt is not None:  # each rank's model and optimizer are its own between syncs
            sd = self._local_ckpt.state_dict()  # a collective; rank 0 receives every rank's part
            if not sd:
                return
        else:
            sd = self.state.state_dict(all_ranks=True)  # a collective: every rank is here
        if not args.should_save:
            return
        folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        if not folder.is_dir():
            warnings.warn(f"FastML: the checkpoint folder {str(folder)!r} does not exist (a hyperparameter "
                          f"search writes elsewhere); FastML's state was not saved, and a resume from this "
                          f"checkpoint restarts error feedback from zero", stacklevel=2)
            return
        with atomic_open(folder / STATE_FILE, "wb") as f:
            torch.save({"format_version": _FORMAT_VERSION, "global_step": state.global_step,
                        "kind": "localsgd" if self._local_ckpt is not None else "ddp", "fastml": sd}, f)
        log.debug("FastMLCallback: saved the FastML state of %d rank(s) in %s", len(sd.get("per_rank", [sd])),
                  folder)

    def _resume(self, args, state) -> None:
        step = state.global_step
        candidates = []
        if isinstance(args.resume_from_checkpoint, str):
            candidates.append(Path(args.resume_from_checkpoint))
        candidates.append(Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{step}")
        for folder in candidates:
            path = folder / STATE_FILE
            if not path.is_file():
                continue
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if saved.get("format_version") != _FORMAT_VERSION:
                raise ValueError(f"fastml_strategy.transformers: {str(path)!r} has format_version "
                                 f"{saved.get('format_version')!r}, this FastML reads {_FORMAT_VERSION}; "
                                 f"upgrade FastML, or delete the file to restart error feedback from zero")
            if saved.get("global_step") != step:
                continue  # another checkpoint's state: not this resume's
            kind = "localsgd" if self._local_ckpt is not None else "ddp"
            if saved.get("kind", "ddp") != kind:
                raise ValueError(f"fastml_strategy.transformers: {str(path)!r} holds the state of a "
                                 f"{saved.get('kind', 'ddp')} run, this one is {kind} (every= "
                                 f"{'given' if kind == 'localsgd' else 'not given'}); resume it the way it "
                                 f"was trained, or delete the file to restart FastML's state from zero")
            self._check_saved_plan(path, saved["fastml"], args.process_index)
            try:
                (self._local_ckpt or self.state).load_state_dict(saved["fastml"])
            except ValueError as e:
                raise ValueError(f"fastml_strategy.transformers: cannot resume FastML's state from {str(path)!r} "
                                 f"({' '.join(str(e).split())}); resume with the processes and plan it was saved "
                                 f"with, or delete {path.name} from {str(folder)!r} to start the error-feedback "
                                 f"residuals from zero") from None
            log.debug("FastMLCallback: resumed the FastML state of step %d from %s", step, path)
            return
        if args.should_log:
            warnings.warn(f"FastML: resuming at step {step}, but no {STATE_FILE} of that step is in "
                          f"{[str(c) for c in candidates]}; error-feedback residuals start from zero (training "
                          f"goes on, not bit-exactly as an uninterrupted run). If you resumed from a folder "
                          f"outside output_dir, name it in TrainingArguments(resume_from_checkpoint=...)",
                          stacklevel=2)

    def _check_saved_plan(self, path: Path, saved: dict, rank: int) -> None:
        """Refuse, on every rank (each reads the same file), a checkpoint whose residuals belong to another
        plan, naming the file and the ``setup`` call that resumes it: a Trainer user cannot reach
        ``load_state_dict(strict=...)``, which the state's own message would suggest."""
        per = saved.get("per_rank") or [saved]
        own = per[rank] if rank < len(per) else per[0]  # another world size: load_state_dict says so
        own = own.get("localsgd", own)  # LocalSGD: the plan is in each rank's LocalSGD state
        if not isinstance(own.get("plan"), dict):
            return
        theirs, ours = Plan.from_dict(own["plan"]), getattr(self.state, "plan", self.plan)
        if theirs.digest() == ours.digest():
            return
        if theirs.name in RECIPES:
            fix = f"fastml_strategy.transformers.setup(trainer, plan={theirs.name!r}) (or FASTML_PLAN={theirs.name})"
        else:
            fix = (f"fastml_strategy.transformers.setup(trainer, plan=...) with the plan JSON that run used "
                   f"(its plan is named {theirs.name!r})")
        raise ValueError(
            f"fastml_strategy.transformers: {str(path)!r} holds the error-feedback residuals of plan "
            f"{theirs.name!r}, and this run's plan is {ours.name!r}"
            f"{' (the same name, other settings)' if theirs.name == ours.name else ''}; to resume exactly, "
            f"call {fix}; to train on with the new plan, delete {path.name} from that folder (the residuals "
            f"then start from zero)")


def _shard_on_cpu(trainer: Any, every: int | None) -> bool:
    """Make ``TrainingArguments(fsdp=..., fsdp_config={"version": 2})`` shard on CPU, as it does on GPUs.

    Accelerate (1.15) decides FSDP only for GPU-like devices: on CPU its state stays ``MULTI_CPU``, it
    drops the FSDP plugin that Trainer built from ``fsdp_config``, and ``prepare`` wraps the model in
    DDP. Its FSDP2 path itself (``fully_shard`` per ``transformer_layer_cls_to_wrap`` unit, the embedding,
    the norm + head, the root; the optimizer re-pointed at the shards; ``no_sync`` as
    ``set_requires_gradient_sync(False)``; sharded checkpoints) runs on gloo. So, before ``train()``
    prepares anything, this switches Accelerate's state to FSDP with the plugin Trainer would have used
    (``Trainer(...).args.fsdp_plugin_args``, the mixed precision applied as Accelerate does) and sets
    ``trainer.is_fsdp_enabled``, which Trainer reads in ``train()``: Trainer then takes its own FSDP2 path
    (optimizer created before ``prepare``, FSDP checkpoints) and FastML compresses the reduce-scatter.

    It writes four public attributes that Accelerate and Trainer set in their constructors and do not
    expect to change afterwards (``AcceleratorState().distributed_type`` and ``.fsdp_plugin``,
    ``PartialState().distributed_type``, ``Trainer.is_fsdp_enabled``); tests/test_upstream_internals.py
    checks what they mean, and this function checks ``accelerator.is_fsdp2`` after writing them.
    Returns whether it switched. Nothing happens on GPUs (Accelerate shards there itself) or when no
    FSDP2 is asked for (FSDP1, ``"version": 1``, never gets here on CPU: Accelerate's FSDP1 plugin raises
    in ``Trainer(...)`` without a GPU; on GPUs FastML refuses FSDP1 with a TypeError at train begin).
    HSDP (``parallelism_config`` with ``dp_replicate_size`` > 1) cannot reach here on CPU: Accelerate's
    ``ParallelismConfig`` check raises in ``Trainer(...)`` already."""
    args = trainer.args
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if not getattr(args, "fsdp", None) or not plugin_args:  # no FSDP asked for (or XLA's)
        return False
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    acc = trainer.accelerator
    if acc.distributed_type != DistributedType.MULTI_CPU or getattr(acc.state, "fsdp_plugin", None) is not None:
        return False  # GPUs (Accelerate shards), DeepSpeed, one process
    if plugin_args.get("fsdp_version") != 2:
        return False  # FSDP1: on CPU, Trainer(...) already raised (Accelerate's FSDP1 plugin needs a GPU)
    if trainer.model_wrapped is not trainer.model:
        return False  # trained before setup: the model is in DDP already (the callback warns at train begin)
    where = "fastml_strategy.transformers.setup"
    if every is not None:
        raise ValueError(f"{where}: LocalSGD (every={every}) needs Trainer's DDP model, and TrainingArguments "
                         f"ask for FSDP (fsdp/fsdp_config); drop every= to compress FSDP2's reduce-scatter, or "
                         f"drop fsdp to run local steps")
    # what Trainer checks after building an FSDP Accelerator (create_accelerator_and_postprocess, __init__)
    if plugin_args.get("activation_checkpointing") and getattr(args, "activation_checkpointing", False):
        raise ValueError(f"{where}: fsdp_config['activation_checkpointing'] and the activation_checkpointing "
                         f"training argument can't both be True (Trainer refuses it with FSDP); keep FSDP's")
    if args.save_only_model and (args.load_best_model_at_end
                                 or "SHARDED_STATE_DICT" in str(plugin_args.get("state_dict_type"))):
        raise ValueError(f"{where}: save_only_model=True with FSDP needs state_dict_type FULL_STATE_DICT and "
                         f"load_best_model_at_end=False (Trainer refuses it with FSDP)")
    if trainer.optimizer is not None or trainer.lr_scheduler is not None:
        raise ValueError(f"{where}: Trainer(optimizers=...) is not allowed with FSDP (Trainer refuses it on "
                         f"GPUs too); override create_optimizer_and_scheduler in a Trainer subclass instead")
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    if acc.state.mixed_precision != "no":
        plugin.set_mixed_precision(acc.state.mixed_precision)  # as AcceleratorState does for FSDP
    acc.state.fsdp_plugin = plugin
    acc.state.distributed_type = DistributedType.FSDP
    PartialState().distributed_type = DistributedType.FSDP
    trainer.is_fsdp_enabled = True
    if not acc.is_fsdp2:
        raise RuntimeError(f"{where}: this accelerate {_version('accelerate')} did not take FSDP2 on CPU "
                           f"(accelerator.is_fsdp2 stays False after FastML set distributed_type FSDP and the "
                           f"plugin); drop fsdp from TrainingArguments to train DDP on CPU, or report it")
    if args.should_log:
        log.info("FastML: Accelerate ignores its FSDP plugin on CPU (distributed_type MULTI_CPU); switched this "
                 "Trainer's Accelerator to FSDP2 (fsdp_config version 2), as on GPUs")
    return True


def _version(dist_name: str) -> str:
    from importlib.metadata import version

    return version(dist_name)


def _local_gradients_hook(state, bucket):
    # DDP's all-reduce switched off (LocalSGD): each rank keeps its own gradients. No annotations: DDP
    # checks them, and this module's postponed ones would be strings.
    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _is_distributed(trainer: Any) -> bool:
    return getattr(trainer.accelerator, "num_processes", 1) > 1


def _launched_processes() -> int:
    """How many processes the launcher started: the process group's size once it is up (``Trainer(...)``
    starts it under torchrun, even when it then trains each process alone), else ``WORLD_SIZE``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    try:
        return int(os.environ.get("WORLD_SIZE", "1") or 1)
    except ValueError:
        return 1


def _check_data_parallel(trainer: Any) -> None:
    """Refuse a launch of several processes whose Trainer trains each one alone.

    transformers 5 on a machine without GPUs, under ``torchrun --nproc_per_node 2`` without
    ``TrainingArguments(use_cpu=True)``: Accelerate's state is ``NO`` (it looks for an accelerator
    device, and takes the CPU as a distributed device only when asked to), ``parallel_mode`` is
    ``not_parallel``, and ``train()`` builds no DDP model, so every rank trains its own model on the
    whole data set and FastML would have nothing to compress. transformers only logs a warning; FastML
    raises, naming the fix."""
    processes = _launched_processes()
    mode = getattr(trainer.args, "parallel_mode", None)
    if processes <= 1 or getattr(mode, "name", None) not in ("NOT_PARALLEL", "NOT_DISTRIBUTED"):
        return
    kind = getattr(getattr(trainer.accelerator, "distributed_type", None), "value", "?")
    raise ValueError(
        f"this is one of {processes} processes, but the Trainer trains each process alone "
        f"(TrainingArguments.parallel_mode is {mode.value!r}, Accelerate's distributed_type {kind!r}): no "
        f"DistributedDataParallel model, no gradient all-reduced, nothing for FastML to compress. On a machine "
        f"without GPUs pass TrainingArguments(use_cpu=True) (or set ACCELERATE_USE_CPU=1), so that the "
        f"processes train data-parallel over gloo; with GPUs, make one visible to every process")


def _trains_adapters(model: Any) -> bool:
    """Whether ``model`` holds PEFT adapter layers (``peft.tuners.tuners_utils.BaseTunerLayer``: a
    ``get_peft_model`` model, TRL's ``peft_config=``, or transformers' ``model.add_adapter``). peft is
    imported only if it already is: a model with adapters imported it."""
    if "peft" not in sys.modules or not isinstance(model, torch.nn.Module):
        return False
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # pragma: no cover - a peft without the class
        return False
    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


def _fit_adapters(plan: Plan, given: Any, trainer: Any) -> Plan:
    """A recipe's plan (``plan="int4"``, or None: a recipe in ``FASTML_PLAN``, else the default) for a
    model that trains PEFT adapters, with ``min_numel`` lowered to its smallest trainable matrix.

    A recipe keeps tensors under 4096 elements (biases, norms) uncompressed, and LoRA's matrices are
    r x width (8 x 768 = 6144 for GPT-2, 8 x 64 = 512 for a tiny model): with adapters, that is the
    whole gradient, and the recipe would compress none of it. A Plan, dict or plan JSON names its own
    ``min_numel`` and is kept as given; so is ``none`` (nothing to compress)."""
    name = given if given is not None else (os.environ.get("FASTML_PLAN") or DEFAULT_RECIPE)
    if not isinstance(name, str) or name not in RECIPES or not plan.default.lossy:
        return plan
    if not _trains_adapters(trainer.model):
        return plan
    sizes = [p.numel() for p in trainer.model.parameters() if p.requires_grad and p.dim() >= 2]
    if not sizes or min(sizes) >= plan.min_numel:
        return plan
    fitted = dataclasses.replace(plan, min_numel=min(sizes))
    if trainer.is_world_process_zero():
        log.info("FastML: the model trains PEFT adapters whose matrices have as few as %d elements, under plan "
                 "%r's min_numel=%d; using min_numel=%d so that they are compressed (pass a Plan, e.g. "
                 "Plan.from_recipe(%r, min_numel=N), to choose it yourself)", min(sizes), plan.name,
                 plan.min_numel, fitted.min_numel, plan.name)
    return fitted


def setup(trainer: Any, plan: Plan | str | os.PathLike | dict | None = None, *,
          layer_stats_every: int | None = None, check_replicas_every: int | None = None,
          layer_metrics: bool = True, every: int | None = None, **localsgd: Any) -> FastMLCallback:
    """Compress the gradients of ``trainer`` (a ``transformers.Trainer`` or a subclass: TRL's
    ``SFTTrainer``, ``DPOTrainer``...) with FastML: call it on every process, after building the
    Trainer and before ``trainer.train()``. Returns the :class:`FastMLCallback` (its ``.state`` is
    the :class:`~fastml_strategy.FastMLState` once training has begun).

    ``plan``: a recipe name, a plan JSON path, a dict or a :class:`~fastml_strategy.Plan`; None reads
    ``FASTML_PLAN`` (default ``int4``). ``layer_stats_every`` and ``check_replicas_every`` are
    :func:`fastml_strategy.accelerate.setup`'s (None: ``FASTML_LAYER_STATS_EVERY`` /
    ``FASTML_CHECK_REPLICAS_EVERY``). ``layer_metrics=False`` leaves the per-layer errors out of the
    logs. Raises ValueError for a bad plan, here or (for one naming no parameter of the model) when
    training begins, on every process, before the first step.

    When the process group is up, the ranks agree on the plan here (a collective: call ``setup`` on
    every process): a plan that fails on one rank, or ranks given different plans, raise the same
    ValueError on every rank. A launch of several processes whose Trainer trains each alone (no
    ``use_cpu=True`` on a machine without GPUs) raises ValueError too. For a model that trains PEFT
    adapters, a recipe name (or None) compresses the adapters: see :func:`_fit_adapters`.

    ``every=H`` opts in to local steps (:class:`~fastml_strategy.LocalSGD`, below 1 Gbit/s): DDP's
    per-step all-reduce is switched off, each rank takes H optimizer steps on its own, then the ranks
    average their compressed pseudo-gradients and apply an outer step. ``localsgd``: LocalSGD's other
    settings (``outer``, ``outer_lr``, ``outer_momentum``, ``fragments``, ``delay``), else
    ``FASTML_LOCALSGD_*``, else LocalSGD's defaults (DiLoCo's Nesterov). Checkpoints then hold every
    rank's model, optimizer and LocalSGD state (they differ between synchronisations), and a resume
    gives each rank its own back.
    """
    if not hasattr(trainer, "model_wrapped") or not hasattr(trainer, "accelerator"):
        raise TypeError(f"fastml_strategy.transformers.setup: expected a transformers.Trainer (or a subclass), "
                        f"got a {type(trainer).__name__}; for a plain Accelerate loop use "
                        f"fastml_strategy.accelerate.setup(accelerator, model)")
    if any(isinstance(cb, FastMLCallback) for cb in getattr(trainer.callback_handler, "callbacks", [])):
        raise ValueError("fastml_strategy.transformers.setup: this Trainer has a FastML callback already; "
                         "call setup once per Trainer and keep the callback it returned")
    made: list = []

    def build() -> None:  # everything checked on this rank; the ranks then agree (checked_plan)
        cb = FastMLCallback(plan, layer_stats_every=layer_stats_every, check_replicas_every=check_replicas_every,
                            layer_metrics=layer_metrics, every=every, **localsgd)
        cb.plan = _fit_adapters(cb.plan, plan, trainer)
        _check_data_parallel(trainer)
        made.append(cb)

    try:
        # the plan's names against trainer.model's parameters (tied names and frozen ones as register_hook
        # takes them), in any world size; agreed by every rank when the process group is up, before DDP
        agreed = checked_plan(lambda: made[0].plan, trainer.model, agree=True, check=build,
                              owner="fastml_strategy.transformers")
    except ValueError as e:
        raise ValueError(f"fastml_strategy.transformers: {' '.join(str(e).split())}") from None
    cb = made[0]
    cb.plan = agreed
    _shard_on_cpu(trainer, every)
    return cb.bind(trainer)
