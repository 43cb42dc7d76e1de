"""fastml-autotune --sharding fsdp|hsdp end to end on the tiny CPU workload (one process, --link), and
its input errors (exit status 2, one line naming the option and the fix, nothing written)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fastml_strategy import Plan
from fastml_strategy.autotune._run import WHATIF_NODES, WHATIF_RANKS_PER_NODE
from fastml_strategy.autotune.cli import build_parser, main
from fastml_strategy.fsdp import shard_chunks

HERE = Path(__file__).parent
TARGET = f"{HERE / 'tiny_workload.py'}:workload"
FAST = ["--trials", "12", "--calibration-trials", "3", "--calibration-steps", "30",
        "--profile-steps", "2", "--measure-steps", "4", "--verify-rounds", "1", "--quiet"]
CATALOG = ("name,nodes,accelerators_per_node,price_per_hour,bandwidth_gbps,latency_us,compute_speed\n"
           "cheap-eth,8,1,1.2,10,50,1.0\n"
           "eth-4x,4,4,5.6,25,30,1.0\n")


def _env():
    root = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _tune(tmp_path_factory, name, *extra):
    d = tmp_path_factory.mktemp(name)
    cat = d / "catalog.csv"
    cat.write_text(CATALOG)
    out = d / "out"
    r = subprocess.run([sys.executable, "-m", "fastml_strategy.autotune.cli", TARGET, "--link", "1gbit",
                        "--hardware", str(cat), "--out", str(out), *FAST, *extra],
                       env=_env(), capture_output=True, text=True, timeout=150)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, r


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    return _tune(tmp_path_factory, "fsdp", "--world-size", "2", "--sharding", "fsdp")


LIMIT_GB = 0.00003  # 31.5 KiB per rank: fp32 residuals of both tuned weights (80 KiB) do not fit


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    return _tune(tmp_path_factory, "hsdp", "--world-size", "4", "--ranks-per-node", "2", "--sharding", "hsdp",
                 "--param-dtype", "bf16", "--max-residual-gb", str(LIMIT_GB))


def _params():
    sys.path.insert(0, str(HERE))
    from tiny_workload import workload

    return dict(workload().model.named_parameters())


def _residual_of(plan, params, shard=1):
    """Error-feedback bytes per rank the plan implies (from the plan file alone)."""
    total = 0
    for n, p in params.items():
        cfg = plan.for_parameter(n, p.numel())
        if cfg.uses_residual:
            per = max(shard_chunks(list(p.shape), shard)[0])
            total += per * (2 if cfg.residual_dtype == "bf16" else 4)
    return total


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_fsdp_run_writes_the_sharded_report(fsdp_run):
    out, r = fsdp_run
    assert "(tuned for local)" in r.stdout and "fsdp; FastML residuals" in r.stdout
    for name in ("plan.json", "report.html", "report.md", "trials.csv", "options.csv", "sharded.csv",
                 "whatif.csv"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    params = _params()
    plan = Plan.load(out / "plan.json")
    plan.check_parameters(params)
    meta = json.loads((out / "plan.json").read_text())["meta"]
    assert meta["sharding"]["kind"] == "fsdp" and "uncompressed_fsdp" in meta
    # the residual memory the report states is what the plan file implies (unsharded, FSDP)
    sd = pd.read_csv(out / "sharded.csv").set_index("option")
    local = sd.loc["local"]
    want = _residual_of(plan, params) if meta["recommendation"].startswith("fastml_strategy.fsdp") else 0
    assert local["residual_MiB_per_rank"] * 2 ** 20 == pytest.approx(want)
    assert meta["predicted"]["residual_bytes_per_rank"] == want
    # FSDP's own state: fp32 parameter and gradient shards; the workload's SGD keeps no state
    padded = sum(shard_chunks(list(p.shape), 2)[1] for p in params.values())
    assert local["fsdp_state_MiB_per_rank"] * 2 ** 20 == pytest.approx(8 * padded)
    # every unit is a child of the root Sequential: all-gathered in forward and again in backward
    assert local["allgather_MB"] * 1e6 == pytest.approx(2 * (2 - 1) * padded * 4)
    assert local["own_reduce_scatter_MB"] * 1e6 == pytest.approx((2 - 1) * padded * 4)
    assert (sd["tuned_allreduce_MB"] == 0).all() and (sd["replicas"] == 1).all()
    assert list(sd["shard_group"]) == [2, 8, 16]  # FSDP shards over every rank
    trials = pd.read_csv(out / "trials.csv")
    assert {"allgather_bytes", "reduce_scatter_bytes", "residual_bytes", "state_bytes"} <= set(trials)
    assert set(trials["kind"]) == {"fastml", "fsdp-own"}
    assert trials["choice"].str.contains("rbf16").any()  # bf16-residual options were searched


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_fsdp_what_if_grid_and_documents(fsdp_run):
    out, _ = fsdp_run
    wi = pd.read_csv(out / "whatif.csv")
    assert len(wi) == 3 * len(WHATIF_NODES) * len(WHATIF_RANKS_PER_NODE)
    assert (wi["ranks"] == wi["nodes"] * wi["ranks_per_node"]).all()
    assert ((wi["speedup"] - wi["own_ms"] / wi["tuned_ms"]).abs() < 1e-9).all()
    # FSDP state shrinks with the shard group; FastML's (unsharded) residuals do not
    local = wi[wi["option"] == "local"].sort_values("ranks")
    assert local["fsdp_state_MiB_per_rank"].is_monotonic_decreasing
    assert local["residual_MiB_per_rank"].nunique() == 1
    html = (out / "report.html").read_text()
    for section in ("Sharded training (FSDP): bytes and memory per rank", "What if: other cluster shapes",
                    "vs FSDP&#x27;s own collectives"):
        assert section in html, section
    assert html.count('src="data:image/png;base64,') >= 8
    md = (out / "report.md").read_text()
    assert "## Sharded training (FSDP)" in md and "## What if" in md and "whatif.csv" in md


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_hsdp_run_respects_the_residual_limit(hsdp_run):
    out, _ = hsdp_run
    limit = LIMIT_GB * 2 ** 30
    trials = pd.read_csv(out / "trials.csv")
    fastml = trials[trials["kind"] == "fastml"]
    assert (fastml["residual_bytes"] > limit).any()  # the limit binds on this model...
    assert not fastml[fastml["residual_bytes"] > limit]["feasible"].any()  # ...and rules those out
    options = pd.read_csv(out / "options.csv").set_index("option")
    assert options.loc["local", "nodes"] == 2 and options.loc["local", "ranks"] == 4
    params = _params()
    plan = Plan.load(out / "plan.json")
    meta = json.loads((out / "plan.json").read_text())["meta"]
    assert meta["sharding"] == {"kind": "hsdp", "ranks_per_node": 2, "param_dtype": "bf16",
                                "reduce_dtype": "bf16", "reshard_after_forward": True}
    # HSDP keeps residuals of the shard only (S = 2)
    hsdp_residual = _residual_of(plan, params, shard=2)
    assert meta["predicted"]["residual_bytes_per_rank"] == hsdp_residual <= limit
    sd = pd.read_csv(out / "sharded.csv").set_index("option")
    assert sd.loc["local", "replicas"] == 2 and sd.loc["local", "shard_group"] == 2
    assert sd.loc["cheap-eth", "shard_group"] == 1 and sd.loc["cheap-eth", "allgather_MB"] == 0
    # bf16 all-gathers inside the node: forward and backward, (S-1) padded shards of 2 bytes
    padded = sum(shard_chunks(list(p.shape), 2)[1] for p in params.values())
    assert sd.loc["local", "allgather_MB"] * 1e6 == pytest.approx(2 * 1 * padded * 2)
    # HSDP's own cross-node all-reduce of the bf16 shard: 2(R-1)/R of it
    assert sd.loc["local", "own_allreduce_MB"] * 1e6 == pytest.approx(2 * (2 - 1) / 2 * padded * 2)
    md = (out / "report.md").read_text()
    assert "## Sharded training (HSDP)" in md and "--max-residual-gb" in md


def test_help_explains_the_sharding_options():
    text = build_parser().format_help()
    for opt in ("--sharding", "--ranks-per-node", "--param-dtype", "--reduce-dtype", "--max-residual-gb",
                "--intra-node-link", "--no-reshard-after-forward"):
        assert opt in text
    assert "LOCAL_WORLD_SIZE" in text


# -- errors: exit 2, one line naming the option and the fix, nothing written --------------------------------
BAD = [
    ("sharding", ["--sharding", "zero"], "--sharding 'zero'", "use ddp"),
    ("rpn-ddp", ["--ranks-per-node", "2"], "--ranks-per-node", "add --sharding fsdp"),
    ("dtype-ddp", ["--param-dtype", "bf16"], "--param-dtype", "add --sharding"),
    ("reshard-ddp", ["--no-reshard-after-forward"], "--no-reshard-after-forward", "add --sharding"),
    ("limit-ddp", ["--max-residual-gb", "1"], "--max-residual-gb", "add --sharding"),
    ("rpn-zero", ["--sharding", "hsdp", "--ranks-per-node", "0"], "--ranks-per-node=0",
     "whole number >= 1"),
    ("hsdp-needs-rpn", ["--sharding", "hsdp", "--world-size", "4", "--link", "1gbit"],
     "give --ranks-per-node S", "LOCAL_WORLD_SIZE"),
    ("rpn-divides", ["--sharding", "hsdp", "--world-size", "4", "--ranks-per-node", "3"],
     "--ranks-per-node 3 does not divide the world size 4", "give a divisor of 4"),
    ("param-dtype", ["--sharding", "fsdp", "--param-dtype", "fp8"], "--param-dtype 'fp8'",
     "use fp32 or bf16"),
    ("reduce-dtype", ["--sharding", "fsdp", "--reduce-dtype", "fp16"], "--reduce-dtype 'fp16'",
     "use fp32 or bf16"),
    ("intra-link", ["--sharding", "hsdp", "--intra-node-link", "fast"], "--intra-node-link 'fast'",
     "write e.g. 200gbit"),
    ("limit-zero", ["--sharding", "fsdp", "--max-residual-gb", "0"], "--max-residual-gb is 0.0", "> 0"),
    ("limit-nan", ["--sharding", "fsdp", "--max-residual-gb", "nan"], "--max-residual-gb is nan", "> 0"),
]


@pytest.mark.parametrize("name, argv, arg, fix", BAD, ids=[b[0] for b in BAD])
def test_bad_sharding_arguments(tmp_path, capsys, name, argv, arg, fix):
    out = tmp_path / "o"
    assert main([TARGET, *argv, "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fastml-autotune: error: ") and len(err.splitlines()) == 1, err
    assert arg in err and fix in err, err
    assert not out.exists()


def test_the_limit_must_be_a_number(capsys):
    with pytest.raises(SystemExit) as e:  # argparse: a float option names itself too
        main([TARGET, "--sharding", "fsdp", "--max-residual-gb", "lots"])
    assert e.value.code == 2 and "--max-residual-gb" in capsys.readouterr().err
