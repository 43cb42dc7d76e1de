"""The report rendered and written: report.md, report.html (self-contained, plots embedded), the CSV
tables and plan.json, every file written atomically (``fastml_strategy._io``), so a crash never leaves
half a report. Composes ``words``, ``data`` and ``plots``; computes nothing of its own.
"""

from __future__ import annotations

import html
import json
import math
from typing import TYPE_CHECKING, Any, Mapping

import pandas as pd

from fastml_strategy._io import atomic_open, atomic_write_text
from fastml_strategy.autotune.result import uses_local_steps
from fastml_strategy.autotune.report.words import (_base, _bucket_words, _check_text, _intra_words, _local_text,
                                                   _ms, _schedule_text, _sharding_words, _short, _steps_more,
                                                   _steps_words, _stretch_text, headline, human_time, phase_words)
from fastml_strategy.autotune.report.data import (_front_table, _local_table, _options_table, _step_table,
                                                  _stretch_table, _whatif_pivot, search_expand, tables)
from fastml_strategy.autotune.report.plots import figures

if TYPE_CHECKING:
    from fastml_strategy.autotune._settings import Settings
    from fastml_strategy.autotune.result import AutotuneResult

OUTPUT_FILES = ("plan.json", "report.html", "report.md", "trials.csv", "layers.csv", "calibration.csv",
                "step_times.csv", "scaling.csv", "options.csv")
SHARDED_FILES = ("sharded.csv", "whatif.csv")  # written by --sharding fsdp|hsdp runs only
LOCAL_FILES = ("local_steps.csv",)  # written when local steps were searched


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
    if s.calibration_ranks > 1:
        lines.append(f"Calibration: each step trains on the mean gradient of {s.calibration_ranks} batches, "
                     f"as {s.calibration_ranks} data-parallel ranks do (--calibration-ranks).")
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
