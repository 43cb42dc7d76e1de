"""The outputs: plan.json, report.html (self-contained, plots embedded as base64 PNG), report.md and CSV
tables, every file written atomically (``fastml_strategy._io``), so a crash never leaves half a report.

The report opens with its answer in words (:func:`headline`): which plan on which option, or plain
DDP when no compression pays, with the predicted saving in time and money for the training length the
user gave (or an assumed one, said so). Times and money read in human units (ms, s, min, h, days; $);
the CSV tables keep plain numbers (seconds, hours, USD) for other tools.

With local steps searched (the default for DDP), a table, a CSV (``local_steps.csv``) and a figure
set per-step compression (the tuned plan, or plain DDP where no compression pays) against the best
:class:`~fastml_strategy.LocalSGD` configuration per option, and say which wins and by how much in
hours and dollars; the headline and the command's last line name the winner of plan.json's option.

Plots use matplotlib's object-oriented API with the Agg canvas (no pyplot, so the user's backend and
global figure state are untouched). Legends sit outside the axes and labels are on axes, not beside
points, so nothing overlaps at any number of plans or options.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pandas as pd

from fastml_strategy._io import atomic_open, atomic_write_text
from fastml_strategy.autotune.costmodel import CANDIDATES, FIT_SE_FLOOR
from fastml_strategy.config import CodecConfig

from fastml_strategy.autotune.result import TARGET_STEPS_SOURCES, uses_local_steps

if TYPE_CHECKING:
    from fastml_strategy.autotune._settings import Settings
    from fastml_strategy.autotune.result import AutotuneResult

__all__ = ["write_outputs", "bits_per_element", "headline", "winner_line", "human_time", "human_money",
           "phase_words",
           "OUTPUT_FILES"]

OUTPUT_FILES = ("plan.json", "report.html", "report.md", "trials.csv", "layers.csv", "calibration.csv",
                "step_times.csv", "scaling.csv", "options.csv")
SHARDED_FILES = ("sharded.csv", "whatif.csv")  # written by --sharding fsdp|hsdp runs only
LOCAL_FILES = ("local_steps.csv",)  # written when local steps were searched


def _base(result: "AutotuneResult") -> tuple[str, str]:
    """(column prefix, words) of the uncompressed baseline: DDP's all-reduce or FSDP/HSDP's own."""
    sh = result.sharding
    if not sh.sharded:
        return "ddp", "uncompressed DDP"
    return sh.kind, f"{sh.kind.upper()}'s own collectives"


def _short(result: "AutotuneResult") -> str:
    """The baseline's short name in labels: DDP, FSDP or HSDP."""
    bp, _ = _base(result)
    return "DDP" if bp == "ddp" else bp.upper()


def human_time(seconds: float) -> str:
    """A duration as a person reads it: 850 ms, 42 s, 37 min, 5.2 h, 3.1 days."""
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return "n/a"
    for limit, div, unit in ((1.0, 1e-3, "ms"), (90.0, 1.0, "s"), (90 * 60.0, 60.0, "min"),
                             (48 * 3600.0, 3600.0, "h"), (math.inf, 86400.0, "days")):
        if seconds < limit:
            v = seconds / div
            return f"{v:,.0f} {unit}" if v >= 100 else f"{v:.3g} {unit}"
    return "n/a"  # unreachable


def human_money(usd: float) -> str:
    """Dollars as a person reads them: $0, under $0.001, $0.0412, $12.34, $1,234."""
    if not isinstance(usd, (int, float)) or not math.isfinite(usd):
        return "n/a"
    if usd == 0:
        return "$0"
    if usd < 0.001:
        return "under $0.001"
    if usd < 1:  # three figures, so that $0.0412 and $0.0425 differ
        return f"${usd:.3g}"
    return f"${usd:,.2f}" if usd < 1000 else f"${usd:,.0f}"


def _pct(v: float) -> str:
    """A percentage without scientific notation: 0%, 0.31%, 4.2%, 77%, 130%."""
    if abs(v) < 0.01:
        return "0%"
    return f"{v:.2g}%" if abs(v) < 10 else f"{v:,.0f}%"


def _steps_more(g: float, what: str) -> str:
    """'4.2% more steps' / '0.46% fewer steps' / 'no more steps' for a step factor ``g`` (1 = the
    same steps), followed by ``what``."""
    pct = 100 * (g - 1)
    if abs(pct) < 0.01:
        return f"no more steps {what}".rstrip()
    return f"{_pct(abs(pct))} {'more' if pct > 0 else 'fewer'} steps {what}".rstrip()


# How to train with plan.json's per-step plan, by what the target was (Workload.kind)
_REGISTER_WORDS = {
    "trainer": "pass it to fastml_strategy.transformers.setup(trainer, plan=...) before trainer.train()",
    "lightning": "train with fastml_strategy.lightning.FastMLStrategy(plan=...)",
    "workload": "register it with fastml_strategy.register_hook(model, plan=...) or FASTML_PLAN",
}


def _register_words(result: "AutotuneResult") -> str:
    """The call that trains with plan.json's per-step plan, for this target."""
    if result.sharding.sharded:
        return "pass it to fastml_strategy.fsdp.register after fully_shard"
    return _REGISTER_WORDS.get(getattr(result, "target_kind", "workload"), _REGISTER_WORDS["workload"])


def _held_words(result: "AutotuneResult") -> str:
    """What plan.json's per-step plan is: the tuned plan, or the uniform plan the check put in its
    place ('uniform int4')."""
    c = result.check
    if c is not None and c.get("replaced") and c.get("option") == result.option:
        return str(c["replaced"])
    return "the tuned plan"


def _ms(seconds: float) -> str:
    return human_time(seconds) if seconds >= 1.0 else f"{1e3 * seconds:.3g} ms"


def _option(result: "AutotuneResult", name: str) -> Any:
    return next(o for o in result.options if o.name == name)


def _where(result: "AutotuneResult", name: str) -> str:
    """An option in words: your own cluster, or a catalog entry with its size and price."""
    o = _option(result, name)
    if o.price_per_hour == 0 and o.measured_link is not None:
        link = o.link
        how = "measured" if link.source == "measured" else "from --link"
        return f"your cluster ({o.ranks} ranks; link {link.rate_words()} with {link.latency_words()} per message, {how})"
    from fastml_strategy.autotune.costmodel import ddp_topology

    sched = ("" if result.sharding.sharded or o.accelerators_per_node == 1 or o.nodes == 1
             else f", {ddp_topology(o.nodes, o.accelerators_per_node)} all-reduce")
    return (f"{name} ({o.nodes} node{'s' if o.nodes != 1 else ''} x {o.accelerators_per_node}{sched}, "
            f"{human_money(o.price_per_hour)} per node-hour)")


def _best_compressed(result: "AutotuneResult", name: str) -> dict[str, Any] | None:
    """The best feasible compressed plan of an option, even where plain DDP beat it."""
    rows = [r for r in result.trials if r["option"] == name and r.get("kind") == "fastml"
            and r["feasible"] and math.isfinite(r["objective"])]
    return min(rows, key=lambda r: (r["objective"], r["error"])) if rows else None


def _steps_words(result: "AutotuneResult") -> str:
    return (f"{result.target_steps:,.0f} steps of uncompressed training "
            f"({TARGET_STEPS_SOURCES.get(result.target_steps_source, result.target_steps_source)})")


def _local_words(row: Mapping[str, Any]) -> str:
    """A LocalSGD configuration in words: H=50, F=4, delay 2."""
    return (f"H={int(row['every'])}" + (f", F={int(row['fragments'])}" if int(row["fragments"]) > 1 else "")
            + (f", delay {int(row['delay'])}" if int(row["delay"]) else ""))


def _per_step_words(result: "AutotuneResult", name: str) -> str:
    if not result.best[name].get("use_hook", True):
        return _baseline_words(result)
    return _held_words(result) if name == result.option else "the tuned plan"


def _saving(result: "AutotuneResult", name: str, win: Mapping[str, Any], lose: Mapping[str, Any]) -> str:
    """'1.9 h and $7.30 less (2.4x faster)': what the winner saves against the loser."""
    priced = _option(result, name).price_per_hour > 0
    dt = lose["tta_s"] - win["tta_s"]
    dm = lose["cost_usd"] - win["cost_usd"]
    parts = [f"{human_time(abs(dt))} {'less' if dt >= 0 else 'more'} time"]
    if priced:
        parts.append(f"{human_money(abs(dm))} {'less' if dm >= 0 else 'more'}")
    ratio = f" ({lose['tta_s'] / win['tta_s']:.2f}x as fast)" if win["tta_s"] > 0 else ""
    return " and ".join(parts) + ratio


def winner_line(result: "AutotuneResult") -> str:
    """One line: per-step compression or local steps on plan.json's option, and by how much."""
    name = result.option
    b, lb = result.best[name], result.local_best.get(name)
    priced = _option(result, name).price_per_hour > 0

    def cost(r: Mapping[str, Any]) -> str:
        return f"{human_time(r['tta_s'])}" + (f" and {human_money(r['cost_usd'])}" if priced else "")

    per_step = f"per-step compression ({_per_step_words(result, name)})"
    if lb is None:
        return (f"Winner on {name}: {per_step}, {cost(b)}; no local-steps period stayed within the "
                f"accuracy limit in calibration.")
    local = f"local steps ({_local_words(lb)})"
    if uses_local_steps(result.winner(name)):
        return f"Winner on {name}: {local}, {cost(lb)} against {cost(b)} with {per_step}: {_saving(result, name, lb, b)}."
    return f"Winner on {name}: {per_step}, {cost(b)} against {cost(lb)} with {local}: {_saving(result, name, b, lb)}."


def headline(result: "AutotuneResult") -> list[str]:
    """The answer, in words, first: what to do and what it saves. Markdown bold marks the verdict."""
    lines = [_verdict(result)]
    rent = _rent_words(result)
    if rent:
        lines.append(rent)
    c = result.check
    if c is not None and c.get("alternatives"):
        alts = " and ".join(e["plan"] for e in c["alternatives"])
        tuned = _baseline_words(result) if c.get("tuned_plain") else "the tuned plan"
        lines.append(f"Checked against {alts}, trained side by side with {tuned}: "
                     + (f"**{c['replaced']} reached the same loss sooner, so plan.json holds it.**"
                        if c.get("replaced") else f"{tuned} stands (see the check below)."))
    if c is not None and c.get("powersgd_faster"):
        lines.append(f"**{c['powersgd_faster']}** (see the check below).")
    lines.append(f"Times and costs are for {_steps_words(result)}, plus the extra steps each plan's "
                 f"compression error costs.")
    if result.link_warning:
        lines.append(f"**Warning: the measured link is not a network.** {result.link_warning}")
    return lines


def _baseline_words(result: "AutotuneResult") -> str:
    """The uncompressed baseline as the headline names it: plain DDP, or FSDP/HSDP's own collectives."""
    return "plain DDP" if not result.sharding.sharded else _base(result)[1]


def _intra_words(row: Mapping[str, Any]) -> str:
    """The hop inside each machine of a per-step row, in words ("" when exact or absent)."""
    v = row.get("intra_node")
    if not isinstance(v, str) or v == "none":
        return ""
    return (f"plan.json's intra_node sends the hop inside each machine in {v}: half its bytes, at one "
            f"rounding that error feedback does not correct, counted in the error")


def _verdict(result: "AutotuneResult") -> str:
    """What to run on plan.json's option (local steps, the tuned plan, or the uncompressed baseline)
    and what it saves against the baseline."""
    name = result.option
    b, d = result.best[name], result.baseline[name]
    priced = _option(result, name).price_per_hour > 0
    base = _baseline_words(result)
    where = _where(result, name)
    w = result.winner(name)
    if w is not b:  # local steps win
        speed = d["tta_s"] / w["tta_s"] if w["tta_s"] > 0 else float("nan")
        money = f", {human_money(w['cost_usd'])} instead of {human_money(d['cost_usd'])}" if priced else ""
        return (f"**Use local steps on {where}: LocalSGD with plan.json ({_local_words(w)})**: predicted "
                f"{speed:.2f}x faster than {base}, {human_time(w['tta_s'])} instead of "
                f"{human_time(d['tta_s'])}{money} ({_ms(w['step_s'])} per inner step, "
                f"{_steps_more(w['g'], 'than synchronising every step')}); "
                f"per-step compression ({_per_step_words(result, name)}) would take "
                f"{human_time(b['tta_s'])}; local steps: {_saving(result, name, w, b)}; "
                f"train with fastml_strategy.LocalSGD.from_plan(model, inner_optimizer, plan).")
    if b.get("use_hook", True):
        speed = d["tta_s"] / b["tta_s"] if b["tta_s"] > 0 else float("nan")
        how = _register_words(result)
        money = f", {human_money(b['cost_usd'])} instead of {human_money(d['cost_usd'])}" if priced else ""
        intra = _intra_words(b)
        held = _held_words(result)
        return (f"**Use {held} (plan.json) on {where}**: predicted {speed:.2f}x faster than "
                f"{base}, {human_time(b['tta_s'])} instead of {human_time(d['tta_s'])}{money} "
                f"({_ms(b['step_s'])} per step instead of {_ms(d['step_s'])}, "
                f"{_steps_more(b['g'], 'for the compression error')}"
                + (f"; {intra}" if intra else "") + f"); {how}.")
    bc = _best_compressed(result, name)
    worse = ""
    if bc is not None and d["tta_s"] > 0:
        cost = (lambda r: f" and {human_money(r['cost_usd'])}") if priced else (lambda r: "")
        worse = (f" The best compressed plan would take {human_time(bc['tta_s'])}{cost(bc)} against "
                 f"{human_time(d['tta_s'])}{cost(d)} ({_pct(100 * (bc['tta_s'] / d['tta_s'] - 1))} "
                 f"longer).")
    return (f"**Use {base} on {where}: no compression pays there.**{worse} plan.json is fp32 "
            f"throughout; do not register FastML.")


def _rent_words(result: "AutotuneResult") -> str | None:
    """The cheapest and the fastest catalog option to rent, where not plan.json's own (None: none
    to add)."""
    rentable = [o for o in result.options if o.price_per_hour > 0]
    if not rentable:
        return None
    name = result.option
    base = _baseline_words(result)
    cheap = min(rentable, key=lambda o: (result.winner(o.name)["cost_usd"], result.winner(o.name)["tta_s"]))
    fast = min(rentable, key=lambda o: (result.winner(o.name)["tta_s"], result.winner(o.name)["cost_usd"]))
    cb, cd = result.winner(cheap.name), result.baseline[cheap.name]
    parts = []
    if cheap.name != name:  # plan.json's option is the cheapest already: said above
        plan = (f"local steps, {_local_words(cb)} (plans/{cheap.name}.json)" if cb is not result.best[cheap.name]
                else f"its tuned plan (plans/{cheap.name}.json)" if cb.get("use_hook", True) else base)
        line = (f"Cheapest to rent: **{cheap.name}** ({cheap.nodes} x {cheap.accelerators_per_node}, "
                f"{human_money(cheap.price_per_hour)} per node-hour): {human_money(cb['cost_usd'])} and "
                f"{human_time(cb['tta_s'])} with {plan}")
        if cb.get("use_hook", True) or cb is not result.best[cheap.name]:
            line += f", against {human_money(cd['cost_usd'])} with {base}"
        parts.append(line)
    if fast.name not in (cheap.name, name):
        fb = result.winner(fast.name)
        parts.append(f"Fastest to rent: {fast.name}, {human_time(fb['tta_s'])} for {human_money(fb['cost_usd'])}")
    return ". ".join(parts) + "." if parts else None


def phase_words(phase_s: Mapping[str, float]) -> str:
    """Wall time per phase in words: 'profiling 12.3 s, calibrating 4.1 min, ...; total 6.0 min'."""
    parts = [f"{k} {human_time(v)}" for k, v in phase_s.items() if k != "total"]
    total = phase_s.get("total", sum(v for k, v in phase_s.items() if k != "total"))
    return ", ".join(parts) + f"; total {human_time(total)}"


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


def _local_text(result: "AutotuneResult") -> str:
    cal = result.local_calibration
    per = "; ".join(f"H={h}: {cal.stretch[h]:.2f}x steps, accuracy loss {cal.accuracy_loss[h]:.3g}"
                    + (" (over the limit)" if not cal.feasible(h) else "") for h in cal.every)
    return (f"Local steps (LocalSGD: no per-step all-reduce; the pseudo-gradient is all-reduced every H "
            f"inner steps, compressed by the plan, in F staggered fragments) against compressing every "
            f"step, per option, predicted. Calibration ({cal.world_size} simulated replicas, "
            f"{cal.steps} steps per run, int4 outer plan, outer {cal.outer} lr {cal.outer_lr:g} momentum "
            f"{cal.outer_momentum:g}): {per}. Step time per inner step = compute + (codec + the part of "
            f"each fragment's wire time its delay does not hide) / H.")


# -- figures -------------------------------------------------------------------------------------------
def _png(fig: Any) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _fig(w: float = 7.5, h: float = 3.6) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h))


def _legend_right(ax: Any, x: float = 1.02) -> None:
    """The legend beside the axes, right of them (at ``x`` in axes units, past a right-hand axis if
    there is one): it never covers points, lines or the title (the saved figure grows to hold it:
    ``bbox_inches="tight"``)."""
    handles, labels = ax.get_legend_handles_labels()
    if handles:
        ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(x, 1.0), borderaxespad=0.0,
                  fontsize=7, frameon=False)


def _time_unit(seconds: Any) -> tuple[float, str]:
    """(divisor, unit) that puts durations in readable numbers on an axis."""
    vals = [float(v) for v in seconds if isinstance(v, (int, float)) and math.isfinite(v) and v > 0]
    top = max(vals) if vals else 1.0
    for limit, div, unit in ((1.0, 1e-3, "ms"), (120.0, 1.0, "s"), (120 * 60.0, 60.0, "min"),
                             (72 * 3600.0, 3600.0, "h"), (math.inf, 86400.0, "days")):
        if top < limit:
            return div, unit
    return 86400.0, "days"


def _pair_bars(result: "AutotuneResult", names: list[str], left: tuple[str, str], right: tuple[str, str],
               left_hours: Any, right_hours: Any, left_cost: Any, right_cost: Any, title: str) -> str:
    """Two bars per option (left: ``(label, colour)``, right likewise): time to target on the left
    panel, cost on the right; options without a price get a note instead of a cost bar."""
    left_hours, right_hours = list(left_hours), list(right_hours)
    left_cost, right_cost = list(left_cost), list(right_cost)
    fig = _fig(8.5, 3.8)
    ax1, ax2 = fig.add_subplot(121), fig.add_subplot(122)
    x = list(range(len(names)))
    w = 0.38
    div, unit = _time_unit([h * 3600 for h in left_hours + right_hours])
    ax1.bar([i - w / 2 for i in x], [h * 3600 / div for h in left_hours], w, label=left[0], color=left[1])
    ax1.bar([i + w / 2 for i in x], [h * 3600 / div for h in right_hours], w, label=right[0], color=right[1])
    ax1.set_ylabel(f"time to target ({unit})")
    ax2.bar([i - w / 2 for i in x], left_cost, w, color=left[1])
    ax2.bar([i + w / 2 for i in x], right_cost, w, color=right[1])
    ax2.set_ylabel("cost to target (USD)")
    top = max([v for v in left_cost + right_cost if v > 0] or [1.0])
    ax2.set_ylim(0, top * 1.08)
    for i, o in enumerate(result.options):
        if o.price_per_hour == 0:  # your own cluster: no bar, say why
            ax2.text(i, top * 0.03, "no price", rotation=90, ha="center", va="bottom", fontsize=7,
                     color="#666666")
    hours = [h for h in left_hours + right_hours if h > 0]
    if hours and max(hours) / min(hours) > 50:  # options orders of magnitude apart
        ax1.set_yscale("log")
    for a in (ax1, ax2):
        a.set_xticks(x, names, rotation=30, ha="right", fontsize=7)
    fig.subplots_adjust(wspace=0.45, top=0.80)  # the right panel's tick labels clear of the left panel
    fig.suptitle(title, fontsize=10, y=0.99)
    fig.legend(*ax1.get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, 0.93), ncol=2,
               fontsize=8, frameon=False)
    return _png(fig)


def figures(result: "AutotuneResult", t: Mapping[str, pd.DataFrame]) -> dict[str, str]:
    """Every figure of the report by name, as base64 PNG, drawn in the order the report shows them."""
    figs = {"layers": _layers_figure(result, t["layers"][t["layers"]["tunable"]]),
            "step_times": _step_times_figure(t["step_times"]),
            "pareto": _pareto_figure(result, t["trials"])}
    figs.update(_option_figures(result, t))
    figs["scaling"] = _scaling_figure(result, t["scaling"])
    figs["calibration"] = _calibration_figure(result, t["calibration"])
    if result.sharding.sharded:
        figs.update(_sharded_figures(result, t))
    return figs


def _layers_figure(result: "AutotuneResult", layers: pd.DataFrame) -> str:
    """Per-layer bits per element and top-k sparsity of the chosen plan."""
    fig = _fig(max(6.0, 0.45 * len(layers) + 2), 3.8)
    ax = fig.add_subplot(111)
    x = list(range(len(layers)))
    ax.bar(x, layers["bits_per_element"], color="#3b75af", label="bits per element (left axis)")
    ax.axhline(32, color="grey", lw=0.8, ls="--", label="fp32 (32 bits)")
    ax.set_ylim(0, 36)
    ax.set_ylabel("bits per element")
    ax.set_xticks(x, [n if len(n) < 28 else "..." + n[-25:] for n in layers["name"]], rotation=60,
                  ha="right", fontsize=7)
    ax2 = ax.twinx()
    ax2.plot(x, layers["sparsity"], "o", color="#c0392b", label="fraction dropped by top-k (right axis)")
    ax2.set_ylim(-0.02, 1.02)
    ax2.set_ylabel("fraction of entries dropped")
    ax.set_title(f"Per-layer compression of the tuned plan ({result.option})", fontsize=9)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="upper left", bbox_to_anchor=(1.12, 1.0), borderaxespad=0.0,
              fontsize=7, frameon=False)
    return _png(fig)


def _step_times_figure(st: pd.DataFrame) -> str:
    """Predicted against measured step time: one row per plan (names on the axis, never beside
    points), the prediction error on the right-hand axis."""
    fig = _fig(7.5, max(2.4, 0.36 * len(st) + 1.3))
    ax = fig.add_subplot(111)
    if len(st):
        fit = st["used_in_fit"].astype(bool) if "used_in_fit" in st else pd.Series(False, index=st.index)
        order = st.assign(_fit=fit).sort_values("measured_s", ascending=False).reset_index(drop=True)
        y = list(range(len(order)))
        meas, pred = 1e3 * order["measured_s"], 1e3 * order["predicted_s"]
        for i, r in order.iterrows():
            ax.plot([meas[i], pred[i]], [i, i], color="#bbbbbb", lw=1.5, zorder=1)
        ax.scatter(meas, y, color="#222222", s=28, zorder=2, label="measured")
        ax.scatter(pred[~order["_fit"]], [i for i in y if not order["_fit"][i]], marker="D", s=26,
                   facecolors="#3b75af", edgecolors="#3b75af", zorder=3, label="predicted (a check: never fitted)")
        if order["_fit"].any():
            ax.scatter(pred[order["_fit"]], [i for i in y if order["_fit"][i]], marker="D", s=26,
                       facecolors="none", edgecolors="#3b75af", zorder=3,
                       label="predicted (recipe used to fit codec speed)")
        ax.set_yticks(y, list(order["plan"]), fontsize=8)
        ax.set_ylim(-0.7, len(order) - 0.3)
        lo, hi = float(min(meas.min(), pred.min())), float(max(meas.max(), pred.max()))
        if lo > 0 and hi / lo > 20:
            ax.set_xscale("log")
        else:
            ax.set_xlim(0, hi * 1.08)
        ax2 = ax.twinx()  # the error of each row, read off on the right
        ax2.set_ylim(ax.get_ylim())
        ax2.set_yticks(y, [f"{v:+.0f}%" for v in order["error_pct"]], fontsize=8)
        ax2.set_ylabel("prediction error", fontsize=8)
        ax.set_title(f"Step time: predicted vs measured ({order['where'].iloc[0]})", fontsize=9)
        _legend_right(ax, x=1.14)  # past the error labels of the right-hand axis
    ax.set_xlabel("ms per step")
    return _png(fig)


def _pareto_figure(result: "AutotuneResult", tr: pd.DataFrame) -> str:
    """The Pareto front of time to accuracy against cost (catalog options with a price)."""
    _, words = _base(result)
    fig = _fig(6.5, 4.2)
    ax = fig.add_subplot(111)
    priced = {o.name for o in result.options if o.price_per_hour > 0}
    feas = tr[tr["feasible"] & tr["option"].isin(priced)] if len(tr) else tr
    div, unit = _time_unit(list(feas["tta_s"]) if len(feas) else [])
    for name, g in feas.groupby("option"):
        ax.scatter(g["tta_s"] / div, g["cost_usd"], s=8, alpha=0.35, label=f"{name}: trials")
    front = feas[feas["pareto"]].sort_values("tta_s") if len(feas) else feas
    if len(front):
        ax.plot(front["tta_s"] / div, front["cost_usd"], "k-o", ms=4, label="Pareto front")
    for o in result.options:
        if o.name in priced:
            b = result.baseline[o.name]
            ax.scatter([b["tta_s"] / div], [b["cost_usd"]], marker="x", s=50, label=f"{o.name}: {words}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"predicted time to target ({unit})")
    ax.set_ylabel("predicted cost (USD)")
    ax.set_title("Time vs cost: every feasible plan on every priced option", fontsize=9)
    _legend_right(ax)
    return _png(fig)


def _option_figures(result: "AutotuneResult", t: Mapping[str, pd.DataFrame]) -> dict[str, str]:
    """Time and cost per option against the uncompressed baseline and, with local steps searched,
    per-step compression against local steps in the same style."""
    bp, words = _base(result)
    op = t["options"]
    figs = {"options": _pair_bars(result, list(op["option"]), (words, "#999999"), ("tuned plan", "#3b75af"),
                                  op[f"{bp}_hours"], op["tuned_hours"], op[f"{bp}_cost_usd"],
                                  op["tuned_cost_usd"], "Time and cost per hardware option")}
    if "local_steps" in t:
        ls = t["local_steps"]
        figs["local_steps"] = _pair_bars(
            result, list(ls["option"]), ("per-step compression", "#3b75af"),
            ("local steps (LocalSGD)", "#e67e22"), ls["per_step_hours"], ls["local_hours"].fillna(0.0),
            ls["per_step_cost_usd"], ls["local_cost_usd"].fillna(0.0),
            "Per-step compression vs local steps, per hardware option (no bar: none feasible)")
    return figs


def _schedule_text(sc: pd.DataFrame) -> str:
    """Which all-reduce schedule the tuned plans' predictions use at each node count: the one the
    runtime picks there (``Plan.schedule`` "auto" with the option's link; fastml_strategy.comm._halving)."""
    if "allreduce_schedule" not in sc or not len(sc):
        return ""
    tu = sc[(sc["plan"] == "tuned") & (sc["allreduce_schedule"] != "")]
    parts = [f"{name}: " + ", ".join(f"{n} nodes {s}" for n, s in zip(g["nodes"], g["allreduce_schedule"]))
             for name, g in tu.groupby("option", sort=False)]
    return ("All-reduce schedule of the tuned plan, as the runtime picks it (ring: all_to_all + all_gather, "
            "2(N-1) latency rounds; halving: recursive halving/doubling, 2 log2 N): " + "; ".join(parts)) if parts else ""


def _scaling_figure(result: "AutotuneResult", sc: pd.DataFrame) -> str:
    """Predicted step time of each option's tuned plan and its baseline on 8 to 1024 nodes."""
    bp, _ = _base(result)
    base_plan = "ddp-fp32" if not result.sharding.sharded else f"{bp}-own"
    fig = _fig(6.5, 4.0)
    ax = fig.add_subplot(111)
    for name, g in sc.groupby("option", sort=False):
        tu = g[g["plan"] == "tuned"]
        dd = g[g["plan"] == base_plan]
        line, = ax.plot(tu["nodes"], 1e3 * tu["step_s"], "-o", ms=3, label=f"{name}: tuned")
        ax.plot(dd["nodes"], 1e3 * dd["step_s"], "--", color=line.get_color(),
                label=f"{name}: {_short(result)}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("nodes (same global batch)")
    ax.set_ylabel("predicted ms per step")
    title = "Predicted step time, 8 to 1024 nodes"
    if result.link_warning:
        title += "\n('local': a one-machine link, not a network: see the warning)"
    ax.set_title(title, fontsize=9)
    _legend_right(ax)
    return _png(fig)


def _calibration_figure(result: "AutotuneResult", cal: pd.DataFrame) -> str:
    """Calibration: the steps ratio g(e) with its fit and error limit above, the accuracy rule
    (fit, band, limit) below."""
    fig = _fig(5.5, 7.8)
    fig.subplots_adjust(hspace=0.35)
    ax = fig.add_subplot(211)
    _accuracy_panel(fig.add_subplot(212), result, cal)
    conv = result.convergence
    if len(cal):
        bound = cal["censored"].astype(bool) | cal["pruned"].astype(bool)
        ok = cal[~bound]
        if "ratio_lo" in ok and len(ok):
            lo = (ok["ratio"] - ok["ratio_lo"]).where(ok["ratio_lo"].apply(math.isfinite), 0.0).clip(lower=0)
            hi = (ok["ratio_hi"] - ok["ratio"]).where(ok["ratio_hi"].apply(math.isfinite), 0.0).clip(lower=0)
            ax.errorbar(ok["error"], ok["ratio"], yerr=[lo, hi], fmt="o", ms=4, capsize=3, lw=1,
                        label="calibration runs, stretch with its ~95% interval")
        else:
            ax.scatter(ok["error"], ok["ratio"], label="calibration runs")
        pr = cal[bound & cal["error"].apply(math.isfinite)]
        if len(pr):
            ax.scatter(pr["error"], pr["ratio"], marker="^", color="#c0392b",
                       label="lower bounds (no level reached, or pruned)")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        finite = cal["error"][cal["error"].apply(math.isfinite)]
        hi = max(float(finite.max()) if len(finite) else 0.0, conv.e_max, 1e-3) * 1.1
        es = [hi * i / 100 for i in range(101)]
        ax.plot(es, [conv.g(e) for e in es], color="black", lw=1,
                label=f"fit: g(e) = 1 + {conv.k:.3g} e^{conv.gamma:.2g}")
        ax.axvline(conv.e_max, color="#c0392b", ls=":", label=f"error limit e_max = {conv.e_max:.3g}")
    ax.set_xlabel("plan gradient error e")
    ax.set_ylabel("stretch: steps needed / reference's")
    ax.set_title("Convergence calibration", fontsize=9)
    _legend_right(ax)
    return _png(fig)


def _accuracy_panel(ax: Any, result: "AutotuneResult", cal: pd.DataFrame) -> None:
    """Accuracy loss of every calibration run against its error, the monotone fit with its ~95% band,
    the limit (horizontal) and the error limit it gives (vertical)."""
    rule = result.accuracy_rule
    limit = rule.limit if rule is not None else 0.01
    # the axis shows the region the decision is made in: up to 5x the limit; runs above it (and
    # pruned runs) sit on the top edge as triangles
    top = 5 * abs(limit) if limit else 0.05
    if len(cal):
        ok = cal[~cal["pruned"] & cal["accuracy_loss"].apply(math.isfinite)]
        seeds = ok["seed"] if "seed" in ok else pd.Series(0, index=ok.index)
        first = ok[seeds == seeds.min()] if len(ok) else ok
        inside = first[first["accuracy_loss"] <= top]
        ax.scatter(inside["error"], inside["accuracy_loss"], s=16, label="calibration runs")
        rest = ok.drop(first.index)
        rest_in = rest[rest["accuracy_loss"] <= top]
        if len(rest_in):
            ax.scatter(rest_in["error"], rest_in["accuracy_loss"], s=16, marker="s", color="#8e44ad",
                       label="repeats (other seeds)")
        over = cal[(cal["pruned"] | ~cal["accuracy_loss"].apply(math.isfinite)
                    | (cal["accuracy_loss"] > top)) & cal["error"].apply(math.isfinite)]
        if len(over):
            ax.scatter(over["error"], [top] * len(over), s=20, marker="^", color="#c0392b",
                       label=f"above {top:g} (or pruned)")
        low = float(ok["accuracy_loss"].min()) if len(ok) else 0.0
        ax.set_ylim(min(low, -abs(limit)) - 0.1 * top, top * 1.08)
    if rule is not None and rule.errors:
        es = np.asarray(rule.errors, dtype=float)
        fit = np.asarray(rule.fit, dtype=float)
        band = np.asarray(rule.band, dtype=float)
        finite = np.isfinite(fit)
        shown = np.minimum(fit, top)
        ax.step(es[finite], shown[finite], where="post", color="black", lw=1, label="monotone fit")
        if np.isfinite(band).any():
            ax.fill_between(es[finite], np.minimum(fit - band, top)[finite],
                            np.minimum(fit + band, top)[finite], step="post",
                            color="grey", alpha=0.3, label="~95% band")
        ax.axhline(rule.limit, color="#c0392b", ls="--", lw=1, label=f"limit {rule.limit:g}")
        ax.axvline(rule.e_max, color="#c0392b", ls=":", label=f"e_max = {rule.e_max:.3g}")
    ax.set_xscale("symlog", linthresh=1e-3)
    ax.set_xlim(left=0)
    ax.set_xlabel("plan gradient error e")
    ax.set_ylabel("accuracy loss vs reference")
    ax.set_title("Accuracy rule: every run, the fit and its band", fontsize=9)
    _legend_right(ax)


def _sharded_figures(result: "AutotuneResult", t: Mapping[str, pd.DataFrame]) -> dict[str, str]:
    """Bytes per rank per step by collective and memory per rank (per option), and the what-if
    speedups over cluster shapes."""
    return {"sharded": _sharded_bytes_figure(result, t["sharded"]), "whatif": _whatif_figure(result, t["whatif"])}


def _sharded_bytes_figure(result: "AutotuneResult", sd: pd.DataFrame) -> str:
    """Per option: bytes per rank per step by collective (own against tuned), and memory per rank."""
    kind = result.sharding.kind.upper()
    fig = _fig(max(8.5, 1.6 * len(sd) + 4), 3.9)
    ax1, ax2 = fig.add_subplot(121), fig.add_subplot(122)
    x = list(range(len(sd)))
    w = 0.38
    colors = {"all-gather": "#7f8c8d", "reduce-scatter": "#3b75af", "cross-node all-reduce": "#e67e22"}
    for off, who in ((-w / 2, "own"), (w / 2, "tuned")):
        parts = [("all-gather", sd["allgather_MB"]),
                 ("reduce-scatter", sd[f"{who}_reduce_scatter_MB"]),
                 ("cross-node all-reduce", sd[f"{who}_allreduce_MB"])]
        bottom = [0.0] * len(sd)
        for label, vals in parts:
            vals = list(vals)
            if not any(vals):  # FSDP has no cross-node all-reduce; a single node no reduction
                continue
            ax1.bar([i + off for i in x], vals, w, bottom=bottom, color=colors[label],
                    alpha=1.0 if who == "tuned" else 0.45,
                    label=f"{label} ({'tuned' if who == 'tuned' else kind + ' own'})")
            bottom = [b + v for b, v in zip(bottom, vals)]
    ax1.set_ylabel("MB sent per rank per step")
    ax1.set_title(f"Bytes per rank per step (left bar: {kind}'s own, right: tuned)", fontsize=8)
    ax2.bar(x, sd["fsdp_state_MiB_per_rank"], 0.6, color="#999999",
            label=f"{kind} state (params, grads, optimizer)")
    ax2.bar(x, sd["residual_MiB_per_rank"], 0.6, bottom=sd["fsdp_state_MiB_per_rank"], color="#c0392b",
            label="FastML residuals (tuned plan)")
    ax2.set_ylabel("MiB per rank")
    ax2.set_title("Memory per rank", fontsize=8)
    for a in (ax1, ax2):
        a.set_xticks(x, sd["option"], rotation=30, ha="right", fontsize=7)
        # legends below the tick labels: never over a bar, whatever the bars' heights
        a.legend(*a.get_legend_handles_labels(), loc="upper center", bbox_to_anchor=(0.5, -0.22),
                 ncol=2 if a is ax1 else 1, fontsize=7, frameon=False)
    fig.subplots_adjust(wspace=0.3)
    return _png(fig)


def _whatif_figure(result: "AutotuneResult", wi: pd.DataFrame) -> str:
    """Per option, a heat map of the tuned plan's speedup over the sharding's own collectives on
    each cluster shape (nodes x ranks per node)."""
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import NullFormatter

    kind = result.sharding.kind.upper()
    opts = list(dict.fromkeys(wi["option"]))
    cols = min(3, len(opts))
    rows = -(-len(opts) // cols)
    from matplotlib.figure import Figure

    # constrained layout keeps each row's axis labels clear of the next row's titles
    fig = Figure(figsize=(3.6 * cols + 1.2, 3.0 * rows + 0.6), layout="constrained")
    for i, name in enumerate(opts):
        ax = fig.add_subplot(rows, cols, i + 1)
        g = wi[wi["option"] == name].pivot(index="ranks_per_node", columns="nodes", values="speedup")
        # log scale around 1: a slowdown of 2x and a speedup of 2x are equally far from neutral
        im = ax.imshow(g.values, cmap="RdYlGn", norm=LogNorm(vmin=0.5, vmax=2.0), aspect="auto",
                       origin="lower")
        ax.set_xticks(range(len(g.columns)), [str(c) for c in g.columns], fontsize=7)
        ax.set_yticks(range(len(g.index)), [str(r) for r in g.index], fontsize=7)
        for (r, c), v in np.ndenumerate(g.values):
            ax.text(c, r, f"{v:.2f}x", ha="center", va="center", fontsize=7)
        ax.set_xlabel("nodes", fontsize=7)
        ax.set_ylabel("ranks per node", fontsize=7)
        ax.set_title(name, fontsize=8)
    fig.suptitle(f"Step-time speedup of each option's tuned plan over {kind}'s own collectives",
                 fontsize=9)
    cb = fig.colorbar(im, ax=fig.axes, shrink=0.8, label="speedup (own / tuned step time)")
    cb.set_ticks([0.5, 0.75, 1.0, 1.5, 2.0], labels=["0.5x", "0.75x", "1x", "1.5x", "2x"])
    cb.ax.yaxis.set_minor_formatter(NullFormatter())
    return _png(fig)


# -- documents -----------------------------------------------------------------------------------------
def _fmt(df: pd.DataFrame, cols: list[str] | None = None) -> pd.DataFrame:
    d = df[cols] if cols else df
    return d.copy().map(lambda v: f"{v:.4g}" if isinstance(v, float) else v)


def _summary(result: "AutotuneResult", s: "Settings") -> list[str]:
    """The details behind the headline: what was profiled and fitted."""
    b, d = result.best[result.option], result.baseline[result.option]
    conv = result.convergence
    prof = result.profile
    _, words = _base(result)
    short = _short(result)
    intra = "" if uses_local_steps(result.winner(result.option)) else _intra_words(b)  # local steps: no hop
    lines = [
        f"Target `{s.target}`, reference world size {s.world_size}, {len(prof.layers)} parameters "
        f"({sum(lp.tunable for lp in prof.layers)} tuned in {len(result.groups)} groups), "
        f"catalog: {s.catalog_path}.",
        f"plan.json is tuned for **{result.option}**: predicted {_ms(b['step_s'])} per step "
        f"({words} {_ms(d['step_s'])}), gradient error {b['error']:.3g}, "
        f"{_steps_more(b['g'], '')}, time to target {human_time(b['tta_s'])} "
        f"({short} {human_time(d['tta_s'])})"
        + (f"; {intra}" if intra else "") + ".",
        f"Compute per step {_ms(prof.compute_s)} (forward {_ms(prof.forward_s)}, backward "
        f"{_ms(prof.backward_s)}, optimizer {_ms(prof.optimizer_s)})."
        + (f" Link: {prof.link.describe()}." if prof.link else " Link: from the catalog."),
        f"Convergence: g(e) = 1 + {conv.k:.3g} e^{conv.gamma:.2g}; plans with error above "
        f"{conv.e_max:.3g} are excluded (accuracy limit {s.max_accuracy_loss:g}). Training length: "
        f"{_steps_words(result)}.",
    ]
    if result.accuracy_rule is not None:
        lines.append(result.accuracy_rule.words())
    mb = result.winner(result.option).get("bucket_mb") if not result.sharding.sharded else None
    if mb is not None:
        lines.append(_bucket_words(mb))
    emb = [lp.name for lp in prof.layers if lp.kind == "embedding" and lp.tunable]
    if emb:
        ch = search_expand(result)
        lines.append("Embeddings (row-sparse gradients, searched on their own): "
                     + ", ".join(f"{n} -> {ch.get(n, 'none')}" for n in emb) + ".")
    if prof.threads:
        lines.append(f"Compute was timed with {prof.threads} thread(s) per rank "
                     f"({prof.threads_source or 'as profiled'}).")
    if result.phase_s:
        lines.append("Tuner wall time: " + phase_words(result.phase_s) + ".")
    for note in result.budget_notes:
        lines.append(note + ".")
    if result.sharding.sharded:
        lines.append(_sharding_words(result, s))
    return lines


def _bucket_words(mb: Any) -> str:
    """How to give DDP the bucket cap plan.json's plan is predicted fastest with."""
    return (f"DDP buckets: plan.json's plan is predicted fastest with bucket_cap_mb={mb} (DDP's "
            f"default puts the last 1 MiB, then 25 MiB, in a bucket): pass it to "
            f"DistributedDataParallel(model, bucket_cap_mb={mb}), FastMLStrategy(..., "
            f"bucket_cap_mb={mb}), Accelerate's DistributedDataParallelKwargs(bucket_cap_mb={mb}) or "
            f"Hugging Face Trainer's TrainingArguments(ddp_bucket_cap_mb={mb}); "
            f"plan.json's meta.ddp holds it (register_hook cannot change the buckets of a "
            f"model already wrapped).")


def _sharding_words(result: "AutotuneResult", s: "Settings") -> str:
    """The sharded run in words: units, cluster shape, bytes per rank and step, residual memory."""
    from fastml_strategy.autotune.costmodel import fsdp_units

    b, d = result.best[result.option], result.baseline[result.option]
    prof = result.profile
    sh = result.sharding
    short = _short(result)
    o = _option(result, result.option)
    n_units = len(fsdp_units(prof))
    limit = ("no limit" if s.max_residual_bytes is None else
             f"limit {s.max_residual_bytes / 2 ** 30:.4g} GiB per rank (--max-residual-gb)")
    return (
        f"Sharding: {sh.describe()}; {n_units} FSDP units; {result.option} is {o.nodes} node(s) x "
        f"{o.accelerators_per_node} rank(s)"
        + (f" (shard group {o.accelerators_per_node}, {o.nodes} replicas)" if sh.kind == "hsdp" else "")
        + f"; intra-node link {(o.intra_link or sh.intra_link).describe()}. Per rank and step: "
        f"all-gathers {b['allgather_bytes'] / 1e6:.4g} MB, reduction "
        f"{(b['reduce_scatter_bytes'] + b['allreduce_bytes']) / 1e6:.4g} MB ({short} alone "
        f"{(d['reduce_scatter_bytes'] + d['allreduce_bytes']) / 1e6:.4g} MB). FastML residuals "
        f"{b['residual_bytes'] / 2 ** 20:.4g} MiB per rank beside {short}'s own "
        f"{b['state_bytes'] / 2 ** 20:.4g} MiB ({limit})."
        + (f" Each FSDP collective costs {1e3 * prof.collective_overhead_s:.3g} ms beyond the link "
           f"(fitted to {short}'s measured step time)." if prof.collective_overhead_s else ""))


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


def _plan_words(choice: Mapping[str, str]) -> str:
    """A group choice in words: 'uniform int4' or 'mixed int8 x3, fp16 x2'."""
    from collections import Counter

    c = Counter(choice.values())
    if len(c) == 1:
        return f"uniform {next(iter(c))}"
    return "mixed " + ", ".join(f"{o} x{k}" for o, k in c.most_common())


def _point_stretch(p: Mapping[str, Any]) -> Any:
    """A calibration point's stretch as a ``calibrate.Stretch`` (None: stored without its interval)."""
    from fastml_strategy.autotune.calibrate import Stretch

    if p.get("pruned"):
        return None
    lo = p.get("ratio_lo")
    if lo is None or (isinstance(lo, float) and math.isnan(lo)):
        return None
    return Stretch(float(p["ratio"]), float(lo), float(p["ratio_hi"]), float(p.get("ratio_se", math.nan)),
                   bool(p.get("censored")), int(p.get("levels", 0)), int(p.get("levels_reached", 0)),
                   float(p.get("stretch_sigma", math.nan)))


def _stretch_text(result: "AutotuneResult") -> str:
    """How each calibration run's stretch was measured, in words a user can check on the curves."""
    pts = result.calibration
    src = next((p.get("stretch_noise") for p in pts if p.get("stretch_noise")), None)
    sig = next((p.get("stretch_sigma") for p in pts if p.get("stretch_sigma") is not None), math.nan)
    conv = result.convergence
    from fastml_strategy.autotune.calibrate import LEVEL_FRACTIONS

    return (f"Stretch: the steps a run needs to reach the reference's smoothed training loss over the steps "
            f"the reference needs, read at the reference's losses at {LEVEL_FRACTIONS[0]:.0%}-"
            f"{LEVEL_FRACTIONS[-1]:.0%} of the run ({len(LEVEL_FRACTIONS)} levels) wherever the reference "
            f"still descends. A vertical difference of the noise moves a crossing by the noise over "
            f"the reference's slope there, so levels where the reference has flattened weigh little "
            f"(or are left out) and noise cannot make a plan look slow. The noise of a smoothed loss "
            f"difference is {sig:.3g} ({src or 'unknown'}); intervals are ~95%. A run whose interval "
            f"contains 1 is within noise of the reference. A level a run never reached is a lower bound "
            f"on its stretch; a run that reached none (and a pruned run) enters the fit of g(e) only as "
            f"a bound (the fit may pass above it, never is pulled above it), and each run pulls the fit "
            f"by 1 / (its standard error^2 + {FIT_SE_FLOOR:g}^2). Fit: g(e) = 1 + {conv.k:.3g} e^{conv.gamma:.2g}. "
            f"In the table, 'levels' counts the levels a run was measured at (where the reference "
            f"still descends) and 'reached' those it got to before its run ended. Accuracy loss: the "
            f"relative increase of the final windowed loss (or the eval metric's drop), less what a "
            f"delay within the run's stretch interval explains where the reference still descends at "
            f"the end (the reference's drop per log-step there times the log-delay): a run that is "
            f"only behind is charged as steps by g(e), not again as lost accuracy; the figure at the "
            f"end is shown beside it when the two differ.")


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


def _check_text(result: "AutotuneResult") -> str | None:
    """The check of plan.json's plan against the obvious uniform alternatives, in words."""
    c = result.check
    if c is None:
        return None
    if not c.get("alternatives"):
        return " ".join([f"Check before writing plan.json ({_plan_words(c['tuned'])} on {c['option']}): "
                         f"{c.get('verdict', '')}.", *_powersgd_parts(c)])
    pair = ("from the same weights on the same batches" if c.get("paired") else
            "from the same weights (batches not replayed: the comparison includes the data order)")
    tuned = ("plain DDP (the search admitted no compressed plan or predicted none faster; its run is "
             "the reference's)" if c.get("tuned_plain") else f"the tuned plan ({_plan_words(c['tuned'])})")
    head = (f"Check before writing plan.json: {tuned} and the obvious "
            f"uniform alternatives on {c['option']} trained side by side for {c['steps']} steps, {pair}, "
            f"seed {c['seed']}; time to the tuned plan's losses = measured steps x predicted step time"
            + (" (then, with the step times measured across the ranks, again)." if c.get("tuned_measured_step_s")
               else "."))
    parts = [head]
    for e in c.get("alternatives", []):
        parts.append(f"{e['plan']} ({e['why']}; predicted {_ms(e['step_s'])} per step against "
                     f"{_ms(c['tuned_step_s'])}): {e['words']}"
                     + (f"; {e['measured_words']}" if e.get("measured_words") else "")
                     + f"; accuracy loss {e['accuracy_loss']:+.3g}"
                     f" ({'within' if e['within_limit'] else 'over'} the limit"
                     + ("" if e.get("feasible_by_fit", True) else
                        "; beyond the fit's e_max, within the limit in its own calibration runs")
                     + ").")
    parts.append(f"Verdict: {c.get('verdict', '')}.")
    parts += _powersgd_parts(c)
    if c.get("replaced"):
        parts.append("The predicted figures above are the cost model's for that plan, and the step-time "
                     "table's tuned row is the plan it replaced where the replacement came after timing; "
                     "plans/*.json of the other options were not checked.")
    return " ".join(parts)


def _powersgd_parts(c: Mapping[str, Any]) -> list[str]:
    """torch's PowerSGD hook in the check (issue 36): each rank's run against the tuned plan, and
    whether one was faster (it cannot replace plan.json: another hook)."""
    es = c.get("powersgd") or []
    if not es:
        return []
    parts = [f"torch's PowerSGD hook (powerSGD_hook, one DDP bucket, start_powerSGD_iter "
             f"{es[0]['start_powerSGD_iter']}: 10% of the run, torch's advice; its default 1000 would not "
             f"compress in a run this short) trained the same way against "
             f"{c.get('powersgd_against') or 'the tuned plan'} (what plan.json holds); time = measured steps x "
             f"its mean predicted step time over the run (plain DDP's before it compresses)."]
    for e in es:
        parts.append(f"{e['plan']} ({e['step_words']}): {e['words']}; accuracy loss {e['accuracy_loss']:+.3g} "
                     f"({'within' if e['within_limit'] else 'over'} the limit).")
    parts.append(f"**{c['powersgd_faster']}.**" if c.get("powersgd_faster") else
                 "No torch PowerSGD rank reached the tuned plan's losses sooner within the accuracy limit.")
    return parts


def markdown(result: "AutotuneResult", s: "Settings", t: Mapping[str, pd.DataFrame]) -> str:
    out = ["# fastml-autotune report", ""]
    out += [f"- {line}" for line in headline(result)]
    out += ["", "## Details", ""]
    out += [f"- {line}" for line in _summary(result, s)]
    out += ["", "## Hardware options (predicted)", "",
            _options_table(result).to_markdown(index=False),
            *(_sharded_markdown(result, t) if result.sharding.sharded else []),
            *(["", "## Per-step compression vs local steps (predicted)", "", _local_text(result), "",
               _local_table(result).to_markdown(index=False)] if "local_steps" in t else []),
            "", "## Step time: predicted vs measured", "",
            (f"Where: {t['step_times']['where'].iloc[0]}.\n\n" + _step_table(t).to_markdown(index=False))
            if len(t["step_times"]) else "(not measured)",
            "", "## Per-layer plan", "",
            _fmt(t["layers"], ["name", "numel", "codec", "bits_per_element", "sparsity",
                               "rel_error"]).to_markdown(index=False),
            "", "## Pareto front (time vs cost)", ""]
    front = _front_table(t)
    if len(front):
        out.append(front.to_markdown(index=False))
    if result.link_warning:
        out += ["", "## Predictions for larger clusters", "",
                f"The 'local' rows of scaling.csv extrapolate a link that is not a network: "
                f"{result.link_warning}"]
    check = _check_text(result)
    if check:
        out += ["", "## Check against uniform plans (measured)", "", check]
    if result.calibration:
        out += ["", "## Convergence calibration: each run's stretch", "", _stretch_text(result), "",
                _stretch_table(result).to_markdown(index=False)]
    files = [n for n in OUTPUT_FILES if n.endswith(".csv")]
    files += list(SHARDED_FILES) if result.sharding.sharded else []
    files += list(LOCAL_FILES) if "local_steps" in t else []
    out += ["", "Files: plan.json, plans/*.json (one per option), report.html, and the CSV tables "
            + ", ".join(files) + " (times in seconds or hours, costs in USD).", ""]
    return "\n".join(out)


def _sharded_markdown(result: "AutotuneResult", t: Mapping[str, pd.DataFrame]) -> list[str]:
    kind = result.sharding.kind.upper()
    return ["", f"## Sharded training ({kind}): bytes and memory per rank", "",
            f"All-gathers of parameters (forward, and backward when resharded) and the gradient "
            f"reduction per rank per step, tuned plan against {kind}'s own collectives; FastML's "
            f"error-feedback residuals per rank beside {kind}'s own state (fp32 parameter and "
            f"gradient shards, optimizer state).", "",
            _fmt(t["sharded"]).to_markdown(index=False),
            "", f"## What if: other cluster shapes ({kind}, nodes x ranks per node)", "",
            f"Each option's tuned plan on other shapes: predicted ms/step and speedup over {kind}'s "
            f"own collectives (whatif.csv has bytes and memory too).", "",
            _fmt(_whatif_pivot(t)).to_markdown(index=False)]


def _html_text(line: str) -> str:
    """Escaped text with the markdown bold and code of the headline as HTML."""
    import re

    out = html.escape(line)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", out)


_HTML_HEAD = (
    "<!doctype html><html><head><meta charset='utf-8'><title>fastml-autotune report</title>",
    "<style>body{font-family:sans-serif;max-width:1240px;margin:2em auto;padding:0 1em;color:#222}"
    "table.t{border-collapse:collapse;font-size:12px}table.t td,table.t th{padding:2px 8px;"
    "border-bottom:1px solid #ddd;text-align:right}table.t th{vertical-align:bottom}"
    "table.t td:first-child,table.t th:first-child{text-align:left}"
    "img{max-width:100%}h2{margin-top:1.6em}.wide{overflow-x:auto}"
    ".verdict{font-size:1.12em;background:#f1f6fb;border-left:5px solid #3b75af;padding:.4em 1em}"
    ".verdict p{margin:.5em 0}p.warn{color:#8a2b06}</style>",
    "</head><body><h1>fastml-autotune report</h1>",
)


def _html_img(figs: Mapping[str, str], key: str, alt: str) -> str:
    """A figure embedded as a base64 PNG."""
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{figs[key]}">'


def _html_table(df: pd.DataFrame) -> str:
    """A table in its own box, which scrolls when the table is still too wide for the page."""
    # headers with spaces instead of underscores, so they wrap and a wide table fits the page
    shown = _fmt(df).rename(columns=lambda c: str(c).replace("_", " "))
    return '<div class="wide">' + shown.to_html(index=False, border=0, classes="t", escape=True) + "</div>"


def _html_verdict(result: "AutotuneResult") -> str:
    """The headline in its box, a warning marked as one."""
    head = headline(result)
    return f'<div class="verdict"><p>{_html_text(head[0])}</p>' + "".join(
        f"<p{' class=warn' if line.startswith('**Warning') else ''}>{_html_text(line)}</p>"
        for line in head[1:]) + "</div>"


def _html_sharded(result: "AutotuneResult", t: Mapping[str, pd.DataFrame], figs: Mapping[str, str]) -> list[str]:
    """The sharded run's sections: bytes and memory per rank, and the what-if grid."""
    kind = result.sharding.kind.upper()
    return [
        f"<h2>Sharded training ({kind}): bytes and memory per rank</h2>",
        f"<p>Parameter all-gathers and gradient reduction per rank per step, tuned plan against "
        f"{kind}'s own collectives; FastML's error-feedback residuals beside {kind}'s own state "
        f"(fp32 parameter and gradient shards, optimizer state).</p>",
        _html_img(figs, "sharded", "bytes and memory per rank"), _html_table(t["sharded"]),
        f"<h2>What if: other cluster shapes ({kind}, nodes x ranks per node)</h2>",
        f"<p>Each option's tuned plan: predicted ms/step and speedup over {kind}'s own "
        f"collectives; whatif.csv adds bytes and memory per rank.</p>",
        _html_img(figs, "whatif", "what-if speedups"), _html_table(_whatif_pivot(t)),
    ]


def html_report(result: "AutotuneResult", s: "Settings", t: Mapping[str, pd.DataFrame],
                figs: Mapping[str, str]) -> str:
    """report.html: self-contained, its figures embedded."""
    def img(key: str, alt: str) -> str:
        return _html_img(figs, key, alt)

    summary = "".join(f"<li>{_html_text(line)}</li>" for line in _summary(result, s))
    front = _front_table(t)
    _, words = _base(result)
    st = t["step_times"]
    parts = [
        *_HTML_HEAD, _html_verdict(result),
        "<h2>Details</h2>", f"<ul>{summary}</ul>",
        f"<h2>Time and cost per hardware option vs {html.escape(words)}</h2>", img("options", "options"),
        _html_table(_options_table(result)),
        *(["<h2>Per-step compression vs local steps</h2>", f"<p>{html.escape(_local_text(result))}</p>",
           img("local_steps", "per-step compression vs local steps"), _html_table(_local_table(result))]
          if "local_steps" in t else []),
        *(_html_sharded(result, t, figs) if result.sharding.sharded else []),
        "<h2>Pareto front: time to accuracy vs cost</h2>", img("pareto", "pareto front"),
        _html_table(front) if len(front) else "",
        "<h2>Per-layer bits and sparsity</h2>", img("layers", "per-layer bits"),
        _html_table(t["layers"][["name", "numel", "group", "codec", "bits_per_element", "sparsity",
                                 "rel_error", "grad_ready_ms"]]),
        "<h2>Predicted vs measured step time</h2>",
        f"<p>Where: {html.escape(str(st['where'].iloc[0]))}.</p>" if len(st) else "",
        img("step_times", "predicted vs measured"),
        _html_table(_step_table(t)) if len(st) else "<p>not measured</p>",
        "<h2>Predicted step time for larger clusters</h2>",
        f"<p class=warn>{html.escape(result.link_warning)}</p>" if result.link_warning else "",
        img("scaling", "scaling"),
        f"<p>{html.escape(_schedule_text(t['scaling']))}</p>",
        *([f"<h2>Check against uniform plans (measured)</h2><p>{html.escape(_check_text(result) or '')}</p>"]
          if result.check is not None else []),
        "<h2>Convergence calibration</h2>", f"<p>{html.escape(_stretch_text(result))}</p>",
        img("calibration", "calibration"),
        _html_table(_stretch_table(result)) if result.calibration else "",
        "<p>calibration.csv has every figure of each run (the stretch's interval: ratio_lo, ratio_hi; "
        "its standard error in log units: ratio_se; the accuracy loss the rule used, accuracy_loss, "
        "the one at the end of the run, accuracy_loss_raw, and the offset allowance between them, "
        "accuracy_allowance) and its per-group codec choice.</p>",
        "</body></html>",
    ]
    return "\n".join(parts)


def write_outputs(result: "AutotuneResult", s: "Settings", plan_dict: Mapping[str, Any],
                  per_option: Mapping[str, Mapping[str, Any]]) -> None:
    """Write every output into ``s.out``, each file atomically; outputs of an earlier run that this
    one does not produce (``--overwrite``: the sharded tables of a sharded run, the plan of an option
    no longer in the catalog) are removed, so the folder holds one run."""
    t = tables(result)
    figs = figures(result, t)
    out = s.out
    names = ["trials", "layers", "calibration", "step_times", "scaling", "options"]
    names += [n[:-4] for n in SHARDED_FILES] if result.sharding.sharded else []
    names += [n[:-4] for n in LOCAL_FILES] if "local_steps" in t else []
    for name in names:
        with atomic_open(out / f"{name}.csv", "w") as f:
            t[name].to_csv(f, index=False)
    for opt, d in per_option.items():
        atomic_write_text(out / "plans" / f"{opt}.json", json.dumps(d, indent=2) + "\n")
    atomic_write_text(out / "report.md", markdown(result, s, t))
    atomic_write_text(out / "report.html", html_report(result, s, t, figs))
    # plan.json last: its presence means the run finished.
    atomic_write_text(out / "plan.json", json.dumps(plan_dict, indent=2, default=_json_default) + "\n")
    stale = [out / n for n in SHARDED_FILES if not result.sharding.sharded]
    stale += [out / n for n in LOCAL_FILES if "local_steps" not in t]
    stale += [p for p in (out / "plans").glob("*.json") if p.stem not in per_option]
    for p in stale:
        p.unlink(missing_ok=True)


def _json_default(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    raise TypeError(type(v).__name__)
