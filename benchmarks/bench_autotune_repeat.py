"""The same ``fastml-autotune`` command run several times: does it give the same answer? (issue 38)

Issue 38: ``fastml-autotune <gpt> --link 50mbit --world-size 2`` with its defaults gave an
int4/int6/int8 mix in one run and fp32 for all 54 tensors in the next (same commit, same seed). This
script runs the tuner ``--repeats`` times per workload, one process per run as that command does
(``--link``: the link is modelled, not measured), and tabulates per run the plan's family
(``meta.family``: quantized, top-k, 16-bit, plain DDP, local steps), its codecs, its predicted step
and time to the target against uniform int4's (``trials.csv``), the check's verdict, the accuracy
rule's ``e_max``, the tuner's wall time, and the machine's load before and after.

``--train`` then trains each distinct plan.json beside uniform int4 (2 gloo ranks, side by side in
the same two processes, from the same weights; ``bench_autotune.train_to_target``) inside an emulated
link: a network namespace named ``PREFIX-PID`` whose loopback is shaped with ``tc tbf`` (root), as
``bench_autotune.py`` does. Both train ``--max-steps`` (3 x ``--steps``); int4's validation loss after
``--steps`` is the reference. Its rows: ms per step of each and their ratio, the tuned plan's loss
against the reference at equal steps and at equal time (its curve at int4's clock), and its time to
the reference loss over int4's (done when: tuned <= 1.05x int4's step, loss <= +2%).

Workloads: ``gpt`` (``gpt_workload.make``: 4 blocks of d=256), ``gpt2`` (``make2``: 6 of 192),
``gpt3`` (``make3``: 3 of 320).

Usage::

    python benchmarks/bench_autotune_repeat.py --workloads gpt,gpt2,gpt3 --repeats 3 \\
        --tuner-args --calibration-trials 3 --calibration-repeats 0 --verify-rounds 1 --budget 12 --trials 100
    python benchmarks/bench_autotune_repeat.py --collect OUT_DIR ...   # tabulate runs already made
    sudo python benchmarks/bench_autotune_repeat.py --collect OUT_DIR --train --steps 30
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
FACTORY = {"gpt": "make", "gpt2": "make2", "gpt3": "make3"}


def tune(workload: str, out: Path, link: str, tuner_args: list[str]) -> dict:
    """One tuner run (one process, ``--link``): its wall time and the load before and after."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "fastml_strategy.autotune.cli",
           f"{REPO / 'benchmarks' / 'gpt_workload.py'}:{FACTORY[workload]}", "--link", link,
           "--world-size", "2", "--out", str(out), "--quiet", "--overwrite", *tuner_args]
    before, t0 = os.getloadavg()[0], time.time()
    subprocess.run(cmd, check=True, env=env, cwd=REPO)
    return {"tune_s": round(time.time() - t0), "load": f"{before:.1f}-{os.getloadavg()[0]:.1f}"}


def row_of(workload: str, run: int, out: Path, extra: dict) -> dict:
    """A table row from one run's outputs (plan.json, trials.csv)."""
    plan = json.loads((out / "plan.json").read_text())
    meta = plan.get("meta", {})
    codecs = Counter(_describe(v) for v in plan["layers"].values())
    with open(out / "trials.csv") as f:
        trials = [r for r in csv.DictReader(f) if r["option"] == "local"]
    int4 = next((r for r in trials if r.get("kind") == "fastml" and r.get("every", "1") == "1"
                 and set(json.loads(r["choice"]).values()) == {"int4"}), None)
    pred = meta.get("predicted") or {}
    chk = meta.get("checked_against_uniform") or {}
    return {"workload": workload, "run": run, "family": meta.get("family", ""),
            "plan": ", ".join(f"{k} x{n}" for k, n in codecs.most_common()),
            "local_steps": json.dumps(plan.get("local_steps")) if plan.get("local_steps") else "",
            "bucket_cap_mb": (meta.get("ddp") or {}).get("bucket_cap_mb") or "",
            "predicted_step_ms": round(1e3 * pred["step_s"], 1) if pred.get("step_s") else "",
            "int4_predicted_step_ms": round(1e3 * float(int4["step_s"]), 1) if int4 else "",
            "predicted_tta_over_int4": (round(float(pred["tta_s"]) / float(int4["tta_s"]), 3)
                                        if int4 and pred.get("tta_s") else ""),
            "check": chk.get("verdict", ""), "decision": (chk.get("decision") or {}).get("chosen", ""),
            "replaced": chk.get("replaced") or "", "e_max": (meta.get("accuracy_rule") or {}).get("e_max", ""),
            "out": str(out), **extra}


def _describe(cfg: dict) -> str:
    from fastml_strategy.config import CodecConfig

    return CodecConfig.from_dict(cfg).describe()


def train_rows(rows: list[dict], steps: int, link: str, max_steps: int | None = None) -> list[dict]:
    """Each distinct plan.json of a workload trained beside uniform int4 (inside the emulated link).

    Both train ``max_steps`` (default 3 x ``steps``); int4's loss at ``steps`` is the reference. Per
    plan: the step-time ratio, the loss at equal steps, the loss at equal time (the tuned plan's curve
    at int4's clock), and the time to int4's loss (the tuner's objective: a plan with cheaper, noisier
    steps may need more of them), each from the evaluated curve, interpolated between evaluations.
    """
    import bench_autotune as ba

    max_steps = max_steps or 3 * steps
    out = []
    for wl in sorted({r["workload"] for r in rows}):
        seen: dict[str, dict] = {}
        for r in (r for r in rows if r["workload"] == wl):
            key = (Path(r["out"]) / "plan.json").read_text()
            key = json.dumps(json.loads(key)["layers"], sort_keys=True)
            if key in seen:
                r.update({k: v for k, v in seen[key].items() if k.startswith("trained_")},
                         trained_same_plan_as_run=seen[key]["run"])
                continue
            load0 = os.getloadavg()[0]
            plans = [("tuned", str(Path(r["out"]) / "plan.json"), r["bucket_cap_mb"] or None),
                     ("int4", "int4", None)]
            res = ba.train_to_target(wl, plans, target=-1.0, max_steps=max_steps, eval_every=5,
                                     timing_steps=max_steps)
            r.update(trained_compare(res["tuned"], res["int4"], steps),
                     trained_load=f"{load0:.1f}-{os.getloadavg()[0]:.1f}", trained_link=link)
            seen[key] = r
        out += [r for r in rows if r["workload"] == wl]
    return out


def trained_compare(t: dict, i: dict, steps: int) -> dict:
    """The ``trained_*`` columns from two results of ``train_to_target`` (lower loss is better)."""
    ref_s, ref_loss = _interp(i["curve"], 0, steps, 1), _interp(i["curve"], 0, steps, 2)
    tuned_loss = _interp(t["curve"], 0, steps, 2)
    at_time = _interp(t["curve"], 1, ref_s, 2)
    reach = _first_below(t["curve"], ref_loss)
    return {"trained_steps": steps, "trained_max_steps": t["curve"][-1][0],
            "trained_tuned_ms": round(t["ms_per_step"], 1), "trained_int4_ms": round(i["ms_per_step"], 1),
            "trained_step_ratio": round(t["ms_per_step"] / i["ms_per_step"], 3),
            "trained_tuned_loss": round(tuned_loss, 4), "trained_int4_loss": round(ref_loss, 4),
            "trained_loss_vs_int4_pct": round(100 * (tuned_loss / ref_loss - 1), 2),
            "trained_loss_at_int4_time_pct": "" if at_time is None else round(100 * (at_time / ref_loss - 1), 2),
            "trained_time_to_int4_loss_ratio": "" if reach is None else round(reach / ref_s, 3)}


def _interp(curve: list, x: int, at: float, y: int) -> float | None:
    """Column ``y`` of ``curve`` at ``at`` in column ``x`` (linear between points; None past the end)."""
    prev = (0.0, 0.0, None)
    for pt in curve:
        if pt[x] >= at:
            if prev[y] is None or pt[x] == prev[x]:
                return pt[y]
            f = (at - prev[x]) / (pt[x] - prev[x])
            return prev[y] + f * (pt[y] - prev[y])
        prev = pt
    return None


def _first_below(curve: list, loss: float) -> float | None:
    """Seconds at which ``curve`` first reaches ``loss`` (linear between evaluations), or None."""
    prev = None
    for pt in curve:
        if pt[2] <= loss:
            if prev is None:
                return pt[1]
            f = (prev[2] - loss) / (prev[2] - pt[2])
            return prev[1] + f * (pt[1] - prev[1])
        prev = pt
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="gpt,gpt2,gpt3")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--link", default="50mbit")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "out" / "autotune_repeat"))
    p.add_argument("--collect", default=None, help="tabulate WORKLOAD_rN folders already made under this one")
    p.add_argument("--train", action="store_true", help="train each distinct plan beside int4 (root: netns)")
    p.add_argument("--steps", type=int, default=30, help="--train: int4's loss after this many steps is the "
                   "reference")
    p.add_argument("--max-steps", type=int, default=None, help="--train: steps per plan (default 3 x --steps)")
    p.add_argument("--netns-prefix", default="fastml-rep")
    p.add_argument("--csv", default=None)
    p.add_argument("--tuner-args", nargs=argparse.REMAINDER, default=[])
    p.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.train and not args.inner and os.geteuid() == 0:  # re-run inside a shaped namespace
        ns = f"{args.netns_prefix}-{os.getpid()}"
        run = lambda *c: subprocess.run(list(c), check=True)  # noqa: E731
        run("ip", "netns", "add", ns)
        try:
            run("ip", "-n", ns, "link", "set", "lo", "up")
            run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", args.link,
                "burst", "512kb", "latency", "100ms")
            subprocess.run(["ip", "netns", "exec", ns, sys.executable, __file__, "--inner", *sys.argv[1:]],
                           check=True)
        finally:
            subprocess.run(["ip", "netns", "del", ns], check=False)
        return
    wls = args.workloads.split(",")
    rows = []
    for wl in wls:
        for n in range(1, args.repeats + 1):
            if args.collect:
                out = Path(args.collect) / f"{wl}_r{n}"  # the folders tune() writes
                log = out.with_suffix(".log")
                extra = {"log": log.read_text().split("\n")[0] if log.exists() else ""}
            else:
                out = Path(args.out) / f"{wl}_r{n}"
                extra = tune(wl, out, args.link, args.tuner_args)
            extra["tuner_args"] = " ".join(args.tuner_args) or "(defaults)"
            if (out / "plan.json").exists():
                rows.append(row_of(wl, n, out, extra))
    if args.train:
        rows = train_rows(rows, args.steps, args.link, args.max_steps)
    import _bench
    from tabulate import tabulate

    path = Path(args.csv or _bench.default_csv(f"bench_autotune_repeat_{args.link}_cpu.csv", documented=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    _bench.write_csv(path, rows)
    cols = ["workload", "run", "family", "plan", "decision", "predicted_step_ms", "int4_predicted_step_ms",
            "predicted_tta_over_int4", "trained_step_ratio", "trained_loss_vs_int4_pct",
            "trained_loss_at_int4_time_pct", "trained_time_to_int4_loss_ratio"]
    print(tabulate([[r.get(c, "") for c in cols] for r in rows], headers=cols, tablefmt="github"))
    print(f"{_bench.machine_line()}; wrote {path}")


if __name__ == "__main__":
    main()
