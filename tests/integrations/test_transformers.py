"""fastml_strategy.transformers on real processes: ONE torchrun launch (2 CPU ranks) in which
tests/integrations/jobs/transformers_job.py trains a tiny Llama (built from a config) through
transformers.Trainer and TRL's SFTTrainer under every contract of the integration (torch_compile=True and
FSDP2 through fsdp/fsdp_config included), then the assertions below read what each rank found. One launch
keeps the suite's added time to about a minute on 2 loaded cores."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from _launch import ROOT, rank_files, run, run_ranks, torchrun

# find_spec, not importorskip: importing TRL and transformers at collection would cost every run ~20 s
_MISSING = [m for m in ("transformers", "peft", "trl") if importlib.util.find_spec(m) is None]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(_MISSING), reason=f"needs {_MISSING}: pip install -e '.[transformers]'")]
JOB = str(ROOT / "tests" / "integrations" / "jobs" / "transformers_job.py")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "out"
    res = run(torchrun(2) + [JOB, str(out)], timeout=420).check()
    r0, r1 = rank_files(out)
    return r0, r1, res


def test_plan_none_through_the_integration_equals_plain_trainer_ddp(ranks):
    r0, r1, _ = ranks
    for r in (r0, r1):
        assert r["plain"]["global_step"] == r["none"]["global_step"] == r["none"]["fastml_step"] == 10
        assert r["none"]["wrapped"] == "DistributedDataParallel"  # the hook went on Trainer's DDP model
        assert r["none_max_abs_diff"] <= 1e-6, r["none_max_abs_diff"]
        assert r["none_vs_init_max_abs_diff"] > 1e-3  # and the comparison is not of two untrained models
        assert r["none"]["logged"]["fastml/compression_ratio"] == 1.0


def test_int4_keeps_replicas_identical_loss_falls_and_figures_reach_log_history(ranks):
    r0, r1, _ = ranks
    assert r0["int4"]["digest"] == r1["int4"]["digest"]
    assert r0["int4"]["digest"] != r0["plain"]["digest"]  # it did compress
    plain, int4 = r0["plain"]["losses"], r0["int4"]["losses"]
    assert int4[-1] < int4[0] - 0.5, int4  # the loss falls...
    assert abs(int4[-1] - plain[-1]) < 0.15 * (plain[0] - plain[-1]), (plain, int4)  # ...as uncompressed does
    logged = r0["int4"]["logged"]  # trainer.state.log_history[-1], at the logging interval
    assert logged["step"] == 10 and 7.0 < logged["fastml/compression_ratio"] < 8.0
    assert logged["fastml/bytes_per_step"] > 0
    errors = {k[len("fastml/error/"):]: v for k, v in logged.items() if k.startswith("fastml/error/")}
    assert "model.layers.0.mlp.up_proj.weight" in errors and 0 < errors["model.layers.0.mlp.up_proj.weight"] < 0.5
    assert "model.norm.weight" not in errors  # exact (uncompressed) layers report no error


def test_layer_errors_are_logged_once_per_measurement_not_repeated_in_between(ranks):
    """layer_stats_every=4 measures at optimizer steps 1, 5 and 9; with logging_steps=2 the errors appear in
    the logs of steps 2, 6 and 10 and in none of 4 and 8, where they would repeat the last measurement."""
    r0, _, _ = ranks
    assert r0["int4"]["error_steps"] == [2, 6, 10], r0["int4"]["error_steps"]


def test_accumulation_compresses_only_the_syncing_micro_batch_and_keeps_the_bucket_cap(ranks):
    r0, r1, _ = ranks
    assert r0["acc"]["global_step"] == 6 and r0["acc"]["fastml_step"] == 6  # 12 micro-batches, 6 hook steps
    assert r0["acc"]["digest"] == r1["acc"]["digest"]
    assert r0["acc_bucket_bytes_cap"] == int(0.02 * 1024 * 1024)  # ddp_bucket_cap_mb reached DDP unchanged


def test_bf16_with_gradient_checkpointing(ranks):
    r0, r1, _ = ranks
    assert r0["bf16_mixed_precision"] == "bf16" and r0["bf16_checkpointing"]
    assert r0["bf16"]["digest"] == r1["bf16"]["digest"] and r0["bf16"]["fastml_step"] == 6
    assert all(l == l and l < 5 for l in r0["bf16"]["losses"])  # finite


def test_lora_plan_uses_the_names_the_user_sees_and_only_adapters_train(ranks):
    r0, r1, _ = ranks
    layers = r0["lora"]["layers"]
    assert layers and all(".lora_A." in n or ".lora_B." in n for n in layers)  # frozen base: not in DDP's buckets
    assert layers[r0["lora_exact"]] == "int8" and r0["lora_exact"].startswith("base_model.model.")
    assert sum(c == "int4" for c in layers.values()) == len(layers) - 1
    assert r0["lora"]["digest"] == r1["lora"]["digest"] and not r0["lora_base_changed"]


def test_resume_from_checkpoint_is_bit_exact(ranks):
    r0, r1, _ = ranks
    assert r0["saved"] == {"global_step": 4, "ranks": [0, 1], "steps": [4, 4], "residuals": 16}
    for r in (r0, r1):
        assert r["resumed"]["digest"] == r["full"]["digest"]  # 4 + 4 steps == 8 uninterrupted
        assert r["resumed"]["fastml_step"] == 8
        # without fastml_state.pt the residuals restart from zero: the run is no longer bit-exact
        assert r["bare"]["digest"] != r["full"]["digest"] and r["bare"]["fastml_step"] == 4
    assert r0["bare_warned"]  # and the main process said so


def test_trl_sft_trainer_runs_with_the_same_line(ranks):
    r0, r1, _ = ranks
    assert r0["trl"]["trainer"] == "SFTTrainer" and r0["trl"]["wrapped"] == "DistributedDataParallel"
    assert r0["trl"]["fastml_step"] == r0["trl"]["global_step"] == 4
    assert r0["trl"]["digest"] == r1["trl"]["digest"]
    assert r0["trl"]["layers"] and all("lora_" in n for n in r0["trl"]["layers"])


def test_a_recipe_name_compresses_peft_adapters_under_its_min_numel(ranks):
    """plan="int4" on SFTTrainer + LoRA (8 x 64 matrices, under int4's min_numel of 4096): setup lowers
    min_numel to the smallest adapter matrix and says so once; every adapter is compressed."""
    r0, r1, _ = ranks
    trl = r0["trl"]
    assert trl["min_numel"] == 512 and r1["trl"]["min_numel"] == 512
    assert set(trl["layers"].values()) == {"int4"}, trl["layers"]  # none left as fp32
    assert trl["logged"]["fastml/compression_ratio"] > 3  # 3.76 measured (1.0 with int4's min_numel of 4096)
    assert len(trl["fit_logged"]) == 1 and "min_numel=512" in trl["fit_logged"][0]
    assert r1["trl"]["fit_logged"] == []  # rank 0 says it


def test_a_plan_naming_a_tied_weight_applies_to_it_in_the_trainer(ranks):
    """GPT-2's lm_head.weight is transformer.wte.weight: a plan naming it is taken with the alias note
    (as register_hook takes it), not refused by setup."""
    r0, r1, _ = ranks
    for r in (r0, r1):
        assert r["gpt2"]["global_step"] == r["gpt2"]["fastml_step"] == 2
        assert r["gpt2"]["layers"]["transformer.wte.weight"] == "int8" and "lm_head.weight" not in r["gpt2"]["layers"]
        assert r["gpt2_alias_noted"]
    assert r0["gpt2"]["digest"] == r1["gpt2"]["digest"]


def test_resume_under_another_plan_names_the_file_and_the_setup_call(ranks):
    r0, r1, _ = ranks
    for r in (r0, r1):
        msg = r["resume_other_plan"]
        assert msg is not None and "\n" not in msg and msg.startswith("fastml_strategy.transformers: "), msg
        assert "checkpoint-4/fastml_state.pt" in msg and "setup(trainer, plan='int4')" in msg, msg
        assert "delete fastml_state.pt" in msg and "strict=False" not in msg and "Plan.from_dict" not in msg, msg
    assert r0["resume_other_plan"] == r1["resume_other_plan"]


def test_bad_plans_stop_before_the_first_step_on_every_rank_with_one_line(ranks):
    r0, r1, _ = ranks
    for r in (r0, r1):
        for key, needle in (("bad_env", "FASTML_PLAN='int44' is not a usable plan"),
                            ("bad_name", "'model.layers.7.mlp.up_proj.weight'"),
                            ("bad_disagree", "ranks hold different plans")):
            msg = r[key]
            assert msg is not None and "\n" not in msg and needle in msg, (key, msg)
            assert msg.startswith("fastml_strategy.transformers: ")
        assert r["bad_disagree_step"] == 0
    assert r0["bad_disagree"] == r1["bad_disagree"]  # the same error on both ranks


def test_refusals_reach_every_rank_before_any_step(tmp_path):
    """Ranks started without torchrun's agent (each rank's own outcome shows, none killed for another's
    failure): (1) TrainingArguments without use_cpu on this GPU-less machine trains each process alone:
    setup raises on both, naming use_cpu=True, instead of reporting a plan it never runs; (2) a bad plan
    file on rank 1 only: both ranks raise the same error in setup, before DDP's constructor (where rank 0
    would get gloo's "Connection closed by peer")."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("without use_cpu, a machine with GPUs trains data-parallel on them: nothing to refuse")
    out = tmp_path / "out"
    results = run_ranks([sys.executable, JOB, str(out), "refusals"], world=2, timeout=300)
    for rank, res in enumerate(results):
        assert res.returncode == 0, f"rank {rank} exited {res.returncode}:\n{res.tail()}"
    r0, r1 = rank_files(out)
    for r in (r0, r1):
        assert r["alone_mode"] == "not_parallel"
        msg = r["alone"]
        assert msg is not None and "\n" not in msg and msg.startswith("fastml_strategy.transformers: "), msg
        assert "trains each process alone" in msg and "use_cpu=True" in msg, msg
        msg = r["bad_file"]
        assert msg is not None and msg.startswith("fastml_strategy.transformers: ") and "\n" not in msg, msg
        assert "found on rank(s) [1]" in msg and "plan.rank1.json" in msg, msg
        assert r["bad_file_step"] == 0
    assert r0["alone"] == r1["alone"] and r0["bad_file"] == r1["bad_file"]


def test_localsgd_opt_in_syncs_every_h_steps_and_resumes_each_rank_exactly(ranks):
    r0, r1, _ = ranks
    assert r0["lsgd"]["fastml_step"] == 6 and r0["lsgd"]["outer_steps"] == 2  # every=3: 2 synchronisations
    assert r0["lsgd"]["digest"] == r1["lsgd"]["digest"]  # identical right after the synchronisation at 6
    assert r0["lsgd_saved"] == {"kind": "localsgd", "ranks": [0, 1], "models_differ": True}  # step 4: apart
    for r in (r0, r1):
        assert r["lsgd_resumed"]["digest"] == r["lsgd"]["digest"] and r["lsgd_resumed"]["outer_steps"] == 2
    assert r0["lsgd_ratio_vs_ddp"] > 15  # int4 (about 7.6x) and one sync in 3 steps
    assert r0["lsgd"]["logged"]["fastml/ratio_vs_ddp"] == r0["lsgd_ratio_vs_ddp"]


def test_torch_compile_keeps_replicas_identical_and_trains_as_uncompiled(ranks):
    """TrainingArguments(torch_compile=True): Accelerate compiles the DDP model and FastML finds the DDP
    inside. The launch uses the aot_eager backend (dynamo, DDP's graph splitting, AOTAutograd's compiled
    backward); inductor was checked by hand (docs/integrations.md)."""
    r0, r1, _ = ranks
    assert r0["compile"]["wrapped"] == "OptimizedModule"  # trainer.model_wrapped: the compiled DDP model
    assert r0["compile"]["digest"] == r1["compile"]["digest"]
    assert r0["compile"]["fastml_step"] == r0["compile"]["global_step"] == 10
    compiled, uncompiled = r0["compile"]["losses"], r0["int4"]["losses"]
    assert compiled[-1] < compiled[0] - 0.5, compiled
    assert max(abs(a - b) for a, b in zip(compiled, uncompiled)) < 1e-3, (compiled, uncompiled)
    assert 7.0 < r0["compile"]["logged"]["fastml/compression_ratio"] < 8.0


def test_fsdp2_through_training_arguments_on_cpu(ranks):
    """fsdp/fsdp_config (version 2) on 2 CPU ranks: Accelerate drops its FSDP plugin on CPU; setup(trainer)
    switches it to its FSDP2 path, and FastML compresses the reduce-scatter of each FSDP unit."""
    r0, r1, _ = ranks
    assert r0["fsdp_before"] == ["MULTI_CPU", True, False]  # what Accelerate makes of fsdp_config on CPU
    assert r0["fsdp_after"] == ["FSDP", True, True]
    for r in (r0, r1):
        assert r["fsdp_none_max_abs_diff"] <= 1e-6, r["fsdp_none_max_abs_diff"]  # none == plain Trainer DDP
        for run in ("fsdp_none", "fsdp_int4", "fsdp_resumed", "fsdp_acc"):
            assert r[run]["state"] == "FSDPState" and r[run]["wrapped"] == "FSDPLlamaForCausalLM", run
            assert r[run]["fsdp_units"] >= 5  # 2 decoder layers, the embedding, norm + head, the root
    assert 0.99 < r0["fsdp_none"]["logged"]["fastml/compression_ratio"] <= 1.0  # 0.9986 measured: about 1
    int4 = r0["fsdp_int4"]
    assert int4["digest"] == r1["fsdp_int4"]["digest"] and int4["fastml_step"] == 8
    assert int4["digest"] != r0["fsdp_none"]["digest"]
    assert int4["losses"][-1] < int4["losses"][0] - 0.5, int4["losses"]
    assert 7.0 < int4["logged"]["fastml/compression_ratio"] < 8.0
    assert any(k.startswith("fastml/error/model.layers.") for k in int4["error_keys"])
    assert r0["fsdp_saved"] == {"global_step": 4, "ranks": [0, 1], "steps": [4, 4]}
    for r in (r0, r1):  # checkpoint-4 (Trainer's FSDP checkpoint + fastml_state.pt) + 4 steps == 8 straight
        assert r["fsdp_resumed"]["digest"] == r["fsdp_int4"]["digest"] and r["fsdp_resumed"]["fastml_step"] == 8
    acc = r0["fsdp_acc"]  # 12 micro-batches, 6 optimizer steps: FastML reduces only the syncing ones
    assert acc["global_step"] == acc["fastml_step"] == 6 and acc["digest"] == r1["fsdp_acc"]["digest"]
    assert r0["fsdp_acc_param_dtype"] == "torch.bfloat16"  # bf16=True reached FSDP2's mixed precision
    for r in (r0, r1):  # LocalSGD needs DDP: refused in setup, on every rank
        assert "LocalSGD (every=3) needs Trainer's DDP model" in r["fsdp_every_refused"]


def test_bucket_advice_names_the_training_argument(monkeypatch):
    """Without ddp_bucket_cap_mb, a model that DDP's 25 MB default packs into fewer than 3 buckets gets the
    ddp_bucket_cap_mb suggest_bucket_cap_mb computes, as a FastMLAdvice warning shown at Python's default
    level, once; a cap the user set is left alone, unadvised."""
    import types
    import warnings

    import torch

    import fastml_strategy._advice as advice
    import fastml_strategy.transformers as fmt
    from fastml_strategy import FastMLAdvice
    from fastml_strategy.hook import suggest_bucket_cap_mb

    monkeypatch.setattr(advice, "_GIVEN", set())
    ddp = types.SimpleNamespace(module=torch.nn.Linear(2048, 1100))  # 9.0 MB of fp32 gradient
    cb = fmt.FastMLCallback("int4")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        cb._advise_buckets(types.SimpleNamespace(ddp_bucket_cap_mb=5, should_log=True), ddp)
        assert not seen
        for _ in range(2):
            cb._advise_buckets(types.SimpleNamespace(ddp_bucket_cap_mb=None, should_log=True), ddp)
    assert [w.category for w in seen] == [FastMLAdvice]
    assert f"TrainingArguments(ddp_bucket_cap_mb={suggest_bucket_cap_mb(ddp.module):.2f})" in str(seen[0].message)


def test_cpu_fsdp2_switch_refuses_what_trainer_refuses_with_fsdp():
    """Before switching Accelerate to FSDP2 on CPU, setup applies the checks Trainer makes when it builds an
    FSDP Accelerator (it skipped them: on CPU it built none), each one line naming the fix."""
    import types

    from accelerate.utils import DistributedType

    from fastml_strategy.integrations.transformers import _shard_on_cpu

    def trainer(**args):
        base = dict(fsdp=True, fsdp_plugin_args={"fsdp_version": 2}, save_only_model=False,
                    load_best_model_at_end=False, activation_checkpointing=False, should_log=False)
        model = object()
        return types.SimpleNamespace(
            args=types.SimpleNamespace(**{**base, **args}), model=model, model_wrapped=model, optimizer=None,
            lr_scheduler=None, accelerator=types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU,
                                                                 state=types.SimpleNamespace()))

    for t, needle in ((trainer(activation_checkpointing=True,
                               fsdp_plugin_args={"fsdp_version": 2, "activation_checkpointing": True}),
                       "can't both be True"),
                      (trainer(save_only_model=True, load_best_model_at_end=True), "save_only_model=True"),
                      (trainer(save_only_model=True, fsdp_plugin_args={"fsdp_version": 2,
                                                                       "state_dict_type": "SHARDED_STATE_DICT"}),
                       "state_dict_type FULL_STATE_DICT")):
        with pytest.raises(ValueError) as e:
            _shard_on_cpu(t, None)
        assert needle in str(e.value) and "\n" not in str(e.value)
    opt = trainer()
    opt.optimizer = object()
    with pytest.raises(ValueError, match=r"Trainer\(optimizers=...\) is not allowed with FSDP"):
        _shard_on_cpu(opt, None)
    with pytest.raises(ValueError, match=r"LocalSGD \(every=5\) needs Trainer's DDP model"):
        _shard_on_cpu(trainer(), 5)
    # nothing to switch: no FSDP asked for, FSDP1, a model that training already wrapped in DDP
    assert _shard_on_cpu(trainer(fsdp=False), None) is False
    assert _shard_on_cpu(trainer(fsdp_plugin_args={"fsdp_version": 1}), None) is False
    wrapped = trainer()
    wrapped.model_wrapped = object()
    assert _shard_on_cpu(wrapped, None) is False


def test_only_a_recipe_name_on_a_peft_model_gets_min_numel_fitted(monkeypatch):
    """_fit_adapters lowers min_numel to the smallest trainable matrix for a model with PEFT adapters and a
    recipe name (given, or FASTML_PLAN, or the default); a Plan, the `none` recipe and a model without
    adapters keep theirs."""
    import types

    import torch
    from peft import LoraConfig, get_peft_model

    from fastml_strategy import Plan
    from fastml_strategy.integrations.transformers import _fit_adapters

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(96, 96)

    def trainer(model):
        return types.SimpleNamespace(model=model, is_world_process_zero=lambda: True)

    peft = trainer(get_peft_model(Net(), LoraConfig(r=4, target_modules=["lin"])))  # lora_A 4 x 96: 384
    int4 = Plan.from_recipe("int4")
    assert _fit_adapters(int4, "int4", peft).min_numel == 384
    assert _fit_adapters(int4, None, peft).min_numel == 384  # the default recipe
    monkeypatch.setenv("FASTML_PLAN", "int8")
    assert _fit_adapters(Plan.from_recipe("int8"), None, peft).min_numel == 384
    assert _fit_adapters(int4, int4, peft) is int4  # a Plan names its own min_numel
    monkeypatch.delenv("FASTML_PLAN")
    none = Plan.from_recipe("none")
    assert _fit_adapters(none, "none", peft) is none
    assert _fit_adapters(int4, "int4", trainer(Net())) is int4  # no adapters
