"""In-process checks of the adapters' arguments and errors (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from fastml_strategy import Plan


def test_strategy_rejects_comm_hook_arguments_and_bad_settings(monkeypatch):
    from fastml_strategy.lightning import FastMLFabricStrategy, FastMLStrategy

    with pytest.raises(ValueError, match="registers FastML's own DDP comm hook.*ddp_comm_hook"):
        FastMLStrategy(ddp_comm_hook=lambda s, b: None)
    with pytest.raises(ValueError, match="model_averaging_period"):
        FastMLStrategy(model_averaging_period=4)
    with pytest.raises(ValueError, match="check_replicas_every=-1"):
        FastMLStrategy(check_replicas_every=-1)
    monkeypatch.setenv("FASTML_CHECK_REPLICAS_EVERY", "often")
    with pytest.raises(ValueError, match="FASTML_CHECK_REPLICAS_EVERY='often' is not a whole number"):
        FastMLFabricStrategy()
    monkeypatch.delenv("FASTML_CHECK_REPLICAS_EVERY")
    with pytest.raises(ValueError, match="unknown recipe|neither a recipe"):
        FastMLStrategy(plan="int5")  # an explicit plan: the message does not blame FASTML_PLAN
    monkeypatch.setenv("FASTML_PLAN", "int2")
    s = FastMLStrategy(static_graph=True, log_every_n_steps=5)
    # gradient_as_bucket_view defaults to True (DDP's copies into and out of its buckets are saved)
    assert s.plan == Plan.from_recipe("int2")
    assert s._ddp_kwargs == {"static_graph": True, "gradient_as_bucket_view": True}
    assert FastMLStrategy(gradient_as_bucket_view=False)._ddp_kwargs == {"gradient_as_bucket_view": False}
    assert FastMLFabricStrategy()._ddp_kwargs == {"gradient_as_bucket_view": True}
    assert FastMLFabricStrategy(gradient_as_bucket_view=False)._ddp_kwargs == {"gradient_as_bucket_view": False}
    assert FastMLStrategy(plan=Plan.uniform(bits=3)).plan.default.bits == 3  # the argument wins


def test_layer_stats_every_is_one_setting_and_the_old_keyword_still_works(monkeypatch):
    # One name everywhere: the keyword layer_stats_every and the variable FASTML_LAYER_STATS_EVERY; the
    # Trainer strategies' old keyword layer_errors_every_n_steps warns and still sets it.
    from fastml_strategy.lightning import (FastMLFabricStrategy, FastMLFSDPFabricStrategy, FastMLFSDPStrategy,
                                           FastMLLocalSGDFabricStrategy, FastMLLocalSGDStrategy, FastMLStrategy)

    monkeypatch.delenv("FASTML_LAYER_STATS_EVERY", raising=False)
    monkeypatch.setenv("FASTML_PLAN", "int4")
    # The Trainer strategies log each layer's error every N optimizer steps (_fastml_layer_log_every); the
    # Fabric ones log nothing and measure every N steps (_fastml_layer_stats_every).
    trainer = (FastMLStrategy, FastMLFSDPStrategy, FastMLLocalSGDStrategy)
    fabric = (FastMLFabricStrategy, FastMLFSDPFabricStrategy, FastMLLocalSGDFabricStrategy)
    for cls in trainer:
        assert cls(layer_stats_every=7)._fastml_layer_log_every == 7
        assert cls()._fastml_layer_log_every is None  # ten times the logging interval, decided at fit()
        with pytest.warns(FutureWarning, match=r"layer_errors_every_n_steps= is deprecated.*layer_stats_every=3"):
            s = cls(layer_errors_every_n_steps=3)
        assert s._fastml_layer_log_every == 3
        assert not hasattr(s, "_fastml_layer_stats_every")
        with pytest.raises(TypeError, match="pass only layer_stats_every="):
            cls(layer_stats_every=3, layer_errors_every_n_steps=3)
    assert FastMLFabricStrategy()._fastml_layer_stats_every == 10
    assert FastMLFSDPFabricStrategy()._fastml_layer_stats_every == 10
    assert FastMLLocalSGDFabricStrategy()._fastml_layer_stats_every == 1  # every outer step
    assert not hasattr(FastMLFabricStrategy(), "_fastml_layer_log_every")
    monkeypatch.setenv("FASTML_LAYER_STATS_EVERY", "4")
    for cls in trainer + fabric:
        attr = "_fastml_layer_log_every" if cls in trainer else "_fastml_layer_stats_every"
        assert getattr(cls(), attr) == 4, cls  # the variable, when the argument is not given
        assert getattr(cls(layer_stats_every=0), attr) == 0, cls  # the argument wins
    monkeypatch.setenv("FASTML_LAYER_STATS_EVERY", "often")
    with pytest.raises(ValueError, match="FASTML_LAYER_STATS_EVERY='often' is not a whole number"):
        FastMLStrategy()


def test_localsgd_variables_are_checked_by_type_and_name_the_variable(monkeypatch):
    from fastml_strategy.localsgd import resolve_settings

    monkeypatch.setenv("FASTML_LOCALSGD_FRAGMENTS", "2")
    monkeypatch.setenv("FASTML_LOCALSGD_OUTER_LR", "0.5")
    monkeypatch.setenv("FASTML_LOCALSGD_OUTER", "sgd")
    _, settings = resolve_settings("int4", outer_momentum=0.0)
    assert (settings["fragments"], settings["outer_lr"], settings["outer"]) == (2, 0.5, "sgd")
    for var, raw, message in (("FASTML_LOCALSGD_FRAGMENTS", "0", "FASTML_LOCALSGD_FRAGMENTS='0'; set it to a whole "
                                                                 "number >= 1, or unset it"),
                              ("FASTML_LOCALSGD_DELAY", "1.5", "FASTML_LOCALSGD_DELAY='1.5' is not a whole number"),
                              ("FASTML_LOCALSGD_OUTER_LR", "fast", "FASTML_LOCALSGD_OUTER_LR='fast' is not a number")):
        monkeypatch.setenv(var, raw)
        with pytest.raises(ValueError, match=message):
            resolve_settings("int4")
        monkeypatch.delenv(var)
    # blanks are ignored and whitespace around a value is not part of it
    monkeypatch.setenv("FASTML_LOCALSGD_EVERY", "  ")
    monkeypatch.setenv("FASTML_LOCALSGD_DELAY", " 3 ")
    monkeypatch.setenv("FASTML_LOCALSGD_OUTER", " ")
    assert resolve_settings("int4")[1] == {
        "every": 50, "fragments": 1, "delay": 3, "outer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}


def test_compression_stats_before_fit_says_when_they_exist():
    from fastml_strategy.lightning import FastMLStrategy

    with pytest.raises(RuntimeError, match="during or after fit"):
        FastMLStrategy(plan="int4").compression_stats()


def test_strategy_class_names_the_supported_packages():
    from fastml_strategy import lightning

    with pytest.raises(ValueError, match="lightning.pytorch"):
        lightning.strategy_class("keras")
    assert lightning.strategy_class("lightning.fabric") is lightning.FastMLFabricStrategy
    with pytest.raises(AttributeError):
        lightning.NoSuchThing  # noqa: B018


def test_each_flavour_gets_its_own_class_named_and_documented():
    # One class statement per mode and framework kind, run on each flavour's base class: the classes are
    # distinct per flavour, published in fastml_strategy.lightning under their names, with the docstring
    # of their class statement.
    import pickle

    from fastml_strategy import lightning

    for (package, name), cls_name in lightning.registry._CLASS_NAMES.items():
        cls = lightning.strategy_class(package, name)
        assert cls is getattr(lightning, cls_name) and cls is lightning.strategy_class(package, name)
        assert repr(cls) == f"<class 'fastml_strategy.lightning.{cls_name}'>"
        assert cls.__qualname__ == cls.__name__ == cls_name
        assert cls._fastml_package == package and cls.__bases__[1] is cls._fastml_base
        assert cls._fastml_base.__module__.startswith(f"{package}.strategies"), cls._fastml_base
        assert "Args:" in cls.__doc__ and "FastML" in cls.__doc__, cls_name
        assert pickle.loads(pickle.dumps(cls)) is cls  # found again by name through the module
    assert lightning.FastMLStrategy is not lightning.strategy_class("pytorch_lightning")


def test_accelerate_setup_in_one_process_is_a_no_op_but_checks_the_plan(monkeypatch):
    from accelerate import Accelerator

    import fastml_strategy.accelerate as fa

    acc = Accelerator(cpu=True)
    model, opt = acc.prepare(torch.nn.Linear(64, 64), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    assert fa.setup(acc, model) is None
    assert acc._custom_objects == []  # nothing registered for checkpointing
    bad = Plan.from_recipe("int4").with_layers({"encoder.weight": Plan.from_recipe("int8").default})
    with pytest.raises(ValueError, match=r"\['encoder.weight'\].*no such parameter"):
        fa.setup(acc, model, bad)
    monkeypatch.setenv("FASTML_PLAN", "int9")
    with pytest.raises(ValueError, match="FASTML_PLAN='int9' is not a usable plan"):
        fa.setup(acc, model)
    monkeypatch.setenv("FASTML_PLAN", "int4")
    monkeypatch.setenv("FASTML_LAYER_STATS_EVERY", "-3")
    with pytest.raises(ValueError, match="FASTML_LAYER_STATS_EVERY='-3'; set it to a whole number >= 0"):
        fa.setup(acc, model)


def test_accelerate_setup_in_one_process_takes_a_tied_weights_other_name(recwarn):
    """The check every adapter shares (fastml_strategy.comm._distributed.checked_plan): a plan naming a tied
    weight's other name applies to the weight, with the note register_hook gives, in accelerate.setup and
    accelerate.local_sgd in one process as in register_hook; a name the model lacks is still refused."""
    from accelerate import Accelerator

    import fastml_strategy.accelerate as fa

    class Tied(torch.nn.Module):  # head.weight is emb.weight, as GPT-2's lm_head.weight is transformer.wte.weight
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(64, 64)
            self.head = torch.nn.Linear(64, 64, bias=False)
            self.head.weight = self.emb.weight

    acc = Accelerator(cpu=True)
    model = acc.prepare(Tied())
    plan = Plan.from_recipe("int4").with_layers({"head.weight": Plan.from_recipe("int8").default})
    assert fa.setup(acc, model, plan) is None
    assert fa.local_sgd(acc, model, plan=plan, every=4) is None
    notes = [str(w.message) for w in recwarn if "another name of 'emb.weight'" in str(w.message)]
    assert len(notes) == 2, [str(w.message) for w in recwarn]
    with pytest.raises(ValueError, match=r"\['head.bias'\].*no such parameter"):
        fa.setup(acc, model, plan.with_layers({"head.bias": Plan.from_recipe("int8").default}))


def test_fsdp_strategies_check_their_arguments_before_any_process_starts(monkeypatch):
    import functools

    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    from fastml_strategy.lightning import FastMLFSDPFabricStrategy, FastMLFSDPStrategy

    with pytest.raises(ValueError, match="replicate_size=0"):
        FastMLFSDPStrategy(replicate_size=0)
    with pytest.raises(ValueError, match="give one of them"):
        FastMLFSDPStrategy(hybrid=True, replicate_size=2)
    with pytest.raises(ValueError, match="shard_plan compresses HSDP's intra-node reduce-scatter"):
        FastMLFSDPFabricStrategy(shard_plan="int8")
    with pytest.raises(ValueError, match="builds its own data-parallel device mesh.*tensor_parallel_size"):
        FastMLFSDPStrategy(tensor_parallel_size=2)
    with pytest.raises(ValueError, match="all_gather_bits=16"):
        FastMLFSDPFabricStrategy(all_gather_bits=16)
    with pytest.raises(ValueError, match="must not hold 'mesh'"):
        FastMLFSDPStrategy(fully_shard_kwargs={"mesh": None})
    with pytest.raises(TypeError, match="FSDP1 wrap policy"):
        FastMLFSDPStrategy(auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
    with pytest.raises(TypeError, match="cannot be called with one module"):
        FastMLFSDPFabricStrategy(auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1))
    with pytest.raises(TypeError, match="not a set of torch.nn.Module classes"):
        FastMLFSDPStrategy(auto_wrap_policy={int})
    with pytest.raises(TypeError, match="parallelize_fn"):
        FastMLFSDPFabricStrategy(parallelize_fn="fully_shard")
    monkeypatch.setenv("FASTML_PLAN", "int5")
    with pytest.raises(ValueError, match="FASTML_PLAN='int5' is not a usable plan"):
        FastMLFSDPStrategy()
    monkeypatch.setenv("FASTML_PLAN", "int2")
    assert FastMLFSDPStrategy().plan == Plan.from_recipe("int2")
    with pytest.raises(RuntimeError, match="during or after fit"):
        FastMLFSDPStrategy().compression_stats()


def test_fsdp_wrap_policies_pick_the_modules_they_name():
    from fastml_strategy.integrations.lightning.fsdp import _wrap_policy

    big, small, act = torch.nn.Linear(1024, 1024), torch.nn.Linear(64, 64), torch.nn.ReLU()
    default = _wrap_policy(None)  # own parameters >= 2**20 elements
    assert default(big) and not default(small) and not default(act)
    assert not default(torch.nn.Sequential(big))  # a container holds no parameters of its own
    by_class = _wrap_policy({torch.nn.Linear})
    assert by_class(big) and by_class(small) and not by_class(act)
    assert _wrap_policy(64 * 64)(small) and not _wrap_policy(64 * 64 + 65)(small)
    assert _wrap_policy(lambda m: m is act)(act)


def test_lightning_strategies_tell_register_hook_their_ranks_per_node(monkeypatch):
    # Lightning's own launcher sets LOCAL_RANK/NODE_RANK/WORLD_SIZE but no LOCAL_WORLD_SIZE: the
    # strategy passes its devices per node; a launcher's or the user's variable wins (None: detect).
    from types import SimpleNamespace

    from fastml_strategy.integrations.lightning._common import _ranks_per_node

    for var in ("FASTML_RANKS_PER_NODE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE",
                "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "1")
    assert _ranks_per_node(SimpleNamespace(num_processes=4, num_nodes=2)) == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun
    assert _ranks_per_node(SimpleNamespace(num_processes=4, num_nodes=2)) is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("FASTML_RANKS_PER_NODE", "1")  # the user asks for the flat all-reduce
    assert _ranks_per_node(SimpleNamespace(num_processes=4, num_nodes=2)) is None


def test_one_metrics_function_keeps_each_frameworks_keys():
    """Lightning and the Trainer log the same figures under their own, unchanged keys."""
    from fastml_strategy._integration import LIGHTNING_KEYS, TRAINER_KEYS, counters, metrics

    layers = {"a.weight": {"codec": "int4", "numel": 10, "rel_error": 0.25},
              "b.bias": {"codec": "fp32", "numel": 2, "rel_error": 0.0},  # exact: not logged
              "c.weight": {"codec": "int4", "numel": 10, "rel_error": float("nan")}}  # not measured yet
    stats = {"steps": 10, "bytes_sent": 1000, "bytes_uncompressed": 8000, "compression_ratio": 8.0,
             "residual_bytes": 64, "layers": layers}
    assert counters(stats) == (10, 1000, 8000.0, 1000, 8000.0)
    assert metrics(stats, LIGHTNING_KEYS, since=(6, 600), layers=True) == {
        "fastml/compression_ratio": 8.0, "fastml/bytes_sent_per_step": 100.0, "fastml/residual_bytes": 64.0,
        "fastml/rel_error/a.weight": 0.25}
    assert metrics(stats, LIGHTNING_KEYS, since=(10, 1000), layers=False) == {  # no step since the mark
        "fastml/compression_ratio": 8.0, "fastml/residual_bytes": 64.0}
    assert metrics(stats, TRAINER_KEYS, since=(5, 500, 2000.0)) == {
        "fastml/compression_ratio": 12.0, "fastml/bytes_per_step": 100.0, "fastml/error/a.weight": 0.25}
    local = {"inner_steps": 4, "bytes_sent": 0, "bytes_uncompressed": 0, "compression_ratio": 7.5,
             "ratio_vs_ddp": 30.0}
    assert metrics(local, TRAINER_KEYS, since=(2, 0, 0.0)) == {
        "fastml/compression_ratio": 7.5, "fastml/bytes_per_step": 0.0, "fastml/ratio_vs_ddp": 30.0}
    # the hierarchical path: the interval's ratio is the cross-machine one, as stats()'s headline;
    # bytes per step stay this rank's bytes in all
    hier = {"steps": 10, "bytes_sent": 3000, "bytes_uncompressed": 9000, "bytes_sent_inter": 1000,
            "bytes_sent_intra": 2000, "bytes_uncompressed_inter": 7000, "compression_ratio": 7.0}
    mark = counters({**hier, "steps": 5, "bytes_sent": 1500, "bytes_sent_inter": 500,
                     "bytes_sent_intra": 1000, "bytes_uncompressed_inter": 3500})
    assert metrics(hier, TRAINER_KEYS, since=mark, layers=False) == {
        "fastml/compression_ratio": 7.0, "fastml/bytes_per_step": 300.0}


def test_the_settings_table_names_every_variable_and_default(monkeypatch):
    from fastml_strategy._integration import SETTINGS, setting
    from fastml_strategy.config import LocalSteps

    assert SETTINGS["layer_stats_every"].variable == "FASTML_LAYER_STATS_EVERY"
    assert setting("layer_stats_every", None, owner="X") == 10
    assert setting("layer_stats_every", None, owner="X", localsgd=True) == 1
    assert setting("check_replicas_every", None, owner="X") == 0
    monkeypatch.setenv("FASTML_LAYER_STATS_EVERY", "3")
    assert setting("layer_stats_every", None, owner="X", localsgd=True) == 3
    assert setting("layer_stats_every", 5, owner="X") == 5
    with pytest.raises(ValueError, match="X: layer_stats_every=-1"):
        setting("layer_stats_every", -1, owner="X")
    assert {n: SETTINGS[n].localsgd_default for n in LocalSteps().kwargs()} == LocalSteps().kwargs()
    assert SETTINGS["every"].variable == "FASTML_LOCALSGD_EVERY"
    # the table's least values are LocalSteps' own (every >= 1, delay >= 0), and the table's resolver is
    # what LocalSGD's public resolve_settings runs
    from fastml_strategy._integration import resolve_local_steps
    from fastml_strategy.localsgd import resolve_settings

    assert (SETTINGS["every"].minimum, SETTINGS["fragments"].minimum, SETTINGS["delay"].minimum) == (1, 1, 0)
    for name, least in (("every", 1), ("delay", 0)):
        with pytest.raises(ValueError, match=f"{name}=-1; use a whole number >= {least}"):
            LocalSteps(**{name: -1})
    monkeypatch.setenv("FASTML_LOCALSGD_EVERY", "7")
    assert resolve_local_steps("int4")[1] == resolve_settings("int4")[1] == {**LocalSteps().kwargs(), "every": 7}
    with pytest.raises(KeyError, match="resolve_settings"):
        setting("every", None, owner="X")  # LocalSGD's settings are resolved together, with the plan
