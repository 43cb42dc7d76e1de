"""Local steps in the autotuner: the cost model (bytes / H, streaming overlap), the calibration's
simulation, the search's choice between per-step compression and LocalSGD, the plan file, and the
command's report, flags and last line."""

import dataclasses
import json
import math
import sys
from pathlib import Path

import pandas as pd
import pytest

from fastml_strategy import LocalSteps, Plan
from fastml_strategy.autotune.calibrate import local_calibration_steps, local_curve
from fastml_strategy.autotune.cli import main
from fastml_strategy.autotune.costmodel import (CANDIDATES, Convergence, LocalCalibration, evaluate,
                                                evaluate_local, local_step_time)
from fastml_strategy.autotune.search import TIE_TOLERANCE, best_row, group_layers, run_search
from fastml_strategy.comm._status import HEADER
from fastml_strategy.codecs import wire_bytes

from test_costmodel import make_profile, option

HERE = Path(__file__).parent
TARGET = f"{HERE / 'tiny_workload.py'}:workload"
FAST = ["--trials", "20", "--calibration-trials", "2", "--calibration-steps", "20", "--profile-steps", "2",
        "--measure-steps", "2", "--verify-rounds", "0", "--quiet", "--world-size", "2"]


def calibration(stretch=None, loss=None, e_cal=0.1):
    stretch = stretch or {10: 1.2, 50: 1.8}
    return LocalCalibration(stretch=stretch, accuracy_loss=loss or {h: 0.0 for h in stretch},
                            censored={h: False for h in stretch}, e_cal=e_cal, max_accuracy_loss=0.01)


# -- cost model -----------------------------------------------------------------------------------------
def test_whole_model_sync_is_compute_plus_wire_over_h():
    prof = make_profile(codec_s=0.0)
    opt = option(gbps=0.2, latency_us=1000)
    choice = {lp.name: "int4" for lp in prof.layers}
    # one fragment of one piece: its all_to_all and all_gather each carry a header to the other rank
    nbytes = sum(wire_bytes(lp.numel, CANDIDATES["int4"], 2) for lp in prof.layers) + 2 * HEADER
    wire = 3 * 1e-3 + nbytes / 25e6  # 3(N-1) rounds, 0.2 Gbit/s = 25 MB/s
    for h in (1, 10, 50):
        br = local_step_time(prof, choice, opt, every=h)
        assert br.bytes_per_rank == round(nbytes / h)
        assert br.step_s == pytest.approx(prof.compute_s + wire / h, rel=1e-12)
        assert br.exposed_s == pytest.approx(wire / h, rel=1e-12)


def test_streaming_hides_what_the_delay_covers_and_never_more():
    prof = make_profile(numels=(1 << 18,) * 4, codec_s=0.0)
    opt = option(gbps=0.2, latency_us=0)
    choice = {lp.name: "int4" for lp in prof.layers}
    c = prof.compute_s
    # F fragments of one layer and one piece each, two headers each
    wire = sum(wire_bytes(lp.numel, CANDIDATES["int4"], 2) + 2 * HEADER for lp in prof.layers) / 25e6
    H, F = 40, 4
    for d in (0, 1, 3, 9):
        br = local_step_time(prof, choice, opt, every=H, fragments=F, delay=d)
        assert br.step_s == pytest.approx(c + F * max(0.0, wire / F - d * c) / H, rel=1e-12)
        assert br.step_s >= c and br.bytes_per_rank == round(wire * 25e6 / H)
    # a delay long enough for each fragment: the step is the compute alone, max(H c, wire) / H
    d = math.ceil(wire / F / c)
    assert d < H // F
    assert local_step_time(prof, choice, opt, H, F, d).step_s == pytest.approx(max(H * c, wire) / H)


def test_evaluate_local_charges_the_stretch_and_picks_the_delay():
    prof = make_profile(numels=(1 << 18,) * 4, codec_s=0.0, errors={"int4": 0.1})
    opt = option(gbps=0.02, price=2.0)  # a fragment's wire time is about 1.5 steps of compute
    conv = Convergence(k=1.0, gamma=1.0, e_max=0.2)
    cal = calibration()
    choice = {lp.name: "int4" for lp in prof.layers}
    r = evaluate_local(prof, choice, opt, conv, cal, 1000, every=50, fragments=4)
    assert r["feasible"] and r["every"] == 50 and r["fragments"] == 4 and 0 < r["delay"] < 50 // 4
    # steps: stretch x the delay's dropped progress (the plan is the calibrated one: g ratio 1)
    assert r["steps"] == pytest.approx(1000 * 1.8 * 50 / (50 - r["delay"]))
    best = min((1000 * 1.8 * 50 / (50 - d) * local_step_time(prof, choice, opt, 50, 4, d).step_s, d)
               for d in range(50 // 4))
    assert r["tta_s"] == pytest.approx(best[0]) and r["delay"] == best[1]
    assert r["cost_usd"] == pytest.approx(r["tta_s"] * 2 * 2.0 / 3600)
    # an H over the accuracy limit, or never calibrated, is infeasible
    bad = calibration(loss={10: 0.0, 50: 0.5})
    assert not evaluate_local(prof, choice, opt, conv, bad, 1000, every=50)["feasible"]
    assert not evaluate_local(prof, choice, opt, conv, cal, 1000, every=20)["feasible"]


def test_local_calibration_round_trips_through_json():
    cal = calibration()
    back = LocalCalibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert back == cal and back.every == [10, 50]


# -- the search -------------------------------------------------------------------------------------------
def _search(gbps, latency_us):
    prof = make_profile(numels=(1 << 20, 1 << 18), codec_s=1e-5, errors={"int4": 0.1, "int2": 0.3})
    groups = group_layers(prof)
    opt = option(gbps=gbps, latency_us=latency_us, price=1.0)
    conv = Convergence(k=1.0, gamma=1.0, e_max=0.35)
    cal = calibration({10: 1.3, 50: 2.0})
    rows = run_search(prof, groups, opt, conv, 1000, storage=None, study_name="t", trials=80, seed=0,
                      local=cal)
    return prof, groups, opt, conv, rows


def test_search_picks_local_steps_on_a_very_slow_link():
    prof, groups, opt, conv, rows = _search(gbps=0.05, latency_us=30000)
    assert {r["every"] for r in rows} == {1, 10, 50}
    per_step, local = best_row(rows), best_row(rows, local=True)
    assert local["objective"] < per_step["objective"] / 2  # synchronising every step cannot compete
    assert best_row(rows, local=None)["every"] > 1
    # never worse than any uniform plan of either mode that was seeded
    for o in ("int4", "int2", "none"):
        uni = {n: o for ns in groups.values() for n in ns}
        assert per_step["cost_usd"] <= evaluate(prof, uni, opt, conv, 1000)["cost_usd"] * (1 + TIE_TOLERANCE) + 1e-12
        for h in (10, 50):
            r = evaluate_local(prof, uni, opt, conv, calibration({10: 1.3, 50: 2.0}), 1000, h)
            if r["feasible"]:
                assert local["cost_usd"] <= r["cost_usd"] * (1 + TIE_TOLERANCE) + 1e-12


def test_search_picks_per_step_compression_on_a_fast_link():
    _, _, _, _, rows = _search(gbps=400, latency_us=2)
    per_step, local = best_row(rows), best_row(rows, local=True)
    assert best_row(rows, local=None)["every"] == 1
    assert per_step["objective"] < local["objective"]  # the 1.3x stretch costs more than the wire


# -- the calibration's simulation -------------------------------------------------------------------------
def _tiny():
    sys.path.insert(0, str(HERE))
    from tiny_workload import workload

    return workload()


def test_averaging_every_step_uncompressed_is_the_per_step_reference():
    """H=1, plain averaging (outer SGD lr 1), no compression, SGD inner: every replica's step from
    the same weights, averaged, is the mean-gradient step of the reference (DDP)."""
    wl = _tiny()
    ref, ref_metric = local_curve(wl, 2, 0, 12, seed=3)
    loc, loc_metric = local_curve(wl, 2, 1, 12, seed=3, option="none", outer="sgd", outer_lr=1.0,
                                  outer_momentum=0.0)
    assert loc == pytest.approx(ref, rel=1e-5, abs=1e-6)
    assert loc_metric == pytest.approx(ref_metric, abs=1e-6)
    assert local_calibration_steps(60, (10, 50)) == 200 and local_calibration_steps(60, (5,)) == 60


# -- the plan file ---------------------------------------------------------------------------------------
OLD_PLAN = {"format_version": 1, "name": "autotuned-local",
            "default": {"codec": "fp32"}, "layers": {"0.weight": {"codec": "quantize", "bits": 4}},
            "min_numel": 4096, "seed": 0, "meta": {"tuned_by": "fastml-autotune"}}


def test_plan_with_local_steps_round_trips(tmp_path):
    plan = Plan.from_recipe("int4").with_layers({"0.weight": CANDIDATES["int8"]})
    local = dataclasses.replace(plan, local_steps=LocalSteps(every=50, fragments=4, delay=2, outer="sgd",
                                                              outer_lr=1.0, outer_momentum=0.0))
    local.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back == local and back.local_steps.kwargs() == {
        "every": 50, "fragments": 4, "delay": 2, "outer": "sgd", "outer_lr": 1.0, "outer_momentum": 0.0}
    assert back.digest() != plan.digest()
    # a per-step plan's file and digest are what they were before local steps existed
    assert "local_steps" not in plan.to_dict()


def test_old_plan_files_still_load(tmp_path):
    (tmp_path / "old.json").write_text(json.dumps(OLD_PLAN))
    plan = Plan.load(tmp_path / "old.json")
    assert plan.local_steps is None and plan.for_parameter("0.weight").bits == 4
    assert Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("bad, words", [({"every": 0}, "every"), ({"every": 10, "fragments": 2, "delay": 5},
                                                                   "delay"),
                                        ({"every": 10, "outer": "adam"}, "outer"), ({"H": 10}, "unknown")])
def test_bad_local_steps_in_a_plan_file_are_named(bad, words):
    with pytest.raises(ValueError, match=words) as e:
        Plan.from_dict({**OLD_PLAN, "local_steps": bad}, where="plan file 'p.json'")
    assert "plan file 'p.json'.local_steps" in str(e.value)


def _from_plan(rank, world_size, path):
    import warnings

    import torch

    import fastml_strategy as fm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 4))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    local = fm.LocalSGD.from_plan(model, inner, path)
    got = (local.every, local.fragments, local.delay, local.outer, local.outer_lr, local.plan.name)
    for _ in range(4):
        model(torch.randn(8, 64)).square().mean().backward()
        inner.step()
        inner.zero_grad()
        local.step()
    local.close()
    try:
        fm.LocalSGD.from_plan(model, inner, "int4")
        refused = None
    except ValueError as e:
        refused = str(e)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        state = fm.register_hook(ddp, plan=path)
    state.close()
    return got, local.stats()["outer_steps"], refused, [str(x.message) for x in w]


@pytest.mark.timeout(60)
def test_local_sgd_runs_a_tuned_plan_file(tmp_path):
    from _dist import run_workers

    plan = Plan(default=CANDIDATES["int4"], name="autotuned-local",
                local_steps=LocalSteps(every=2, fragments=2, delay=0, outer="sgd", outer_lr=1.0,
                                       outer_momentum=0.0))
    plan.save(tmp_path / "plan.json")
    for got, outer_steps, refused, warned in run_workers(_from_plan, 2, str(tmp_path / "plan.json"),
                                                         timeout=50):
        assert got == (2, 2, 0, "sgd", 1.0, "autotuned-local")
        assert outer_steps == 4  # 2 fragments, synchronised at steps 1, 2, 3, 4 (staggered)
        assert refused and "records no local steps" in refused
        assert any("tuned for local steps" in m and "LocalSGD.from_plan" in m for m in warned), warned


# -- the command ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_command_compares_the_modes_and_says_the_winner_last(tmp_path, capsys):
    out = tmp_path / "on"
    assert main([TARGET, "--link", "200mbit", "--out", str(out), "--local-every", "5,10",
                 "--local-fragments", "1,2", *FAST]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].startswith("  Winner on local: "), lines
    ls = pd.read_csv(out / "local_steps.csv")
    assert list(ls["option"]) == ["local", "ethernet-10g-a10g", "ethernet-25g-4xa10g",
                                  "infiniband-400g-8xa100", "two-regions-200m-a10g"]
    assert set(ls["local_every"].dropna()) <= {5, 10} and set(ls["local_fragments"].dropna()) <= {1, 2}
    assert set(ls["winner"]) <= {"per-step", "local-steps"}
    won = ls[ls["winner"] == "local-steps"]
    assert (won["local_hours"] <= won["per_step_hours"] + 1e-12).all() or (
        won["local_cost_usd"] <= won["per_step_cost_usd"] + 1e-12).all()
    md = (out / "report.md").read_text()
    assert "## Per-step compression vs local steps" in md and "| winner" in md
    html = (out / "report.html").read_text()
    assert "Per-step compression vs local steps" in html and 'alt="per-step compression vs local steps"' in html
    d = json.loads((out / "plan.json").read_text())
    plan = Plan.load(out / "plan.json")
    row = ls[ls["option"] == "local"].iloc[0]
    if row["winner"] == "local-steps":
        assert d["meta"]["mode"] == "local-steps" and plan.local_steps.every == int(row["local_every"])
        assert "Winner on local: local steps (H=" in lines[-1]
    else:
        assert d["meta"]["mode"] == "per-step" and plan.local_steps is None
    assert d["meta"]["per_step"]["tta_s"] > 0

    # --no-local-steps: per-step compression alone, no comparison, no local_steps in any plan
    off = tmp_path / "off"
    assert main([TARGET, "--link", "200mbit", "--out", str(off), "--no-local-steps", *FAST]) == 0
    assert not capsys.readouterr().out.strip().splitlines()[-1].startswith("  Winner")
    assert not (off / "local_steps.csv").exists()
    assert "local steps" not in (off / "report.md").read_text().lower()
    for p in [off / "plan.json", *(off / "plans").iterdir()]:
        assert Plan.load(p).local_steps is None and "mode" not in json.loads(p.read_text())["meta"]


@pytest.mark.parametrize("args, words", [
    (["--local-every", "1,10"], "--local-every"),
    (["--local-every", "ten"], "--local-every"),
    (["--local-fragments", "0"], "--local-fragments"),
    (["--no-local-steps", "--local-every", "10"], "--no-local-steps"),
    (["--sharding", "fsdp", "--local-every", "10"], "--sharding is fsdp"),
])
def test_bad_local_steps_flags_are_one_line_errors(tmp_path, capsys, args, words):
    assert main([TARGET, "--out", str(tmp_path / "o"), *args, *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "o").exists()
