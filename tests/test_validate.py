"""The one check for whole-number settings, FASTML_* variables and renamed keywords."""

from __future__ import annotations

import pytest

from fastml_strategy._validate import env_whole_number, renamed, whole_number


def test_whole_number_accepts_ints_and_names_the_fix():
    assert whole_number("every", 3) == 3 and whole_number("delay", 0, 0) == 0
    for bad in (0, -1, 1.5, True, "2", None):
        with pytest.raises(ValueError, match=r"LocalSGD: every=.*; use a whole number >= 1$"):
            whole_number("every", bad, owner="LocalSGD")
    with pytest.raises(ValueError, match=r"register_hook: layer_stats_every=-1; use a whole number >= 0 \(0 turns"):
        whole_number("layer_stats_every", -1, 0, owner="register_hook", note=" (0 turns it off)")


def test_env_whole_number_argument_then_variable_then_default(monkeypatch):
    var = "FASTML_LAYER_STATS_EVERY"
    monkeypatch.delenv(var, raising=False)
    assert env_whole_number(var, None, 10) == 10
    monkeypatch.setenv(var, " 4 ")
    assert env_whole_number(var, None, 10) == 4
    assert env_whole_number(var, 7, 10) == 7, "an argument wins over the variable"
    monkeypatch.setenv(var, "")
    assert env_whole_number(var, None, 10) == 10, "a blank variable is unset"
    monkeypatch.setenv(var, "often")
    with pytest.raises(ValueError, match=r"FASTML_LAYER_STATS_EVERY='often' is not a whole number; set it to N >= 1"):
        env_whole_number(var, None, 10)
    monkeypatch.setenv(var, "-3")
    with pytest.raises(ValueError, match=r"FASTML_LAYER_STATS_EVERY='-3'; set it to a whole number >= 0"):
        env_whole_number(var, None, 10)
    with pytest.raises(ValueError, match=r"layer_stats_every=1.5; use a whole number >= 0"):
        env_whole_number(var, 1.5, 10)


def test_renamed_keyword_warns_and_refuses_both():
    assert renamed("S", "layer_errors_every_n_steps", None, "layer_stats_every", 5) == 5
    with pytest.warns(FutureWarning, match="layer_errors_every_n_steps= is deprecated.*layer_stats_every=3"):
        assert renamed("S", "layer_errors_every_n_steps", 3, "layer_stats_every", None) == 3
    with pytest.raises(TypeError, match="pass only layer_stats_every="):
        renamed("S", "layer_errors_every_n_steps", 3, "layer_stats_every", 4)
