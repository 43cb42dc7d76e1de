"""The report in words: the answer (:func:`headline`, :func:`winner_line`), its verdict and the
sentences around each table, in human units (ms, s, min, h, days; $). Reads an
:class:`~fastml_strategy.autotune.result.AutotuneResult` and returns strings; no tables, no plots,
no files (``data``, ``plots`` and ``render`` build on it).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping

import pandas as pd

from fastml_strategy.autotune.costmodel import FIT_SE_FLOOR
from fastml_strategy.autotune.result import TARGET_STEPS_SOURCES, uses_local_steps

if TYPE_CHECKING:
    from fastml_strategy.autotune._settings import Settings
    from fastml_strategy.autotune.result import AutotuneResult


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
