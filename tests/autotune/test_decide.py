"""Issue 38: the final decision between the plans the check trained side by side
(fastml_strategy.autotune.decide): a mix must beat the fastest uniform recipe within the accuracy limit
by more than MIX_MARGIN, and the answer is never slower than that recipe."""

import math

import pytest

from fastml_strategy.autotune.costmodel import Trial
from fastml_strategy.autotune.decide import MIX_MARGIN, Contender, decide


def C(label, ratio, within=True, uniform=None):
    return Contender(label, label.startswith(("uniform", "plain")) if uniform is None else uniform, ratio, within)


def test_a_mix_a_few_percent_ahead_of_uniform_int4_gives_int4():
    # run-to-run differences of a few percent may not flip the kind of answer
    d = decide([C("the tuned plan", 1.0, uniform=False), C("uniform int4", 1.03)])
    assert d.chosen.label == "uniform int4" and "not the 1.10x" in d.why


def test_a_mix_clearly_ahead_is_kept():
    d = decide([C("the tuned plan", 1.0, uniform=False), C("uniform int4", 1.0 + 2 * MIX_MARGIN)])
    assert d.chosen.label == "the tuned plan" and "sooner than uniform int4" in d.why


@pytest.mark.parametrize("ratios", [(1.0, 0.8, 0.9), (1.0, 0.95, 0.9), (1.0, 1.2, 1.05)])
def test_never_slower_than_the_fastest_uniform_recipe_within_the_limit(ratios):
    tuned, int2, int4 = ratios
    cs = [C("the tuned plan", tuned, uniform=False), C("uniform int2", int2), C("uniform int4", int4)]
    d = decide(cs)
    fastest_uniform = min(int2, int4)
    assert d.chosen.time_ratio <= fastest_uniform
    if d.chosen.uniform:
        assert d.chosen.time_ratio == fastest_uniform


def test_over_the_limit_never_wins():
    d = decide([C("the tuned plan", 1.0, uniform=False), C("uniform int2", 0.5, within=False),
                C("uniform int4", 1.02)])
    assert d.chosen.label == "uniform int4"
    # plain DDP stands where the only faster recipe failed its own run
    d = decide([C("plain DDP", 1.0), C("uniform int4", 0.2, within=False)])
    assert d.chosen.label == "plain DDP"
    assert decide([C("plain DDP", 1.0), C("uniform int4", 0.2)]).chosen.label == "uniform int4"
    assert decide([C("the tuned plan", 1.0, within=False, uniform=False), C("uniform int4", 0.9, within=False)]) is None
    # no uniform recipe within the limit: the mix, whatever its margin
    assert decide([C("the tuned plan", 1.0, uniform=False), C("uniform int4", 1.01, within=False)]).chosen.label \
        == "the tuned plan"


def _record(*alts):
    """A check record with these alternatives: (codec, time_ratio, within, censored)."""
    return {"alternatives": [{"plan": f"uniform {o}", "time_ratio": r, "within_limit": w, "censored": c,
                              "levels": 15} for o, r, w, c in alts], "replaced": None}


def _row(codec):
    return Trial({"option": "local", "kind": "fastml", "every": 1, "choice": {"a": codec, "b": codec},
                  "step_s": 1.0, "objective": 1.0, "feasible": True, "use_hook": True})


def test_the_check_applies_the_decision_and_records_it():
    from fastml_strategy.autotune._check import _decide

    tuned = Trial({"option": "local", "kind": "fastml", "every": 1, "choice": {"a": "topk1", "b": "int4"},
                   "step_s": 1.0, "objective": 1.0, "feasible": True, "use_hook": True})
    alts = [(_row("int2"), "the fastest"), (_row("int4"), "the default recipe")]
    # int2 never reached the tuned plan's losses (censored): it has no time to them
    rec = _record(("int2", 0.7, True, True), ("int4", 1.04, True, False))
    row = _decide(rec, alts, tuned, plain=False, tuned_within=True)
    assert row is not None and row.uniform == "int4" and rec["replaced"] == "uniform int4"
    assert rec["decision"]["chosen"] == "uniform int4"
    by = {c["plan"]: c for c in rec["decision"]["contenders"]}
    assert by["uniform int2"]["time_ratio"] is None and by["the tuned plan"]["time_ratio"] == 1.0
    assert "plan.json holds uniform int4 instead" in rec["verdict"]
    # the mix 20% ahead of int4 stands, and the verdict says why
    rec = _record(("int2", 0.7, False, False), ("int4", 1.2, True, False))
    assert _decide(rec, alts, tuned, plain=False, tuned_within=True) is None
    assert rec["replaced"] is None and rec["verdict"].startswith("the tuned plan stands: 1.2x sooner than uniform int4")
    assert "uniform int2: over the accuracy limit in its run" in rec["verdict"]
    assert math.isclose(rec["decision"]["mix_margin"], MIX_MARGIN)


def test_a_tuned_plan_over_the_limit_gives_way_to_a_recipe_within_it():
    # gpt2 of bench_autotune_repeat: a low-rank mix over the limit in its own run stood, because int4,
    # within the limit, never went as low as the mix's early losses (censored: no time ratio)
    from fastml_strategy.autotune._check import _decide

    tuned = Trial({"option": "local", "kind": "fastml", "every": 1, "choice": {"a": "lowrank2", "b": "int8"},
                   "step_s": 0.18, "objective": 1.0, "feasible": True, "use_hook": True})
    alts = [(_row("lowrank2"), "x"), (_row("int4"), "the default recipe"), (_row("int2"), "y")]
    rec = _record(("lowrank2", math.inf, False, True), ("int4", 2.1, True, True), ("int2", 1.6, True, True))
    rec["alternatives"][1]["step_s"], rec["alternatives"][2]["step_s"] = 0.38, 0.25
    rec["alternatives"][0]["step_s"] = 0.2
    row = _decide(rec, alts, tuned, plain=False, tuned_within=False)
    assert row is not None and row.uniform == "int2" and rec["replaced"] == "uniform int2"
    assert "over the accuracy limit in its own run" in rec["decision"]["why"]
    # within the limit itself, the tuned plan stands when nothing has a time to its losses
    rec = _record(("int4", 2.1, True, True))
    rec["alternatives"][0]["step_s"] = 0.38
    assert _decide(rec, alts[1:2], tuned, plain=False, tuned_within=True) is None
