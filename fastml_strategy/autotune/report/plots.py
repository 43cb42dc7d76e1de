"""The report's plots, each an embedded base64 PNG string, from the tables of ``data``.

Plots use matplotlib's object-oriented API with the Agg canvas (no pyplot, so the user's backend and
global figure state are untouched). Legends sit outside the axes and labels are on axes, not beside
points, so nothing overlaps at any number of plans or options.
"""

from __future__ import annotations

import base64
import io
import math
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
import pandas as pd

from fastml_strategy.autotune.report.words import _base, _short

if TYPE_CHECKING:
    from fastml_strategy.autotune.result import AutotuneResult


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
