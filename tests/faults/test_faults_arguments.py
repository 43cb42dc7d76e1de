"""Every invalid argument of every public entry point raises an error that names the argument and the
fix: one table per entry point, each row (call, exception type, the argument's name, a fix hint).

register_hook runs on 2 real gloo ranks (one spawn for the whole table): a plan error must reach
every rank alike, and nothing may hang.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _fault_helpers import mlp  # noqa: F401  (puts tests/ on sys.path for _dist)
from _dist import run_workers
from fastml_strategy import RECIPES, CodecConfig, Plan

pytestmark = pytest.mark.timeout(120)


def _raises(call, exc, *needles):
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    for needle in needles:
        assert re.search(needle, msg), f"{needle!r} not in the message: {msg}"
    return msg


# -- Plan, CodecConfig, Plan.uniform / from_recipe / from_dict / load ------------------------------------
def _bad_plan_file(tmp_path, content: str):
    p = tmp_path / "plan.json"
    p.write_text(content)
    return p


PLAN_ROWS = [
    # (id, call, exception, argument, fix)
    ("codec-unknown", lambda t: CodecConfig(codec="int3"), ValueError, "codec='int3'", "use one of"),
    ("codec-bits", lambda t: CodecConfig(codec="quantize", bits=9), ValueError, "bits is 9", "1 to 8 bits"),
    ("codec-bits-missing", lambda t: CodecConfig(codec="quantize"), ValueError, "bits is None", "1 to 8"),
    ("codec-bits-str", lambda t: CodecConfig(codec="quantize", bits="4"), ValueError, "bits must be an integer, got the string '4'", "1 to 8"),
    ("codec-topk-range", lambda t: CodecConfig(codec="topk", topk=1.5), ValueError, "topk is 1.5",
     r"e\.g\. topk=0\.01"),
    ("codec-topk-missing", lambda t: CodecConfig(codec="topk"), ValueError, "topk is not set", "give a fraction"),
    ("codec-topk-count", lambda t: CodecConfig(codec="topk", topk_count=0), ValueError, "topk_count is 0",
     "whole number >= 1"),
    ("codec-block", lambda t: CodecConfig(codec="quantize", bits=4, block_size=100), ValueError,
     "block_size is 100", "power of two"),
    ("codec-fallback", lambda t: CodecConfig(codec="topk", topk=0.1, fallback_bits=0), ValueError,
     "fallback_bits is 0", "use 1-8, or None"),
    ("codec-sr", lambda t: CodecConfig(codec="quantize", bits=4, stochastic="yes"), ValueError,
     "stochastic is 'yes'", "true or false"),
    ("codec-ef", lambda t: CodecConfig(codec="quantize", bits=4, error_feedback=None), ValueError,
     "error_feedback is None", "true or false"),
    ("plan-default", lambda t: Plan(default="int4"), ValueError, "plan.default must be a CodecConfig",
     r"Plan\.from_recipe"),
    ("plan-layers-type", lambda t: Plan(layers=5), ValueError, "plan.layers is a int", "give a dict"),
    ("plan-layers-pair", lambda t: Plan(layers=[("0.weight",)]), ValueError, "plan.layers", "give pairs"),
    ("plan-layers-value", lambda t: Plan(layers={"0.weight": "int8"}), ValueError,
     r"plan.layers\['0.weight'\] must be a CodecConfig", r"RECIPES\['int8'\]"),
    ("plan-layers-regex", lambda t: Plan(layers={"re:(": RECIPES["int8"]}), ValueError,
     r"plan.layers\['re:\('\]: invalid regular expression", "fix the pattern"),
    ("plan-min-numel", lambda t: Plan(min_numel=-1), ValueError, "plan.min_numel is -1", "whole number >= 0"),
    ("plan-seed", lambda t: Plan(seed=1.5), ValueError, "plan.seed must be an integer, got 1.5", "whole number"),
    ("plan-name", lambda t: Plan(name=3), ValueError, "plan.name is 3", "use a string"),
    ("uniform-nothing", lambda t: Plan.uniform(), ValueError, "Plan.uniform", "give bits=1..8"),
    ("uniform-bits", lambda t: Plan.uniform(bits=0), ValueError, "bits is 0", "1 to 8"),
    ("uniform-topk", lambda t: Plan.uniform(topk=0.0), ValueError, "topk is 0.0", "kept fraction"),
    ("uniform-codec", lambda t: Plan.uniform(codec="fp7"), ValueError, "codec='fp7'", "use one of"),
    ("uniform-block", lambda t: Plan.uniform(bits=4, block_size=3), ValueError, "block_size is 3", "power of two"),
    ("uniform-min-numel", lambda t: Plan.uniform(bits=4, min_numel=-8), ValueError, "min_numel is -8", ">= 0"),
    ("recipe-unknown", lambda t: Plan.from_recipe("int5"), ValueError, "unknown recipe 'int5'", "use one of"),
    ("recipe-type", lambda t: Plan.from_recipe(["int4"]), ValueError, r"unknown recipe \['int4'\]", "use one of"),
    ("recipe-override", lambda t: Plan.from_recipe("int4", bits=3), ValueError, r"override\(s\) \['bits'\]",
     r"Plan\.uniform"),
    ("recipe-min-numel", lambda t: Plan.from_recipe("int4", min_numel=-1), ValueError, "min_numel is -1", ">= 0"),
    ("dict-type", lambda t: Plan.from_dict([1, 2]), ValueError, "a plan is a JSON object", "got list"),
    ("dict-version", lambda t: Plan.from_dict({"default": {"codec": "int4"}}), ValueError,
     "missing 'format_version'", "format_version 1"),
    ("dict-version-new", lambda t: Plan.from_dict({"format_version": 2}), ValueError, "format_version 2",
     "upgrade FastML"),
    ("dict-unknown-field", lambda t: Plan.from_dict({"format_version": 1, "defualt": {}}), ValueError,
     r"unknown field\(s\) \['defualt'\]", "known fields are"),
    ("dict-codec-field", lambda t: Plan.from_dict({"format_version": 1, "default": {"codec": "quantize",
                                                                                    "bitz": 4}}),
     ValueError, r"plan.default: unknown field\(s\) \['bitz'\]", "known fields are"),
    ("dict-layer-bits", lambda t: Plan.from_dict({"format_version": 1, "layers": {
        "fc.weight": {"codec": "quantize", "bits": 12}}}), ValueError,
     r"plan.layers\['fc.weight'\]: bits is 12", "1 to 8"),
    ("load-missing", lambda t: Plan.load(t / "nope.json"), ValueError, "does not exist", "give a recipe name"),
    ("load-directory", lambda t: Plan.load(t), ValueError, "is a directory", "plan JSON file"),
    ("load-json", lambda t: Plan.load(_bad_plan_file(t, '{"format_version": 1,')), ValueError,
     "is not valid JSON", "re-create it"),
    ("load-field", lambda t: Plan.load(_bad_plan_file(t, json.dumps({"format_version": 1, "min_numel": "x"}))),
     ValueError, r"plan file .*min_numel must be an integer, got the string 'x'", "whole number"),
]


@pytest.mark.parametrize("row", PLAN_ROWS, ids=[r[0] for r in PLAN_ROWS])
def test_plan_arguments(tmp_path, row):
    _, call, exc, arg, fix = row
    _raises(lambda: call(tmp_path), exc, arg, fix)


def test_resolve_plan_arguments(monkeypatch):
    from fastml_strategy.config import resolve_plan

    _raises(lambda: resolve_plan(5), ValueError, "plan must be a Plan, a recipe name", "not int")
    _raises(lambda: resolve_plan("int5"), ValueError, "plan 'int5' is neither a recipe", "pass one of those")
    monkeypatch.setenv("FASTML_PLAN", "int9")
    _raises(lambda: resolve_plan(None), ValueError, "FASTML_PLAN='int9' is not a usable plan", "int9")


# -- register_hook (2 real ranks) ------------------------------------------------------------------------------
def _register_cases(rank, world_size, tmpdir):
    import fastml_strategy as fm

    def ddp():
        return DDP(mlp(), bucket_cap_mb=0.02)

    hooked = ddp()
    fm.register_hook(hooked, plan="int4")
    cases = {
        "not-ddp": lambda: fm.register_hook(mlp(), plan="int4"),
        "check-negative": lambda: fm.register_hook(ddp(), check_replicas_every=-1),
        "check-float": lambda: fm.register_hook(ddp(), check_replicas_every=1.5),
        "check-bool": lambda: fm.register_hook(ddp(), check_replicas_every=True),
        "stats-negative": lambda: fm.register_hook(ddp(), layer_stats_every=-2),
        "group": lambda: fm.register_hook(ddp(), process_group="world"),
        "twice": lambda: fm.register_hook(hooked, plan="int4"),
        "plan-type": lambda: fm.register_hook(ddp(), plan=5),
        "plan-list": lambda: fm.register_hook(ddp(), plan=["int4"]),
        "plan-recipe": lambda: fm.register_hook(ddp(), plan="int5"),
        "plan-dict": lambda: fm.register_hook(ddp(), plan={"format_version": 1,
                                                           "default": {"codec": "quantize", "bits": 9}}),
        "plan-param": lambda: fm.register_hook(ddp(), plan=fm.Plan.from_recipe("int4").with_layers(
            {"encoder.weight": fm.RECIPES["int8"]})),
        "plan-file": lambda: fm.register_hook(ddp(), plan=f"{tmpdir}/missing.json"),
        "plan-one-rank": lambda: fm.register_hook(ddp(), plan="int4" if rank == 0 else "int5"),
        "plan-differs": lambda: fm.register_hook(ddp(), plan="int4" if rank == 0 else "int8"),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = ("no error", "")
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e))
    return out


REGISTER_ROWS = {
    # id: (exception, argument, fix)
    "not-ddp": ("TypeError", "model is a Sequential, not a DistributedDataParallel", "wrap it first"),
    "check-negative": ("ValueError", "check_replicas_every=-1", "whole number >= 0"),
    "check-float": ("ValueError", "check_replicas_every=1.5", "whole number >= 0"),
    "check-bool": ("ValueError", "check_replicas_every=True", "whole number >= 0"),
    "stats-negative": ("ValueError", "layer_stats_every=-2", "0 turns it off"),
    "group": ("TypeError", "process_group is a str", "dist.new_group"),
    "twice": ("ValueError", "already has a comm hook", "register FastML once per DDP model"),
    "plan-type": ("ValueError", "plan must be a Plan", "not int"),
    "plan-list": ("ValueError", "plan must be a Plan", "not list"),
    "plan-recipe": ("ValueError", "plan 'int5' is neither a recipe", "pass one of those"),
    "plan-dict": ("ValueError", "plan.default: bits is 9", "1 to 8 bits"),
    "plan-param": ("ValueError", r"\['encoder.weight'\].*no such parameter", "use names from"),
    "plan-file": ("ValueError", "missing.json' does not exist", "give a recipe name"),
    "plan-one-rank": ("ValueError", r"rank\(s\) \[1\].*'int5'", "pass one of those"),
    "plan-differs": ("ValueError", "ranks hold different plans", "give every rank the same plan"),
}


def test_register_hook_arguments(tmp_path):
    results = run_workers(_register_cases, 2, str(tmp_path), timeout=90, pg_timeout=30)
    for name, (exc, arg, fix) in REGISTER_ROWS.items():
        kinds = {r[name] for r in results}
        assert len(kinds) == 1, f"{name}: the ranks disagree: {kinds}"  # same error on every rank
        got_type, msg = results[0][name]
        assert got_type == exc, f"{name}: {got_type}: {msg}"
        assert re.search(arg, msg) and re.search(fix, msg), f"{name}: {msg}"
    assert set(results[0]) == set(REGISTER_ROWS)


# -- Lightning and Fabric strategies ------------------------------------------------------------------------------
def _lightning_rows():
    from fastml_strategy import lightning as L

    return [
        ("hook-kwarg", lambda: L.FastMLStrategy(ddp_comm_hook=lambda s, b: None), ValueError,
         r"does not take \['ddp_comm_hook'\]", "remove them"),
        ("averaging", lambda: L.FastMLStrategy(model_averaging_period=4), ValueError,
         "model_averaging_period", "remove them"),
        ("check", lambda: L.FastMLStrategy(check_replicas_every=-1), ValueError,
         "check_replicas_every=-1", "whole number >= 0"),
        ("log-every", lambda: L.FastMLStrategy(log_every_n_steps=-1), ValueError,
         "log_every_n_steps=-1", "whole number >= 0"),
        ("layer-every", lambda: L.FastMLStrategy(layer_stats_every="x"), ValueError,
         "layer_stats_every='x'", "whole number >= 0"),
        ("plan", lambda: L.FastMLStrategy(plan="int5"), ValueError, "'int5'", "use one of|pass one of"),
        ("plan-dict", lambda: L.FastMLStrategy(plan={"format_version": 1, "min_numel": -1}), ValueError,
         "min_numel is -1", ">= 0"),
        ("fabric-check", lambda: L.FastMLFabricStrategy(check_replicas_every=2.5), ValueError,
         "check_replicas_every=2.5", "whole number >= 0"),
        ("fabric-stats", lambda: L.FastMLFabricStrategy(layer_stats_every=-1), ValueError,
         "layer_stats_every=-1", "whole number"),
        ("fabric-hook", lambda: L.FastMLFabricStrategy(ddp_comm_hook=lambda s, b: None), ValueError,
         "ddp_comm_hook", "remove them"),
        ("package", lambda: L.strategy_class("keras"), ValueError, "package 'keras'", "use one of"),
    ]


def test_lightning_strategy_arguments(monkeypatch):
    pytest.importorskip("lightning")
    monkeypatch.delenv("FASTML_PLAN", raising=False)
    monkeypatch.delenv("FASTML_CHECK_REPLICAS_EVERY", raising=False)
    for name, call, exc, arg, fix in _lightning_rows():
        try:
            _raises(call, exc, arg, fix)
        except BaseException as e:
            raise AssertionError(f"row {name}: {e}") from e
    monkeypatch.setenv("FASTML_PLAN", "int9")
    from fastml_strategy.lightning import FastMLStrategy

    _raises(lambda: FastMLStrategy(), ValueError, "FASTML_PLAN='int9'", "use one of|pass one of")
    monkeypatch.setenv("FASTML_PLAN", "int4")
    monkeypatch.setenv("FASTML_CHECK_REPLICAS_EVERY", "often")
    _raises(lambda: FastMLStrategy(), ValueError, "FASTML_CHECK_REPLICAS_EVERY='often'", "set it to N >= 1")


# -- Accelerate --------------------------------------------------------------------------------------------------
def test_accelerate_arguments(monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    import fastml_strategy.accelerate as fa

    for var in ("FASTML_PLAN", "FASTML_CHECK_REPLICAS_EVERY", "FASTML_LAYER_STATS_EVERY"):
        monkeypatch.delenv(var, raising=False)
    acc = Accelerator(cpu=True)
    model = acc.prepare(torch.nn.Linear(64, 64))
    rows = [
        ("plan", lambda: fa.setup(acc, model, plan="int5"), ValueError, "'int5'", "use one of|pass one of"),
        ("plan-param", lambda: fa.setup(acc, model, Plan.from_recipe("int4").with_layers(
            {"encoder.weight": RECIPES["int8"]})), ValueError, "encoder.weight", "use names from"),
        ("check", lambda: fa.setup(acc, model, check_replicas_every=-1), ValueError,
         "check_replicas_every=-1", "whole number >= 0"),
        ("stats", lambda: fa.setup(acc, model, layer_stats_every=1.5), ValueError,
         "layer_stats_every=1.5", "whole number >= 0"),
        ("prepare-models", lambda: fa.prepare(acc, torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)), ValueError,
         "expected exactly one model", "fastml_strategy.accelerate.setup"),
    ]
    for name, call, exc, arg, fix in rows:
        try:
            _raises(call, exc, arg, fix)
        except BaseException as e:
            raise AssertionError(f"row {name}: {e}") from e
    monkeypatch.setenv("FASTML_PLAN", "int9")
    _raises(lambda: fa.setup(acc, model), ValueError, "FASTML_PLAN='int9' is not a usable plan", "pass one of those")
    monkeypatch.setenv("FASTML_PLAN", "int4")
    monkeypatch.setenv("FASTML_CHECK_REPLICAS_EVERY", "x")
    _raises(lambda: fa.setup(acc, model), ValueError, "FASTML_CHECK_REPLICAS_EVERY='x'", "set it to N >= 1")


# -- the fastml-autotune command -----------------------------------------------------------------------------------
def _autotune_rows(tmp):
    from pathlib import Path

    target = f"{Path(__file__).resolve().parents[1] / 'autotune' / 'tiny_workload.py'}:workload"
    (tmp / "afile").write_text("x")
    return [
        # (id, argv, the argument named, a fix hint)
        ("target-missing", [str(tmp / "missing.py") + ":workload"], "missing.py", "does not exist"),
        ("target-factory", [target.replace(":workload", ":nope")], "'nope'", "."),
        ("world-size", [target, "--world-size", "0"], "world.size", "whole number >= 1|give"),
        ("trials", [target, "--trials", "0"], "trials", "whole number >= 1|give"),
        ("steps", [target, "--calibration-steps", "-5"], "calibration.steps", "whole number >= 10|give"),
        ("min-numel", [target, "--min-numel", "-1"], "min.numel", "give|use"),
        ("accuracy-loss", [target, "--max-accuracy-loss", "-0.5"], "--max-accuracy-loss is -0.5", "give"),
        ("target-steps", [target, "--target-steps", "0"], "--target-steps is 0", "give"),
        ("link", [target, "--world-size", "2", "--link", "fast"], "fast", "give|use|e\\.g\\."),
        ("hardware", [target, "--hardware", str(tmp / "nope.csv")], "nope.csv", "does not exist"),
        ("storage", [target, "--storage", "sqlite:////nonexistent-dir-fastml/x.db"], "nonexistent-dir-fastml",
         "unreachable"),
        ("out-file", [target, "--out", str(tmp / "afile")], "afile", "give a folder"),
        ("sharding", [target, "--sharding", "zero"], "--sharding 'zero'", "use ddp"),
        ("ranks-per-node", [target, "--sharding", "hsdp", "--world-size", "4", "--ranks-per-node", "3"],
         "--ranks-per-node 3", "divisor"),
    ]


def test_autotune_cli_arguments(tmp_path, capsys):
    """Each bad input: exit status 2 and one line naming it, before anything is profiled or written."""
    pytest.importorskip("optuna")
    from fastml_strategy.autotune.cli import main

    for name, argv, arg, fix in _autotune_rows(tmp_path):
        out = [] if "--out" in argv else ["--out", str(tmp_path / f"out-{name}")]
        code = main([*argv, *out, "--quiet"])
        err = capsys.readouterr().err.strip()
        assert code == 2, f"{name}: exit {code}: {err}"
        assert err.startswith("fastml-autotune: error: ") and len(err.splitlines()) == 1, f"{name}: {err}"
        assert re.search(arg, err) and re.search(fix, err), f"{name}: {err}"
        assert not (tmp_path / f"out-{name}").exists(), f"{name}: wrote outputs despite the error"
    with pytest.raises(SystemExit) as e:  # argparse: an unknown option is named too
        main(["x.py:w", "--no-such-option"])
    assert e.value.code == 2 and "--no-such-option" in capsys.readouterr().err
