"""Every private torch / Lightning name FastML reads, checked on the installed versions.

FastML touches a private attribute where upstream offers no public way: the timeout given to
``init_process_group`` and whether a DDP model has a comm hook (each behind one function that logs a
warning when the name is gone), what ``torch.compile`` wraps, FSDP2's unit internals, two attributes
Lightning's own strategies set. ``fastml_strategy.fsdp.register`` reads and sets FSDP2's internals in
place rather than behind one function: each unit's parameter group (``_get_fsdp_state()
._fsdp_param_groups``, its ``fsdp_params`` with their sizes and placement), its flags
(``reduce_scatter_unused_params``, ``all_reduce_grads``, ``gradient_divide_factor``), and, for HSDP on a
2-D mesh, it replaces the group's ``mesh_info`` (and ``post_forward_mesh_info``) by a 1-D shard mesh,
restoring them and the custom hooks (``_reduce_scatter_comm``, ``_all_gather_comm``,
``_all_reduce_hook``) on ``close()``. These tests fail loudly when one of these names changes, so that
an upgrade of torch or Lightning that renames one is caught here, not by a run that silently stops
compressing or waiting on the user's timeout.
"""

from __future__ import annotations

import logging
import types

import pytest
import torch
import torch.distributed as dist

from _dist import run_workers


# -- torch.distributed: the default group's timeout, DDP's comm hooks ----------------------------------------
def _torch_internals(rank, world_size):
    from fastml_strategy.comm._distributed import default_group_timeout
    from fastml_strategy.hook import _has_comm_hook

    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, dist.ProcessGroup)
    timeout = pg._get_backend(torch.device("cpu")).options._timeout
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    hooks_before = type(ddp._comm_hooks).__name__, len(ddp._comm_hooks), _has_comm_hook(ddp)
    ddp.register_comm_hook(None, lambda state, bucket: torch.futures.Future())
    return {"timeout": timeout.total_seconds(), "fastml_timeout": default_group_timeout().total_seconds(),
            "hooks_before": hooks_before, "hooks_after": (len(ddp._comm_hooks), _has_comm_hook(ddp))}


def test_torch_distributed_internals_exist_and_hold_what_fastml_reads():
    r = run_workers(_torch_internals, 1, pg_timeout=37, timeout=90)[0]
    assert r["timeout"] == r["fastml_timeout"] == 37.0  # the user's init_process_group(timeout=...)
    assert r["hooks_before"] == ("list", 0, False)
    assert r["hooks_after"] == (1, True)


def test_unreadable_internals_log_a_warning(caplog):
    from fastml_strategy.comm._distributed import default_group_timeout
    from fastml_strategy.hook import _has_comm_hook

    assert not dist.is_initialized()
    with caplog.at_level(logging.WARNING, logger="fastml_strategy"):
        assert default_group_timeout() is None  # no default group: the read fails
        assert _has_comm_hook(types.SimpleNamespace()) is False  # a DDP without _comm_hooks
    text = caplog.text
    assert "cannot read the default process group" in text and "30 minutes" in text
    assert "no _comm_hooks" in text


# -- torch.compile, FSDP2 ----------------------------------------------------------------------------------------
def test_torch_compile_keeps_the_module_in_orig_mod(caplog):
    from fastml_strategy._integration import unwrap as _unwrap

    m = torch.nn.Linear(4, 4)
    compiled = torch.compile(m)  # wrapping only: nothing compiles before the first call
    assert type(compiled).__name__ == "OptimizedModule" and compiled._orig_mod is m
    assert list(_unwrap(compiled)) == [compiled, m]

    class OptimizedModule:  # what a torch that renamed _orig_mod would hand over
        pass

    with caplog.at_level(logging.WARNING, logger="fastml_strategy._integration"):
        assert len(list(_unwrap(OptimizedModule()))) == 1
    assert "no _orig_mod" in caplog.text


def test_fsdp2_internals_fastml_reads_exist():
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    from fastml_strategy.fsdp import _fsdp_api

    _fsdp_api()  # ReduceScatter, FSDPMeshInfo, HSDPMeshInfo and the FSDPModule hooks FastML needs
    assert callable(getattr(FSDPModule, "_get_fsdp_state", None))
    # _unsharded_param is read with getattr (a missing one would pass for a frozen parameter): it must
    # exist. The others fail with an AttributeError on use (and tests/fsdp trains through them).
    assert "_unsharded_param" in FSDPParam.__annotations__  # set by the first all-gather
    assert "_orig_size" in FSDPParam.__annotations__


def _fsdp_group_flags(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    from fastml_strategy.comm._peers import default_store

    m = fully_shard(torch.nn.Linear(4, 4))
    g = m._get_fsdp_state()._fsdp_param_groups[0]
    before = (g.all_reduce_grads, g.gradient_divide_factor)
    m.set_requires_all_reduce(False)
    m.set_gradient_divide_factor(3.0)
    store = default_store()
    store.set("fastml/probe", "x")
    return before, (g.all_reduce_grads, g.gradient_divide_factor), store.check(["fastml/probe"])


def test_fsdp_param_group_flags_and_the_store_fastml_reads():
    """HSDP reads FSDPParamGroup.all_reduce_grads (set_requires_all_reduce) and
    gradient_divide_factor (set_gradient_divide_factor) to honour them, and the failure channel
    uses the default group's store: renamed, HSDP would silently average or all-reduce every
    micro-batch, or wait for the timeout."""
    before, after, found = run_workers(_fsdp_group_flags, 1, timeout=90)[0]
    assert before == (True, None) and after == (False, 3.0) and found


# -- Lightning ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_lightning_internals_fastml_sets_and_calls_exist(package):
    pl = pytest.importorskip(package)
    fabric_pkg = "lightning.fabric" if package == "lightning" else "lightning_fabric"
    fabric = pytest.importorskip(fabric_pkg)
    trainer_pkg = pl.pytorch if package == "lightning" else pl

    module = trainer_pkg.LightningModule()
    assert module._device_mesh is None  # LightningModule.device_mesh reads what the strategy sets here
    module._device_mesh = mesh = object()
    assert module.device_mesh is mesh
    with pytest.raises(RuntimeError, match="not attached"):  # _fastml_trainer relies on this
        module.trainer  # noqa: B018
    assert fabric.strategies.DDPStrategy()._backward_sync_control is not None  # replaced by LocalSGD's
    # Called or read by the FastML strategies (an AttributeError at run time if renamed):
    for cls, attrs in ((trainer_pkg.strategies.DDPStrategy, ("configure_ddp",)),
                       (trainer_pkg.strategies.ModelParallelStrategy, ("_setup_distributed",)),
                       (fabric.strategies.DDPStrategy, ("setup_module", "_convert_stateful_objects_in_state")),
                       (fabric.strategies.ModelParallelStrategy, ("_setup_distributed",))):
        for attr in attrs:
            assert callable(getattr(cls, attr, None)), f"{cls.__module__}.{cls.__name__}.{attr}"
    import importlib

    for mod, name in (("init", "_materialize_distributed_module"), ("optimizer", "_optimizers_to_device")):
        assert callable(getattr(importlib.import_module(f"{fabric_pkg}.utilities.{mod}"), name))


def test_a_missing_lightning_attribute_is_logged(caplog):
    pytest.importorskip("lightning")
    from fastml_strategy.integrations.lightning._common import _set_private

    obj = types.SimpleNamespace()
    with caplog.at_level(logging.WARNING, logger="fastml_strategy.integrations.lightning"):
        _set_private(obj, "_device_mesh", 1, "self.device_mesh in configure_model will be None")
    assert obj._device_mesh == 1
    assert "has no attribute _device_mesh" in caplog.text and "device_mesh in configure_model" in caplog.text


# -- transformers.Trainer ------------------------------------------------------------------------------------------
def _tiny_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")

    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none",
                                          disable_tqdm=True, save_strategy="no")
    return transformers.Trainer(model=transformers.LlamaForCausalLM(cfg), args=args)


class _Counters:  # what FastMLCallback reads of a FastMLState: stats()
    def __init__(self):
        self.steps, self.sent, self.unc = 0, 0, 0.0

    def stats(self):
        return {"steps": self.steps, "bytes_sent": self.sent, "bytes_uncompressed": self.unc, "layers": {}}


def test_transformers_trainer_names_fastml_reads(tmp_path):
    """fastml_strategy.transformers reads Trainer.model_wrapped and Trainer.accelerator (public), puts its
    callback first in trainer.callback_handler.callbacks (so that the reporting callbacks see its
    figures), finds checkpoints as output_dir/checkpoint-N, and adds its figures to
    state.log_history[-1], which Trainer.log appends just BEFORE calling on_log. A transformers that
    changes any of these would silently drop the figures or the resume."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    import fastml_strategy.transformers as fmt

    trainer = _tiny_trainer(tmp_path)
    assert trainer.model_wrapped is trainer.model and trainer.accelerator is not None
    assert PREFIX_CHECKPOINT_DIR == "checkpoint"
    assert isinstance(trainer.callback_handler.callbacks, list)
    cb = fmt.setup(trainer, plan="int4")
    assert trainer.callback_handler.callbacks[0] is cb
    cb.state = counters = _Counters()  # as if on_train_begin had registered the hook
    counters.steps, counters.sent, counters.unc = 4, 1000, 8000.0
    trainer.state.global_step = 4
    trainer.log({"loss": 1.5})
    last = trainer.state.log_history[-1]
    assert last["step"] == 4 and last["loss"] == 1.5
    assert last["fastml/compression_ratio"] == 8.0 and last["fastml/bytes_per_step"] == 250.0
    with pytest.raises(ValueError, match="has a FastML callback already"):
        fmt.setup(trainer, plan="int4")


def test_unbound_callback_and_missing_callback_list_are_explained(tmp_path, caplog):
    import fastml_strategy.transformers as fmt

    trainer = _tiny_trainer(tmp_path)
    with pytest.raises(TypeError, match=r"fastml_strategy.transformers.setup\(trainer"):
        fmt.FastMLCallback("int4").on_train_begin(trainer.args, trainer.state, trainer.control)
    stub = types.SimpleNamespace(callback_handler=types.SimpleNamespace(), added=[])
    stub.add_callback = stub.added.append
    with caplog.at_level(logging.WARNING, logger="fastml_strategy.integrations.transformers"):
        cb = fmt.FastMLCallback("int4").bind(stub)
    assert stub.added == [cb] and "callback_handler.callbacks is not a list" in caplog.text


def test_accelerate_and_trainer_fields_the_cpu_fsdp2_switch_writes(tmp_path):
    """On CPU, setup(trainer) makes fsdp_config (version 2) shard (transformers._shard_on_cpu) by writing
    AcceleratorState().distributed_type and .fsdp_plugin, PartialState().distributed_type and
    Trainer.is_fsdp_enabled, from TrainingArguments.fsdp_plugin_args. What each must mean for that to work:
    Accelerate's is_fsdp2 (which prepare, no_sync and the checkpoint helpers branch on) is computed from the
    two state fields, both states keep their fields in shared dicts (so every Accelerator and PartialState()
    sees the switch), and Trainer keeps is_fsdp_enabled as a plain attribute. The launch in
    tests/integrations/test_transformers.py trains through it and checks that Accelerate still ignores
    the plugin on CPU (when it stops, the switch does nothing and that test says so)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", fsdp=True,
                                          fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["X"]})
    assert args.fsdp and args.fsdp_plugin_args["fsdp_version"] == 2
    assert args.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "X"
    is_fsdp2 = AcceleratorState.is_fsdp2.fget
    plugin2 = types.SimpleNamespace(fsdp_version=2)
    assert is_fsdp2(types.SimpleNamespace(distributed_type=DistributedType.FSDP, fsdp_plugin=plugin2))
    assert not is_fsdp2(types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, fsdp_plugin=plugin2))
    state = PartialState()  # one process: initialises the shared state (TrainingArguments resets it)
    assert state.__dict__ is PartialState._shared_state and "distributed_type" in state.__dict__
    trainer = _tiny_trainer(tmp_path)
    assert trainer.is_fsdp_enabled is False and "is_fsdp_enabled" in vars(trainer)
    acc_state = trainer.accelerator.state
    assert acc_state.__dict__ is AcceleratorState._shared_state and "distributed_type" in acc_state.__dict__
    assert AcceleratorState._shared_state is not PartialState._shared_state  # hence both are written
