"""The report's data: every table as a pandas DataFrame, built from an
:class:`~fastml_strategy.autotune.result.AutotuneResult` (:func:`tables`: the CSV files' contents, in
plain numbers: seconds, hours, USD), and the display tables the report shows beside them (human
units). Nothing here draws or writes.
"""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any, Mapping

import pandas as pd

from fastml_strategy.autotune.costmodel import CANDIDATES
from fastml_strategy.config import CodecConfig
from fastml_strategy.autotune.result import uses_local_steps
from fastml_strategy.autotune.report.words import (_base, _local_words, _ms, _per_step_words, _plan_words,
                                                   _point_stretch, _saving, _short, human_money, human_time)

if TYPE_CHECKING:
    from fastml_strategy.autotune.result import AutotuneResult


def bits_per_element(cfg: CodecConfig, numel: int) -> float:
    """Bits one element costs in the encoded message (values, metadata, indices and alignment), as
    the codec sizes it (``codecs.chunk_nbytes``)."""
    from fastml_strategy.codecs import chunk_nbytes

    return 8.0 * chunk_nbytes(numel, cfg) / numel if numel > 0 else 0.0


def _sparsity(cfg: CodecConfig, numel: int) -> float:
    from fastml_strategy.codecs import codec_for

    return 1.0 - codec_for(cfg).density(numel) if numel > 0 else 0.0


# -- tables --------------------------------------------------------------------------------------------
def tables(result: "AutotuneResult") -> dict[str, pd.DataFrame]:
    """Every table of the report by name, in plain numbers (seconds, hours, USD): the CSV files."""
    out = {"layers": _layer_rows(result), "trials": _choice_as_json(result.trials),
           "calibration": _choice_as_json([{k: v for k, v in r.items() if k != "losses"}
                                           for r in result.calibration]),
           "step_times": pd.DataFrame(result.step_times),
           "scaling": pd.DataFrame(result.scaling),
           "options": pd.DataFrame([_option_row(result, o) for o in result.options])}
    if result.local_calibration is not None:
        out["local_steps"] = _local_rows(result)
    if result.sharding.sharded:
        out["sharded"] = pd.DataFrame([_sharded_row(result, o) for o in result.options])
        out["whatif"] = pd.DataFrame(result.whatif)
    return out


def _choice_as_json(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Result rows as a table, each row's codec choice (a dict) as one JSON column."""
    return pd.DataFrame([{**{k: v for k, v in r.items() if k != "choice"}, "choice": json.dumps(r["choice"])}
                         for r in rows])


def _layer_rows(result: "AutotuneResult") -> pd.DataFrame:
    """layers.csv: per parameter, plan.json's codec with its bits, sparsity and error, every option's
    codec, and the profiled error and codec time of every codec option."""
    from fastml_strategy.autotune.search import expand

    prof = result.profile
    group_of = {n: g for g, names in result.groups.items() for n in names}
    # what each option's plan file holds: its winner (local steps' codecs when they win)
    choice_by_opt = {o: expand(result.groups, result.winner(o)["choice"]) for o in result.best}
    layer_rows = []
    for lp in prof.layers:
        o = choice_by_opt[result.option].get(lp.name, "none") if lp.tunable else "none"
        cfg = CANDIDATES[o]
        row: dict[str, Any] = {
            "name": lp.name, "numel": lp.numel, "tunable": lp.tunable, "group": group_of.get(lp.name, ""),
            "grad_ready_ms": 1e3 * lp.ready_s, "grad_norm": math.sqrt(lp.grad_sq),
            "codec": o, "bits_per_element": bits_per_element(cfg, lp.numel),
            "sparsity": _sparsity(cfg, lp.numel), "rel_error": lp.rel_error.get(o, 0.0),
        }
        for opt_name, ch in choice_by_opt.items():
            row[f"codec@{opt_name}"] = ch.get(lp.name, "none") if lp.tunable else "none"
        for opt in prof.options:
            row[f"err[{opt}]"] = lp.rel_error.get(opt, 0.0)
        for opt in prof.options:
            row[f"codec_ms[{opt}]"] = 1e3 * lp.codec_s.get(opt, 0.0)
        layer_rows.append(row)
    return pd.DataFrame(layer_rows)


def _option_row(result: "AutotuneResult", o: Any) -> dict[str, Any]:
    """options.csv: one hardware option, its tuned plan against the uncompressed baseline."""
    bp, _ = _base(result)
    sh = result.sharding
    b, d = result.best[o.name], result.baseline[o.name]
    use = "FastML plan" if b.get("use_hook", True) else (
        "plain DDP" if not sh.sharded else f"{sh.kind.upper()} alone")
    from fastml_strategy.autotune.costmodel import ddp_topology

    # DDP: the schedule the hook runs and the cost model priced (hierarchical on several machines of
    # several ranks: reduce-scatter inside each machine, compressed across, all-gather inside)
    schedule = ddp_topology(o.nodes, o.accelerators_per_node) if not sh.sharded else sh.kind
    return {
        "option": o.name, "use": use,
        "nodes": o.nodes, "ranks": o.ranks, "ranks_per_node": o.accelerators_per_node,
        "schedule": schedule, "price_per_node_hour": o.price_per_hour,
        "link": o.link.describe(), "compute_speed": o.compute_speed,
        "tuned_step_ms": 1e3 * b["step_s"], f"{bp}_step_ms": 1e3 * d["step_s"],
        "tuned_error": b["error"], "tuned_extra_steps_pct": 100 * (b["g"] - 1),
        "tuned_hours": b["tta_s"] / 3600, f"{bp}_hours": d["tta_s"] / 3600,
        "tuned_cost_usd": b["cost_usd"], f"{bp}_cost_usd": d["cost_usd"],
        f"speedup_vs_{bp}": d["tta_s"] / b["tta_s"] if b["tta_s"] > 0 else float("nan"),
    }


def _sharded_row(result: "AutotuneResult", o: Any) -> dict[str, Any]:
    """sharded.csv: one hardware option's bytes per rank per step and memory per rank."""
    sh = result.sharding
    b, d = result.best[o.name], result.baseline[o.name]
    shard = o.accelerators_per_node if sh.kind == "hsdp" else o.ranks
    return {
        "option": o.name, "nodes": o.nodes, "ranks_per_node": o.accelerators_per_node,
        "shard_group": shard, "replicas": o.nodes if sh.kind == "hsdp" else 1,
        "allgather_MB": b["allgather_bytes"] / 1e6,
        "tuned_reduce_scatter_MB": b["reduce_scatter_bytes"] / 1e6,
        "tuned_allreduce_MB": b["allreduce_bytes"] / 1e6,
        "own_reduce_scatter_MB": d["reduce_scatter_bytes"] / 1e6,
        "own_allreduce_MB": d["allreduce_bytes"] / 1e6,
        "residual_MiB_per_rank": b["residual_bytes"] / 2 ** 20,
        "fsdp_state_MiB_per_rank": b["state_bytes"] / 2 ** 20,
        "residual_pct_of_state": (100.0 * b["residual_bytes"] / b["state_bytes"]
                                  if b["state_bytes"] else 0.0),
    }


def _local_rows(result: "AutotuneResult") -> pd.DataFrame:
    """local_steps.csv: per option, per-step compression against the best local-steps configuration
    (plain numbers: hours, USD; ``saves_*``: what the winner saves against the other mode)."""
    rows = []
    for o in result.options:
        b, lb = result.best[o.name], result.local_best.get(o.name)
        nan = float("nan")
        row: dict[str, Any] = {
            "option": o.name, "link_gbps": o.link.bandwidth_Bps * 8 / 1e9,
            "per_step_plan": "tuned" if b.get("use_hook", True) else "plain-ddp",
            "per_step_step_ms": 1e3 * b["step_s"], "per_step_hours": b["tta_s"] / 3600,
            "per_step_cost_usd": b["cost_usd"], "per_step_MB_per_step": b["bytes_per_rank"] / 1e6,
            "local_every": nan, "local_fragments": nan, "local_delay": nan, "local_stretch": nan,
            "local_step_ms": nan, "local_hours": nan, "local_cost_usd": nan, "local_MB_per_step": nan,
            "winner": "per-step", "saves_hours": nan, "saves_usd": nan,
        }
        if lb is not None:
            row.update(local_every=int(lb["every"]), local_fragments=int(lb["fragments"]),
                       local_delay=int(lb["delay"]), local_stretch=lb["stretch"],
                       local_step_ms=1e3 * lb["step_s"], local_hours=lb["tta_s"] / 3600,
                       local_cost_usd=lb["cost_usd"], local_MB_per_step=lb["bytes_per_rank"] / 1e6)
            win = uses_local_steps(result.winner(o.name))
            w, other = (lb, b) if win else (b, lb)
            row.update(winner="local-steps" if win else "per-step",
                       saves_hours=(other["tta_s"] - w["tta_s"]) / 3600,
                       saves_usd=other["cost_usd"] - w["cost_usd"])
        rows.append(row)
    return pd.DataFrame(rows)


def _local_table(result: "AutotuneResult") -> pd.DataFrame:
    """The comparison in human units, one row per option."""
    rows = []
    for o in result.options:
        b, lb = result.best[o.name], result.local_best.get(o.name)
        priced = o.price_per_hour > 0

        def tc(r: Mapping[str, Any]) -> str:
            return human_time(r["tta_s"]) + (f", {human_money(r['cost_usd'])}" if priced else "")

        row = {"option": o.name + (" (plan.json)" if o.name == result.option else ""),
               "link": o.link.rate_words(),
               "per-step compression": f"{_per_step_words(result, o.name)}: {tc(b)}",
               "local steps": "none within the accuracy limit", "winner": "per-step compression",
               "by": "-"}
        if lb is not None:
            win = uses_local_steps(result.winner(o.name))
            row["local steps"] = (f"{_local_words(lb)}: {tc(lb)} ({_ms(lb['step_s'])}/step, "
                                  f"{lb['stretch']:.2f}x steps)")
            row["winner"] = "local steps" if win else "per-step compression"
            row["by"] = _saving(result, o.name, lb, b) if win else _saving(result, o.name, b, lb)
        rows.append(row)
    return pd.DataFrame(rows)


def search_expand(result: "AutotuneResult") -> dict[str, str]:
    """plan.json's layer -> codec option."""
    from fastml_strategy.autotune.search import expand

    return expand(result.groups, result.winner(result.option)["choice"])


def _options_table(result: "AutotuneResult") -> pd.DataFrame:
    """One row per hardware option in human units, narrow enough for a page (options.csv has the
    numbers)."""
    short = _short(result)
    rows = []
    for o in result.options:
        b, d = result.best[o.name], result.baseline[o.name]
        use = "tuned plan" if b.get("use_hook", True) else (
            "plain DDP" if not result.sharding.sharded else f"{short} alone")
        priced = o.price_per_hour > 0
        rows.append({
            "option": o.name + (" (plan.json)" if o.name == result.option else ""),
            "use": use,
            "cluster": f"{o.nodes} x {o.accelerators_per_node} ranks; {o.link.describe()}",
            "price per node-hour": human_money(o.price_per_hour) if priced else "none (yours)",
            f"step: tuned / {short}": f"{_ms(b['step_s'])} / {_ms(d['step_s'])}",
            f"time to target: tuned / {short}": f"{human_time(b['tta_s'])} / {human_time(d['tta_s'])}",
            f"cost: tuned / {short}": (f"{human_money(b['cost_usd'])} / {human_money(d['cost_usd'])}"
                                       if priced else "-"),
            "speedup": f"{d['tta_s'] / b['tta_s']:.2f}x" if b["tta_s"] > 0 else "n/a",
        })
    return pd.DataFrame(rows)


def _front_table(t: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    tr = t["trials"]
    front = tr[tr["pareto"]].sort_values("tta_s") if len(tr) else tr
    return pd.DataFrame([{"option": r["option"],
                          "plan": f"trial {int(r['trial'])}" if r.get("kind") == "fastml" else "uncompressed",
                          "time to target": human_time(r["tta_s"]), "cost": human_money(r["cost_usd"]),
                          "gradient error": f"{r['error']:.3g}", "step": _ms(r["step_s"])}
                         for _, r in front.iterrows()])


def _step_table(t: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    st = t["step_times"]
    return pd.DataFrame([{"plan": r["plan"], "predicted": _ms(r["predicted_s"]), "measured": _ms(r["measured_s"]),
                          "error": f"{r['error_pct']:+.1f}%",
                          "used in a fit": "yes" if r.get("used_in_fit") else "no"}
                         for _, r in st.iterrows()])


def _whatif_pivot(t: Mapping[str, pd.DataFrame]) -> pd.DataFrame:
    """The what-if grid as one row per (option, nodes), a column per ranks-per-node count: 'tuned ms
    (speedup)'."""
    wi = t["whatif"]
    rows = []
    for (opt, n), g in wi.groupby(["option", "nodes"], sort=False):
        row: dict[str, Any] = {"option": opt, "nodes": n}
        for _, r in g.iterrows():
            row[f"{int(r['ranks_per_node'])}/node"] = f"{r['tuned_ms']:.3g} ms ({r['speedup']:.2f}x)"
        rows.append(row)
    return pd.DataFrame(rows)


def _stretch_table(result: "AutotuneResult") -> pd.DataFrame:
    """One row per calibration run: plan, seed, error, accuracy loss, stretch with its interval, and
    what that says."""
    rows = []
    for p in sorted(result.calibration, key=lambda p: (p["error"], p.get("seed", 0))):
        st = _point_stretch(p)
        if p.get("pruned"):
            said = f"pruned (more than {p['ratio']:.3g}x behind): a lower bound, failing the accuracy limit"
        elif st is None:
            said = f"{p['ratio']:.3g}x (stored without an interval by an older version)"
        else:
            said = st.verdict()
        acc = p["accuracy_loss"]
        raw, allow = p.get("accuracy_loss_raw"), p.get("accuracy_allowance") or 0.0
        acc_words = f"{acc:+.3g}" if math.isfinite(acc) else "n/a"
        if raw is not None and math.isfinite(raw) and allow > 0:
            acc_words += f" ({raw:+.3g} at the end; a delay within its interval explains {allow:.3g})"
        rows.append({"run": _plan_words(p["choice"]), "seed": int(p.get("seed", 0)),
                     "error": f"{p['error']:.3g}",
                     "accuracy loss": acc_words,
                     "stretch (95% interval)": st.interval_words() if st is not None else f"{p['ratio']:.3g}x",
                     "g(e) of the fit": f"{result.convergence.g(p['error']):.3g}" if math.isfinite(p["error"]) else "n/a",
                     "what it says": said})
    return pd.DataFrame(rows)
