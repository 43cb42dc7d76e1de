"""fastml-autotune end to end on a tiny CPU workload, resuming, the plan in a real 2-rank hook, and
the input errors (exit status 2, one line, nothing written)."""

import base64
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fastml_strategy import Plan
from fastml_strategy.autotune.catalog import load_catalog
from fastml_strategy.autotune.search import TIE_TOLERANCE
from fastml_strategy.autotune.cli import build_parser, main
from fastml_strategy.autotune.costmodel import CANDIDATES

HERE = Path(__file__).parent
TARGET = f"{HERE / 'tiny_workload.py'}:workload"
FAST = ["--trials", "12", "--calibration-trials", "3", "--calibration-steps", "30",
        "--profile-steps", "2", "--measure-steps", "4", "--verify-rounds", "1", "--quiet"]
LOUD = [a for a in FAST if a != "--quiet"]  # the same, with progress bars (on stderr)
CATALOG = ("name,nodes,accelerators_per_node,price_per_hour,bandwidth_gbps,latency_us,compute_speed\n"
           "cheap-eth,8,1,1.2,10,50,1.0\n"
           "fast-ib,2,8,32.8,400,5,3.0\n")


def _env():
    root = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _run(args, timeout=150):
    return subprocess.run([sys.executable, "-m", "fastml_strategy.autotune.cli", *args], env=_env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    cat = d / "catalog.csv"
    cat.write_text(CATALOG)
    out = d / "out"
    args = [TARGET, "--world-size", "2", "--link", "1gbit", "--hardware", str(cat), "--out", str(out)]
    r = _run([*args, *LOUD])
    assert r.returncode == 0, r.stderr[-3000:]
    return out, args, r  # args: without the speed flags


@pytest.mark.timeout(200)
def test_every_output_is_written(tuned):
    out, _, r = tuned
    assert "(tuned for local)" in r.stdout
    for name in ("plan.json", "report.html", "report.md", "trials.csv", "layers.csv", "calibration.csv",
                 "step_times.csv", "scaling.csv", "options.csv", "autotune.db"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert sorted(p.name for p in (out / "plans").iterdir()) == ["cheap-eth.json", "fast-ib.json", "local.json"]
    assert not [p for p in out.rglob("*.tmp")], "a temporary file of an atomic write was left behind"


@pytest.mark.timeout(200)
def test_plan_covers_every_parameter_and_loads(tuned):
    out, _, _ = tuned
    sys.path.insert(0, str(HERE))
    from tiny_workload import workload

    model = workload().model
    params = dict(model.named_parameters())
    plan = Plan.load(out / "plan.json")
    assert {k for k, _ in plan.layers} == set(params)
    plan.check_parameters(params)
    layers = pd.read_csv(out / "layers.csv")
    assert list(layers["name"]) == list(params)
    for _, row in layers.iterrows():
        cfg = plan.for_parameter(row["name"], int(row["numel"]))
        assert cfg == CANDIDATES[row["codec"]] or (row["codec"] == "none" and not cfg.lossy)
        if row["numel"] < plan.min_numel:
            assert row["codec"] == "none" and not row["tunable"]
    meta = json.loads((out / "plan.json").read_text())["meta"]
    assert meta["hardware_option"] == "local" and meta["predicted"]["step_s"] > 0
    for p in (out / "plans").iterdir():
        Plan.load(p).check_parameters(params)
    # what FASTML_PLAN / FastMLStrategy(plan=...) / register_hook(plan=...) do with a path
    from fastml_strategy.config import resolve_plan

    assert resolve_plan(str(out / "plan.json")) == plan


@pytest.mark.timeout(200)
def test_tables_are_consistent(tuned):
    out, _, _ = tuned
    trials = pd.read_csv(out / "trials.csv")
    options = pd.read_csv(out / "options.csv")
    meta = json.loads((out / "plan.json").read_text())["meta"]
    check = meta.get("checked_against_uniform") or {}
    assert list(options["option"]) == ["local", "cheap-eth", "fast-ib"]
    for opt in options["option"]:
        searched = trials[(trials["option"] == opt) & trials["kind"].isin(["fastml", "local-steps"])]
        assert len(searched) >= 12  # per-step and local-steps trials share the option's study
        t = searched[searched["kind"] == "fastml"]
        assert t["feasible"].any()
        best = options[options["option"] == opt].iloc[0]
        feas = t[t["feasible"]]
        # the reported plan: among feasible trials within TIE_TOLERANCE of the best, the one with the
        # lowest error; or plain DDP when that is cheaper still
        col = "tta_s" if best["price_per_node_hour"] == 0 else "cost_usd"
        ddp = trials[(trials["option"] == opt) & (trials["kind"] == "plain-ddp")].iloc[0]
        reported = best["tuned_hours"] * 3600 if col == "tta_s" else best["tuned_cost_usd"]
        near = feas[feas[col] <= feas[col].min() * (1 + TIE_TOLERANCE) + 1e-15]
        tie_pick = near.sort_values(["error", col]).iloc[0][col]
        replaced = check.get("replaced") if opt == meta["hardware_option"] else None
        if replaced:
            # the check against uniform plans measured one of them reaching the tuned plan's losses
            # sooner: that uniform plan is reported (its bucket size re-chosen, so no worse than its trial)
            codec = replaced.split()[-1]
            # (the sampler may have tried that uniform plan more than once, e.g. with other bucket sizes)
            uniform = t[t["choice"].map(lambda c: set(json.loads(c).values()) == {codec})]
            assert len(uniform) >= 1, (replaced, uniform)
            assert reported <= uniform[col].min() * (1 + 1e-9), (reported, replaced, uniform[col].min())
            continue
        assert reported == pytest.approx(tie_pick if tie_pick <= ddp[col] else ddp[col], rel=1e-9), (
            reported, feas[col].min(), tie_pick, ddp[col])
    # cost = time x nodes x price, as the catalog file gives them (a cluster of your own: no price)
    catalog = {o.name: o for o in load_catalog(out.parent / "catalog.csv")}
    for name, o in catalog.items():
        rows = trials[trials["option"] == name]
        assert len(rows) and o.price_per_hour > 0
        assert (rows["cost_usd"] - rows["tta_s"] * o.nodes * o.price_per_hour / 3600).abs().max() < 1e-12
    assert (trials.loc[trials["option"] == "local", "cost_usd"] == 0).all()
    pareto = trials[trials["pareto"]]
    assert len(pareto) >= 1 and set(pareto["option"]) <= {"cheap-eth", "fast-ib"}
    for _, p in pareto.iterrows():  # nothing priced beats a front point on both axes
        others = trials[trials["feasible"] & trials["option"].isin(["cheap-eth", "fast-ib"])]
        assert not ((others["tta_s"] < p["tta_s"]) & (others["cost_usd"] < p["cost_usd"])).any()
    scaling = pd.read_csv(out / "scaling.csv")
    assert sorted(set(scaling["nodes"])) == [8, 16, 32, 64, 128, 256, 512, 1024]
    assert set(scaling["option"]) == {"local", "cheap-eth", "fast-ib"}
    steps = pd.read_csv(out / "step_times.csv")
    assert {"ddp-fp32", "tuned (local)", "none", "fp16", "int8", "int4", "int2", "topk1", "lowrank4"} == \
        set(steps["plan"])
    assert (steps["measured_s"] > 0).all() and (steps["predicted_s"] > 0).all()
    cal = pd.read_csv(out / "calibration.csv")
    assert len(cal) >= 3 and (cal["error"] >= 0).all()


@pytest.mark.timeout(200)
def test_reports_are_self_contained(tuned):
    out, _, _ = tuned
    html = (out / "report.html").read_text()
    images = html.split('src="data:image/png;base64,')[1:]
    assert len(images) >= 6
    for img in images:
        assert base64.b64decode(img.split('"', 1)[0])[:8] == b"\x89PNG\r\n\x1a\n"
    assert "http://" not in html and "https://" not in html and "<script" not in html
    for section in ("Pareto front", "Per-layer bits", "Predicted vs measured", "larger clusters",
                    "per hardware option"):
        assert section in html
    md = (out / "report.md").read_text()
    for section in ("## Hardware options", "## Step time", "## Per-layer plan", "## Pareto front"):
        assert section in md


@pytest.mark.timeout(200)
def test_report_opens_with_the_answer_in_words(tuned):
    out, _, r = tuned
    md = (out / "report.md").read_text().splitlines()
    first = md[2]  # after the title and a blank line
    # which of the three answers depends on the timings measured on this machine; each is a verdict
    answers = ("- **Use the tuned plan (plan.json) on your cluster", "- **Use plain DDP on your cluster",
               "- **Use local steps on your cluster: LocalSGD with plan.json", "- **Use uniform ")
    assert first.startswith(answers), first
    # the headline names what plan.json holds: the uniform plan the check put in the tuned plan's place
    check = json.loads((out / "plan.json").read_text())["meta"].get("checked_against_uniform") or {}
    if check.get("replaced"):
        assert first.startswith(f"- **Use {check['replaced']} (plan.json) on your cluster"), first
    verdict = [line for line in md[2:8] if line.startswith("- ")]
    text = " ".join(verdict)
    # human units, no scientific notation, and the saving in words
    assert re.search(r"\d[\d.,]* (ms|s|min|h|days) instead of \d[\d.,]* (ms|s|min|h|days)", text) or \
        "no compression pays" in text, text
    assert not re.search(r"\de[-+]\d", text), text
    assert "Cheapest to rent: **" in text and re.search(r"\$\d|under \$0\.001", text)
    # the training length was not given: said to be assumed, never attributed to --target-steps
    assert "10,000 steps of uncompressed training (assumed; pass --target-steps N" in text
    assert "(--target-steps)" not in "\n".join(md)
    meta = json.loads((out / "plan.json").read_text())["meta"]
    assert meta["target_steps"] == 10_000 and meta["target_steps_source"] == "assumed"
    assert "not a network" not in text  # --link describes a real cluster: no warning
    # the HTML says it first too, before any section; the command prints the same answer
    html = (out / "report.html").read_text()
    assert html.index('class="verdict"') < html.index("<h2>")
    assert r.stdout.startswith("fastml-autotune: Use "), r.stdout[:300]


@pytest.mark.timeout(200)
def test_progress_bars_are_honest(tuned):
    """One bar per phase, each with a fixed total that it reaches and never passes."""
    _, _, r = tuned
    states = re.findall(r"([A-Za-z][^:\r\n|]*?):\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)", r.stderr)
    assert states, r.stderr[-2000:]
    phases: dict[str, list[tuple[int, int]]] = {}
    for desc, n, total in states:
        key = "searching" if desc.startswith("searching") else desc
        phases.setdefault(key, []).append((int(n), int(total)))
    assert {"profiling", "calibrating", "searching", "timing plans (compute + codecs)",
            "writing the report"} <= set(phases), list(phases)
    for name, seen in phases.items():
        totals = {t for _, t in seen}
        assert len(totals) <= 2, (name, totals)  # one total per phase (searching: one per round)
        assert all(n <= t for n, t in seen), (name, seen)
        assert seen[-1][0] == seen[-1][1], (name, seen[-1])  # each phase ends complete
    assert phases["profiling"][-1] == (2, 2) and phases["calibrating"][-1] == (4, 4)  # reference + 3
    from fastml_strategy.autotune.costmodel import BASE_OPTIONS

    # 3 options x max(12 trials, one per codec option: every uniform plan is tried first)
    assert phases["searching"][-1][1] == 3 * max(12, len(BASE_OPTIONS))


@pytest.mark.timeout(60)
def test_a_second_run_into_the_same_out_is_refused(tuned, capsys):
    out, args, _ = tuned
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()}
    assert main([*args, *FAST]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastml-autotune: error: ") and len(err.splitlines()) == 1, err
    assert "already holds the outputs of an earlier run" in err and "--overwrite" in err and "plan.json" in err
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir() if p.is_file()} == before  # untouched


def test_only_this_commands_outputs_count_as_an_earlier_run(tmp_path):
    from fastml_strategy.autotune._run import _refuse_finished_out

    (tmp_path / "report.md").write_text("# my notes\n")  # a user's own file of the same name
    (tmp_path / "plan.json").write_text('{"default": {}}')
    _refuse_finished_out(tmp_path)  # not refused
    (tmp_path / "plan.json").write_text('{"meta": {"tuned_by": "fastml-autotune"}}')
    with pytest.raises(ValueError, match=r"already holds .*\(plan\.json; written .*--overwrite"):
        _refuse_finished_out(tmp_path)


@pytest.mark.timeout(200)
def test_overwrite_reruns_from_the_storage_for_a_given_length(tuned):
    import optuna

    out, args, _ = tuned
    storage = f"sqlite:///{out / 'autotune.db'}"
    def calibration_trials():
        names = [s.study_name for s in optuna.get_all_study_summaries(storage) if s.study_name.endswith("calibration")]
        assert len(names) == 1
        return len(optuna.load_study(study_name=names[0], storage=storage).trials)

    before = calibration_trials()
    plan_before = (out / "plan.json").read_text()
    ddp_before = pd.read_csv(out / "options.csv").set_index("option")["ddp_hours"]
    # --verify-rounds 0: a verification round trains the chosen plan, and which of two plans that send
    # the same bytes (int4 / int4-noef) is chosen rests on codec times measured again under the
    # machine's load; without it, nothing the first run stored may be trained again
    r = _run([*args, *FAST, "--overwrite", "--target-steps", "20k", "--verify-rounds", "0"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert calibration_trials() == before  # nothing retrained

    def wire(plan):  # what goes on the wire, per layer (all but error feedback)
        return {n: {k: v for k, v in c.items() if k != "error_feedback"} for n, c in plan["layers"].items()}

    # the search ranks plans by time and cost, which the training length scales alike
    assert wire(json.loads((out / "plan.json").read_text())) == wire(json.loads(plan_before))
    ddp_after = pd.read_csv(out / "options.csv").set_index("option")["ddp_hours"]
    assert (ddp_after / ddp_before).to_numpy() == pytest.approx(2.0, rel=1e-9)  # 20,000 steps, not 10,000
    md = (out / "report.md").read_text()
    assert "20,000 steps of uncompressed training (--target-steps)" in md and "assumed" not in md
    assert json.loads((out / "plan.json").read_text())["meta"]["target_steps_source"] == "given"


def test_human_units():
    from fastml_strategy.autotune.report.words import _pct, human_money, human_time

    assert [_pct(x) for x in (4.1e-10, 0.0123, 4.2, 77.4, 1234.0)] == ["0%", "0.012%", "4.2%", "77%", "1,234%"]

    assert [human_time(x) for x in (0.00085, 0.85, 42.0, 600.0, 2.5 * 3600, 100 * 3600, 4e6)] == \
        ["0.85 ms", "850 ms", "42 s", "10 min", "2.5 h", "4.17 days", "46.3 days"]
    assert human_time(float("nan")) == "n/a"
    assert [human_money(x) for x in (0.0, 0.0006, 0.00541, 0.0412, 12.345, 32.8, 1234.5)] == \
        ["$0", "under $0.001", "$0.00541", "$0.0412", "$12.35", "$32.80", "$1,234"]


def test_training_length_is_asked_at_a_terminal(monkeypatch, capsys):
    import fastml_strategy.autotune._run as run_mod
    from fastml_strategy.autotune import cli

    seen = {}

    def fake_prepare(target, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(run_mod, "prepare", fake_prepare)
    monkeypatch.setattr(cli, "_interactive", lambda: True)
    monkeypatch.setattr(sys, "stdin", io.StringIO("twenty\n20k\n"))
    assert main([TARGET, "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "how many optimizer steps does your training take" in err and "Enter: assume 10,000" in err
    assert "'twenty' is not a number of steps" in err
    assert seen["target_steps"] == 20_000 and seen["target_steps_source"] == "entered"
    # Enter keeps the assumed length, labelled as assumed; --target-steps asks nothing
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n"))
    main([TARGET, "--quiet"])
    assert seen["target_steps"] is None and seen["target_steps_source"] is None
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    main([TARGET, "--quiet", "--target-steps", "5e4"])
    assert seen["target_steps"] == 50_000 and seen["target_steps_source"] == "given"
    assert "how many" not in capsys.readouterr().err


def _hook_worker(rank, world, plan_path):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastml_strategy as fm
    from tiny_workload import workload

    wl = workload()
    model = DDP(wl.model)
    state = fm.register_hook(model, fm.Plan.load(plan_path))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in wl.batches[rank::2][:3]:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return state.stats()["steps"], float(sum(p.sum() for p in model.parameters()))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_plan_runs_in_the_hook_on_two_ranks(tuned):
    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from _dist import run_workers

    (s0, p0), (s1, p1) = run_workers(_hook_worker, 2, str(tuned[0] / "plan.json"), timeout=120)
    assert s0 == s1 == 3 and p0 == p1  # replicas identical under the tuned plan


def test_help_explains_every_option():
    """Every option of the command has a help text of its own (argparse lists an option without one)."""
    import argparse

    for action in build_parser()._actions:
        if action.help is argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        name = (action.option_strings or [action.dest])[-1]
        assert action.help and len(action.help.split()) >= 3, f"{name} has no help text"


def test_docs_explain_every_option_and_its_default():
    """docs/autotune.md's options table names every option of the command, with its default."""
    doc = (HERE.parents[1] / "docs" / "autotune.md").read_text()
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `(--[a-z-]+)[^`]*`[^|]*\| (.*) \|$", doc, re.M)}
    for action in build_parser()._actions:
        long = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if not long:
            continue
        documented = [o for o in long if o in rows or f"`{o}" in doc]
        assert documented, f"{long[0]} is not in docs/autotune.md"
        if action.default not in (None, False, True) and long[0] in rows:
            d = action.default
            shown = {f"{d:g}" if isinstance(d, float) else str(d)} | ({f"{d:,}"} if isinstance(d, int) else set())
            assert any(x.lower() in rows[long[0]].lower() for x in shown), \
                f"{long[0]}: docs/autotune.md does not give its default {d!r}"


# -- errors: exit 2, one line, nothing written -----------------------------------------------------------
def _fails(capsys, args, out):
    assert main([*args, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastml-autotune: error: ") and len(err.splitlines()) == 1, err
    assert not out.exists()
    return err


def test_bad_target(tmp_path, capsys):
    err = _fails(capsys, [str(tmp_path / "missing.py") + ":workload"], tmp_path / "o1")
    assert "missing.py" in err and "does not exist" in err
    err = _fails(capsys, [f"{HERE / 'tiny_workload.py'}:nope"], tmp_path / "o2")
    assert "'nope'" in err
    err = _fails(capsys, [f"{HERE / 'tiny_workload.py'}:not_a_workload"], tmp_path / "o3")
    assert "Workload" in err


def test_catalog_missing_field(tmp_path, capsys):
    cat = tmp_path / "cat.yaml"
    cat.write_text("- name: a\n  nodes: 2\n  accelerators_per_node: 1\n  price_per_hour: 1\n"
                   "  bandwidth_gbps: 10\n  compute_speed: 1\n")
    err = _fails(capsys, [TARGET, "--hardware", str(cat)], tmp_path / "o")
    assert "latency_us" in err and "cat.yaml" in err and "'a'" in err


@pytest.mark.parametrize("url", ["postgresql://autotune@127.0.0.1:1/fastml",
                                 "sqlite:////nonexistent-dir-fastml/x.db"])
def test_unreachable_storage(tmp_path, capsys, url):
    err = _fails(capsys, [TARGET, "--storage", url], tmp_path / "o")
    assert url in err and "unreachable" in err


def test_existing_out_gets_nothing_on_error(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main([TARGET, "--hardware", str(tmp_path / "nope.csv"), "--out", str(out)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_exit_status_from_the_command(tmp_path):
    r = _run([str(tmp_path / "missing.py") + ":f", "--out", str(tmp_path / "o")], timeout=60)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_distributed_launch_measures_link_and_step_times(tmp_path):
    """Under torchrun: the link comes from timed collectives, plans are timed with the real hook."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
         "127.0.0.1", "--master_port", str(port), "-m", "fastml_strategy.autotune.cli", TARGET,
         "--out", str(out), *FAST],
        env=_env(), capture_output=True, text=True, timeout=220)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("(tuned for local)") == 1  # rank 0 reports, once
    steps = pd.read_csv(out / "step_times.csv")
    assert (steps["where"] == "2 ranks, measured link").all()
    assert not steps.set_index("plan").loc["tuned (local)", "used_in_fit"]
    md = (out / "report.md").read_text()
    assert "(measured)" in md
    # both ranks on this one machine: the "link" is loopback, and every document says so
    assert r.stdout.count("the measured link is not a network") == 1
    assert "All 2 ranks ran on one machine" in md and "not a network" in md.split("## Details")[0]
    assert "not a network" in (out / "report.html").read_text()
    Plan.load(out / "plan.json")
