"""The final decision of a tuning run: which of the plans the check trained side by side goes into
plan.json (issue 38).

The check (:func:`fastml_strategy.autotune._check._check`) trains the tuned plan and its obvious
uniform alternatives from the same weights and measures, for each, the time to reach the tuned plan's
losses (steps measured x step time predicted) and whether its own run stayed within the accuracy
limit. Choosing the soonest of them outright let the kind of answer flip between runs of one command:
the search's per-layer mix changes with the profile's timings, and a mix a few percent ahead of a
uniform recipe in one run is a few percent behind it in the next (bench_autotune_repeat: gpt gave a
top-k mix once and uniform int2 twice). The rule here:

1. Only contenders whose own run stayed within the accuracy limit count (plain DDP always does).
2. The fastest uniform recipe among them, ``U``, is the answer unless the fastest mixed plan ``M`` is
   clearly faster: ``time(M) * (1 + MIX_MARGIN) < time(U)``. So plan.json is never slower than the
   fastest uniform recipe that met the accuracy rule in its own run, and a mix must beat it by more
   than the differences between runs to be chosen.

Pure functions of the check's figures (no torch, no training): tests/autotune/test_decide.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["MIX_MARGIN", "Contender", "Decision", "decide"]

# How much faster (time to the same loss) a per-layer mix must be than the fastest uniform recipe
# within the accuracy limit to be chosen over it: above the few-percent spread of one plan's measured
# time between runs (the profile's step times, the search's mix), below what a mix that matters gains.
MIX_MARGIN = 0.10


@dataclass(frozen=True)
class Contender:
    """One plan the check compared: ``label`` (``"the tuned plan"``, ``"uniform int4"``...),
    ``uniform`` (every layer on one codec: plain DDP counts), ``time_ratio`` (its time to the tuned
    plan's losses over the tuned plan's: the tuned plan is 1.0) and ``within`` (its own run stayed
    within the accuracy limit)."""

    label: str
    uniform: bool
    time_ratio: float
    within: bool


@dataclass(frozen=True)
class Decision:
    """The answer (``chosen``, one of the contenders) and ``why``, in words for the report."""

    chosen: Contender
    why: str

    def to_dict(self, contenders: Sequence[Contender]) -> dict:
        return {"chosen": self.chosen.label, "why": self.why, "mix_margin": MIX_MARGIN,
                "contenders": [{"plan": c.label, "uniform": c.uniform,
                                "time_ratio": c.time_ratio if math.isfinite(c.time_ratio) else None,
                                "within_limit": c.within} for c in contenders]}


def decide(contenders: Sequence[Contender], margin: float = MIX_MARGIN) -> Decision | None:
    """The rule of the module docstring; None when no contender is within the accuracy limit."""
    ok = [c for c in contenders if c.within and math.isfinite(c.time_ratio)]
    if not ok:
        return None
    uni = min((c for c in ok if c.uniform), key=lambda c: c.time_ratio, default=None)
    mix = min((c for c in ok if not c.uniform), key=lambda c: c.time_ratio, default=None)
    if uni is None:
        return Decision(mix, "no uniform recipe stayed within the accuracy limit in its run")
    if mix is None:
        return Decision(uni, "the fastest uniform recipe within the accuracy limit")
    gain = uni.time_ratio / mix.time_ratio
    if mix.time_ratio * (1.0 + margin) < uni.time_ratio:
        return Decision(mix, f"{gain:.3g}x sooner than {uni.label}, the fastest uniform recipe within the "
                             f"accuracy limit (more than the {margin:.0%} a mix must gain)")
    return Decision(uni, f"the fastest uniform recipe within the accuracy limit; {mix.label} would gain "
                         f"{gain:.3g}x, not the {1 + margin:.2f}x a mix must gain over it")
