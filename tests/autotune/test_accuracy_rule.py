"""The accuracy rule (issue 12): every calibration run counts, one noisy run cannot decide the limit;
paired runs; repeats near the limit; same command, same seed, same plan; threads per rank; plain DDP
means no hook."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from fastml_strategy import Plan
from fastml_strategy.autotune.calibrate import (final_loss, reference_sigma, repeat_candidates,
                                                runs_paired, train_curve)
from fastml_strategy.autotune.costmodel import accuracy_rule, fit_convergence
from fastml_strategy.autotune.profile import rank_threads
from fastml_strategy.autotune.workload import load_target

HERE = Path(__file__).parent
TARGET = f"{HERE / 'tiny_workload.py'}:workload"
FAST = ["--trials", "12", "--calibration-trials", "3", "--calibration-steps", "30", "--profile-steps", "2",
        "--measure-steps", "4", "--verify-rounds", "1", "--quiet", "--no-local-steps"]


def pt(e, loss, seed=0, pruned=False, plan=None):
    return {"error": e, "ratio": 1.0 + e, "accuracy_loss": math.inf if pruned else loss, "censored": pruned,
            "pruned": pruned, "choice": {"g": plan or f"p{e}"}, "seed": seed}


# -- the rule on synthetic calibrations ----------------------------------------------------------------
def test_one_outlier_cannot_move_the_limit_below_plans_repeated_trials_place_within_it():
    limit = 0.01
    # A (error 0.05) ran three times, C (0.10) twice, all well within; B (0.03) ran once and lost 3%
    runs = [pt(0.03, 0.03, plan="B"),
            pt(0.05, 0.002, 0, plan="A"), pt(0.05, 0.003, 1, plan="A"), pt(0.05, 0.001, 2, plan="A"),
            pt(0.10, 0.005, 0, plan="C"), pt(0.10, 0.004, 1, plan="C"),
            pt(0.40, 0.05, plan="D"), pt(0.40, 0.06, 1, plan="D")]
    rule = accuracy_rule(runs, limit)
    assert rule.e_max == pytest.approx(0.10)  # A and C stay in; D (two failing runs) stays out
    assert fit_convergence(runs, limit, rule=rule).e_max == pytest.approx(0.10)
    # the fit is monotone and the outlier was pooled with the runs after it
    assert rule.fit == sorted(rule.fit) and rule.fit[0] <= limit
    # the old envelope (stop at the first failing run) would have excluded everything
    assert min(p["error"] for p in runs if p["accuracy_loss"] > limit) == 0.03
    # wherever the outlier sits among the passing plans, the limit does not fall below them
    for e_out in (0.01, 0.04, 0.07):
        moved = [pt(e_out, 0.08, plan="X")] + runs[1:]
        assert accuracy_rule(moved, limit).e_max >= 0.10, e_out


def test_the_issue_calibration_keeps_int4_noef_and_int2():
    """The first calibration.csv of the issue: one mixed plan at error 0.059 lost 1.05%, the uniform
    plans above it lost nothing. The old rule set the limit at fp16's error; the fit does not."""
    runs = [pt(0.0002, 0.001), pt(0.059, 0.0105), pt(0.11, -0.052), pt(1.03, -0.006)]
    rule = accuracy_rule(runs, 0.01)
    assert rule.e_max == pytest.approx(1.03)



def test_a_plan_within_the_noise_band_passes():
    """issue 28, gpt2 seed 0 at 50 Mbit/s with the default limit: three paired runs, uniform fp16
    (error 0.0002) at 0, one int4 run at +6.9% (its stretch 1.21, after the delay allowance), int2
    (error 1.12) at 0. The noise around the fit is 0.069 per run, so int4's +6.9% cannot be told from
    no loss; it excluded every compressed plan and the tuner chose uniform fp16, 3.9x the time of
    uniform int2 to the target in training."""
    runs = [pt(0.000195, 0.0), pt(0.1847, 0.06889), pt(1.1196, 0.0)]
    rule = accuracy_rule(runs, 0.01, paired=True, references=2)
    assert rule.sigma == pytest.approx(0.06889 / math.sqrt(1), rel=1e-3)
    assert rule.e_max == pytest.approx(1.1196) and rule.e_noise == pytest.approx(1.1196)
    assert rule.e_sure == 0.0  # with this noise no plan is sure, fp16 included
    assert "noise band" in rule.words() and "cannot be told from no loss" in rule.words()
    # the same losses with a noise well under them (repeats that agree): int4 stays out
    tight = runs + [pt(0.1847, 0.0689, 1), pt(0.1847, 0.0690, 2), pt(0.000195, 0.0001, 1)]
    rule = accuracy_rule(tight, 0.01, paired=True, references=2)
    assert rule.band[1] < rule.fit[1] and rule.e_max == pytest.approx(0.000195) and rule.e_noise == 0.0

def test_a_tie_between_one_good_and_one_bad_run_is_settled_against_the_plan():
    runs = [pt(0.1, 0.0), pt(0.2, 0.0, pruned=True), pt(0.3, 0.0)]
    assert accuracy_rule(runs, 0.01).e_max == pytest.approx(0.1)
    # a repeat of the 0.3 plan breaks the tie in its favour
    assert accuracy_rule(runs + [pt(0.3, 0.001, 1)], 0.01).e_max == pytest.approx(0.3)


def test_band_comes_from_the_noise_and_narrows_with_repeats():
    runs = [pt(0.05, 0.004), pt(0.05, 0.008, 1), pt(0.2, 0.02), pt(0.2, 0.03, 1)]
    rule = accuracy_rule(runs, 0.01)
    assert math.isfinite(rule.sigma) and rule.sigma > 0 and "degrees of freedom" in rule.sigma_source
    assert all(b > 0 for b in rule.band)
    more = accuracy_rule(runs + [pt(0.05, 0.006, 2), pt(0.05, 0.0061, 3)], 0.01)
    assert more.runs[0] == 4
    assert more.band[0] == pytest.approx(rule.band[0] * math.sqrt(2 / 4) * more.sigma / rule.sigma)
    assert 0.5 <= rule.confidence <= 1.0 and rule.e_sure <= rule.e_max
    # unpaired references with a large spread widen the band; paired runs trust the fit's spread
    wide = accuracy_rule(runs, 0.01, reference_sigma=0.05, paired=False, references=2)
    assert wide.sigma == pytest.approx(0.05 * math.sqrt(2)) and "reference" in wide.sigma_source
    assert wide.confidence < rule.confidence and "larger than the limit" in wide.words()
    assert accuracy_rule(runs, 0.01, reference_sigma=0.05, paired=True).sigma == pytest.approx(rule.sigma)
    assert "paired (every run saw" in accuracy_rule(runs, 0.01, paired=True).words()


def test_repeats_go_to_the_plans_nearest_the_limit_with_an_unused_seed():
    runs = [pt(0.01, 0.0, plan="far"), pt(0.05, 0.009, plan="near"), pt(0.06, 0.012, plan="near2"),
            pt(0.5, 0.2, plan="out"), pt(0.05, 0.009, 1, plan="near")]
    runs[-1]["error"] = 0.05
    rule = accuracy_rule(runs, 0.01)
    reps = repeat_candidates(rule, runs, 2, seed=0)
    assert {c["g"] for c, _ in reps} == {"near", "near2"}
    assert dict((c["g"], s) for c, s in reps) == {"near": 2, "near2": 1}  # seed 1 of "near" ran already


def test_final_loss_averages_a_window_and_reference_noise():
    assert final_loss([9.0] * 80 + [1.0, 3.0] * 10) == pytest.approx(2.0)
    refs = [{"losses": [2.0] * 50, "metric": None}, {"losses": [2.2] * 50, "metric": None}]
    assert reference_sigma(refs) == pytest.approx(0.2 / 2.1 / math.sqrt(2))
    assert math.isnan(reference_sigma(refs[:1]))
    assert reference_sigma([{"metric": 0.9}, {"metric": 0.8}]) == pytest.approx(0.1 / math.sqrt(2))


# -- paired runs -----------------------------------------------------------------------------------------
GEN_WORKLOAD = '''
import torch
from fastml_strategy.autotune import Workload

def make():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    gen = torch.Generator().manual_seed(1234)   # the workload's own generator, as streaming data has

    def batches():
        while True:
            yield torch.randn(4, 8, generator=gen), torch.randint(0, 2, (4,), generator=gen)

    return Workload(model=model, batches=batches,
                    loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
'''


def test_runs_built_afresh_from_the_factory_are_paired(tmp_path):
    f = tmp_path / "gen_workload.py"
    f.write_text(GEN_WORKLOAD)
    wl = load_target(f"{f}:make")
    assert wl.factory is not None
    assert runs_paired(wl, seed=0)
    # two runs replay the same batches: the same losses, step for step
    a, _ = train_curve(wl, None, 12, seed=0)
    b, _ = train_curve(wl, None, 12, seed=0)
    assert a == b
    # the same workload object without its factory draws on from where the last run stopped
    wl.factory = None
    assert not runs_paired(wl, seed=0)
    c, _ = train_curve(wl, None, 12, seed=0)
    d, _ = train_curve(wl, None, 12, seed=0)
    assert c != d


# -- threads per rank ------------------------------------------------------------------------------------
def test_rank_threads_sets_and_restores():
    before = torch.get_num_threads()
    with rank_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with rank_threads(None):
        assert torch.get_num_threads() == before


def test_default_threads_are_cores_over_world_size(tmp_path):
    from fastml_strategy.autotune._run import prepare
    from fastml_strategy.autotune.profile import available_cores

    s = prepare(TARGET, out=tmp_path / "o", world_size=2, link="1gbit", progress=False)
    assert s.threads_per_rank == max(1, available_cores() // 2)
    assert s.threads_source.startswith("cores / world size")
    s = prepare(TARGET, out=tmp_path / "o2", world_size=2, link="1gbit", progress=False, threads_per_rank=3)
    assert (s.threads_per_rank, s.threads_source) == (3, "--threads-per-rank")
    with pytest.raises(ValueError, match="--threads-per-rank"):
        prepare(TARGET, out=tmp_path / "o3", threads_per_rank=0)
    with pytest.raises(ValueError, match="--budget"):
        prepare(TARGET, out=tmp_path / "o4", budget=-1)


# -- the command: same seed, same plan; threads, phases, the rule in the report --------------------------
def _env():
    root = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(args, timeout=150):
    return subprocess.run([sys.executable, "-m", "fastml_strategy.autotune.cli", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_same_command_same_seed_same_plan(tmp_path):
    outs = []
    for i in range(2):
        out = tmp_path / f"run{i}"
        # a slow link: the bytes decide between the codecs, not codec timings within the machine's noise
        # (with stretches measured within noise, int6 and int4 both cost ~1x the steps here: issue 28)
        r = _run([TARGET, "--world-size", "2", "--link", "10mbit", "--out", str(out), "--threads-per-rank",
                  "1", *FAST])
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append((out, r))
    p0, p1 = (json.loads((o / "plan.json").read_text()) for o, _ in outs)

    def wire(plan):  # what goes on the wire, per layer: everything but error feedback
        return {name: {k: v for k, v in c.items() if k != "error_feedback"}
                for name, c in [("(default)", plan["default"]), *plan["layers"].items()]}

    # The same wire format for every layer, and the same local-steps choice. Error feedback on or off
    # (int4 / int4-noef: the same bytes) is the one choice left to measured codec times, which vary
    # with the machine's load; every other difference would be a non-replaying run.
    assert wire(p0) == wire(p1) and p0.get("local_steps") == p1.get("local_steps")
    c0, c1 = (pd.read_csv(o / "calibration.csv") for o, _ in outs)
    # the runs themselves replay; a verification run of int4-noef in one command and not the other
    # (the error-feedback choice above) is the one row that may differ
    both = c0.merge(c1, on=["choice", "seed"], suffixes=("0", "1"))
    assert len(both) >= min(len(c0), len(c1)) - 1 and len(both) >= 5
    assert list(both["accuracy_loss0"]) == list(both["accuracy_loss1"])
    assert list(both["ratio0"]) == list(both["ratio1"])
    # two references, repeats with other seeds, and the rule in the report and plan.json
    assert set(c0["seed"]) >= {0, 1}
    md = (outs[0][0] / "report.md").read_text()
    assert "Accuracy rule: a monotone (L1 isotonic) fit" in md and "runs paired" in md
    assert "timed with 1 thread(s) per rank (--threads-per-rank)" in md
    assert "Tuner wall time: profiling" in md and "calibrating" in md
    rule = p0["meta"]["accuracy_rule"]
    assert rule["paired"] is True and rule["runs"] >= 3 and rule["e_max"] == p0["meta"]["convergence"]["e_max"]
    assert "Wall time: profiling" in outs[0][1].stdout
    st = pd.read_csv(outs[0][0] / "step_times.csv")
    assert st["where"].str.contains("1 thread").all()


def _hooked_grads(rank, world_size, path):
    import torch

    import fastml_strategy as fm

    out = []
    for hooked in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                                    torch.nn.ReLU(), torch.nn.Linear(128, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        state = fm.register_hook(ddp, plan=path) if hooked else None
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            ddp.zero_grad()
            ddp(torch.randn(16, 32, generator=g)).square().mean().backward()
        out.append([p.grad.clone() for p in ddp.parameters()])
        if state is not None:
            sent = state.stats()["bytes_sent"]
            state.close()
    return out, sent


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_plain_ddp_recommendation_means_no_hook(tmp_path):
    from _dist import run_workers

    out = tmp_path / "fast"
    # a link so fast that no codec's time pays for itself on the tiny model
    r = _run([TARGET, "--world-size", "2", "--link", "4000gbit,1us", "--out", str(out), *FAST])
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith("  Plain DDP on local: do not register FastML"), lines
    md = (out / "report.md").read_text().splitlines()
    first = next(line for line in md if line.startswith("- "))
    assert "Use plain DDP on" in first and "do not register FastML" in first
    d = json.loads((out / "plan.json").read_text())
    assert d["meta"]["hook"] is False
    plan = Plan.load(out / "plan.json")
    assert not plan.default.lossy and all(not c.lossy for _, c in plan.layers)
    # registered anyway, the file is DDP's own all-reduce: the same gradients, bit for bit
    for (plain, hooked), sent in run_workers(_hooked_grads, 2, str(out / "plan.json"), timeout=120):
        assert all(torch.equal(a, b) for a, b in zip(plain, hooked))
        n = sum(t.numel() for t in plain)
        assert sent == pytest.approx(2 * 2 * (2 - 1) / 2 * 4 * n, rel=0.01)  # fp32 ring bytes, 2 steps


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_budget_caps_the_run_and_the_report_says_what_it_left_out(tmp_path):
    out = tmp_path / "b"
    args = [TARGET, "--world-size", "2", "--link", "100mbit", "--out", str(out), "--budget", "0.01",
            *[a for a in FAST if a != "--no-local-steps"], "--local-steps"]
    r = _run(args)
    assert r.returncode == 0, r.stderr[-3000:]
    cal = pd.read_csv(out / "calibration.csv")
    assert 1 <= len(cal) < 3  # the first run after the reference, then out of time
    md = (out / "report.md").read_text()
    assert "--budget: " in md and "calibration plans not run" in md
    assert "local steps not calibrated" in md
    assert json.loads((out / "plan.json").read_text())["meta"]["tuned_by"] == "fastml-autotune"


# -- bucket size and embeddings in the search ----------------------------------------------------------
def test_bucket_size_is_searched_and_small_models_get_smaller_buckets():
    from fastml_strategy.autotune._state import _best_bucket
    from fastml_strategy.autotune import search
    from fastml_strategy.autotune.costmodel import Convergence, ddp_buckets, evaluate, step_time

    from test_costmodel import make_profile, option

    prof = make_profile(numels=(1 << 20,) * 6, codec_s=1e-4)  # 6 x 4 MiB
    assert [len(b) for b in ddp_buckets(prof)] == [1, 5]  # DDP default: 1 MiB first, then 25 MiB
    assert [len(b) for b in ddp_buckets(prof, 4)] == [1] * 6  # bucket_cap_mb=4: one layer each
    assert [len(b) for b in ddp_buckets(prof, 8)] == [2, 2, 2]
    opt = option(gbps=0.5)
    groups = search.group_layers(prof)
    none = {g: "none" for g in groups}
    conv = Convergence(0.0, 1.0, 1.0)
    base = evaluate(prof, search.expand(groups, none), opt, conv, 1000, hook=False)
    row = dict(base, choice=none, use_hook=False, objective=base["tta_s"])
    got = _best_bucket(prof, groups, opt, conv, 1000, row, search)
    assert got["bucket_mb"] is not None and got["tta_s"] < base["tta_s"]  # more overlap with backward
    assert got["step_s"] == pytest.approx(step_time(prof, {}, opt, hook=False, bucket_mb=got["bucket_mb"]).step_s)


def test_embeddings_keep_a_search_group_of_their_own():
    from fastml_strategy.autotune.search import group_layers

    from test_costmodel import make_profile

    prof = make_profile(numels=(1 << 16,) * 6)
    names = ["tok.weight", "blocks.0.a.weight", "blocks.1.a.weight", "blocks.0.b.weight", "blocks.1.b.weight",
             "head.weight"]
    for lp, n in zip(prof.layers, names):
        lp.name = n
    prof.layers[0].kind = "embedding"
    g = group_layers(prof, max_groups=2)
    assert g["tok.weight"] == ["tok.weight"] and len(g) == 2


def test_a_repeat_that_replays_its_first_run_is_one_measurement(tmp_path):
    runs = [pt(0.05, 0.004, plan="A"), pt(0.05, 0.004, 1, plan="A"), pt(0.05, 0.006, 2, plan="A")]
    rule = accuracy_rule(runs, 0.01)
    assert (rule.trials, rule.repeats, rule.replays, rule.runs) == (3, 1, 1, [2])
    assert "replayed their first run exactly" in rule.words()
    # a workload that seeds itself still sees another data order under another seed
    f = tmp_path / "gen_workload.py"
    f.write_text(GEN_WORKLOAD)
    wl = load_target(f"{f}:make")
    assert train_curve(wl, None, 6, seed=0)[0] != train_curve(wl, None, 6, seed=1)[0]


def test_noise_is_measured_near_the_limit():
    # far past the limit a codec family the error does not capture breaks the order (0.89 then 0.08):
    # that spread is not the noise that decides plans near 1%
    runs = [pt(0.04, 0.007), pt(0.04, 0.005, 1), pt(0.17, 0.004), pt(0.17, 0.002, 1), pt(0.87, 0.89),
            pt(0.98, 0.075)]
    rule = accuracy_rule(runs, 0.01)
    assert rule.sigma < 0.01 and rule.e_max == pytest.approx(0.17)


def test_a_calibration_step_of_two_ranks_trains_on_the_mean_gradient_of_two_batches(tmp_path):
    """``--calibration-ranks 2``: each calibration step is DDP's step of 2 ranks (the mean gradient
    of 2 consecutive batches, their mean loss), in runs rebuilt from the factory too; the default is
    the world size, at most 4, and a bad value is refused naming the flag."""
    from fastml_strategy.autotune._settings import _calibration_ranks

    f = tmp_path / "gen_workload.py"
    f.write_text(GEN_WORKLOAD)
    wl = load_target(f"{f}:make")
    one, _ = train_curve(wl, None, 4, seed=0)
    wl.ranks = 2
    two, _ = train_curve(wl, None, 4, seed=0)
    assert wl.rebuild().ranks == 2 and two != one
    # by hand: the same model, batches and optimizer, two batches per step
    from fastml_strategy.autotune.calibrate import build_run, seeded_stream

    w = build_run(wl, 0)
    model, stream = w.fresh_model(), seeded_stream(w, 0)
    opt, want = w.make_optimizer(model), []
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        losses = [w.loss_fn(model, next(stream)) for _ in range(2)]
        ((losses[0] + losses[1]) / 2).backward()
        opt.step()
        want.append(sum(float(v.detach()) for v in losses) / 2)
    assert two == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert [_calibration_ranks(None, w_) for w_ in (1, 2, 8)] == [1, 2, 4] and _calibration_ranks(3, 8) == 3
    with pytest.raises(ValueError, match="--calibration-ranks"):
        _calibration_ranks(0, 2)
