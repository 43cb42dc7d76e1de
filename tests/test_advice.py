"""Advice (fastml_strategy._advice): shown with Python's default warning filters, once per kind, and the
min_numel check that catches a lossy plan compressing (nearly) nothing. The rank-0-only part runs on
real ranks in tests/test_hook_dist.py."""

from __future__ import annotations

import warnings

import pytest
import torch

from fastml_strategy import FastMLAdvice, Plan
from fastml_strategy import _advice
from fastml_strategy.hook import plan_summary


@pytest.fixture(autouse=True)
def _fresh():
    _advice._GIVEN.clear()
    yield
    _advice._GIVEN.clear()


def _params(*numels):
    return [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate(numels)]


def test_advice_is_a_user_warning_shown_once_per_kind():
    assert issubclass(FastMLAdvice, UserWarning)  # not filtered by Python's default filters
    with warnings.catch_warnings(record=True) as caught:
        warnings.resetwarnings()  # no filter at all: what `python script.py` applies to a UserWarning
        assert _advice.advise("kind", "FastML: do this")
        assert not _advice.advise("kind", "FastML: do this again")
        assert _advice.advise("other", "FastML: and that")
    assert [str(w.message) for w in caught] == ["FastML: do this", "FastML: and that"]
    assert all(w.category is FastMLAdvice for w in caught)


def test_lossy_plan_under_min_numel_is_advised():
    # a LoRA-like model: every trainable tensor under the default min_numel of 4096
    text = _advice.little_compressed(Plan.from_recipe("int4"), _params(3072, 3072, 768, 64), 2)
    assert text is not None and "compresses 0.0%" in text and "min_numel=4,096" in text, text
    assert "Plan.from_recipe('int4', min_numel=768)" in text and "4 tensors" in text, text


@pytest.mark.parametrize("plan,numels", [
    (Plan.from_recipe("int4"), (8192, 3072)),  # most bytes compressed
    (Plan.from_recipe("none"), (3072, 64)),  # nothing lossy asked for
    (Plan.from_recipe("int4").with_layers({"p0": Plan.from_recipe("none").default}), (100000, 64)),  # the plan's own choice
])
def test_no_advice_when_compression_happens_or_is_not_asked(plan, numels):
    assert _advice.little_compressed(plan, _params(*numels), 2) is None


def test_frozen_tensors_do_not_count():
    params = _params(3072, 100000)
    params[1][1].requires_grad_(False)  # a frozen base: only the adapter trains
    assert _advice.little_compressed(Plan.from_recipe("int4"), params, 2) is not None


def test_plan_summary_counts_in_the_singular():
    text = plan_summary(Plan.from_recipe("int4"), dict(_params(5000, 3)), 2)
    assert "int4: 1 tensor / 5,000 elements" in text and "fp32: 1 tensor / 3 elements" in text, text
