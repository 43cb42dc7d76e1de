"""Plan and CodecConfig: look-up order, recipes, JSON round trip, and errors that name the fix."""

from __future__ import annotations

import json

import warnings

import pytest
import torch

from fastml_strategy import RECIPES, Codec, CodecConfig, Plan
from fastml_strategy.config import PLAN_FORMAT_VERSION, resolve_plan


def test_lookup_order_exact_then_regex_then_default():
    plan = Plan(
        default=RECIPES["int4"],
        layers={"re:.*weight": RECIPES["int8"], "fc.weight": RECIPES["topk1"], "re:fc\\..*": RECIPES["fp16"]},
    )
    assert plan.for_parameter("fc.weight") == RECIPES["topk1"]  # exact beats earlier regex
    assert plan.for_parameter("head.weight") == RECIPES["int8"]  # first matching regex
    assert plan.for_parameter("fc.bias") == RECIPES["fp16"]
    assert plan.for_parameter("head.bias") == RECIPES["int4"]  # default
    # small tensors travel uncompressed whatever the plan says
    assert plan.for_parameter("fc.weight", numel=10).codec is Codec.FP32


# bytes per element on the wire against fp32, as config.py and the README state them: int4 costs
# 4 + 64/512 bits per element (ratio 7.76), 1% top-k 8 bytes per kept element (ratio 50)
RECIPE_RATIOS = {"none": 1.0, "fp16": 2.0, "bf16": 2.0, "int8": 32 / 8.125, "int4": 32 / 4.125,
                 "int2": 32 / 2.125, "int4-sr": 32 / 4.125, "topk1": 50.0, "topk1-int4": 32 / (0.01 * 36.125),
                 # a 1024 x 1024 matrix at rank r: (1024 + 1024) r factor numbers instead of 1024^2
                 **{f"lowrank{r}": 512 / r for r in (1, 2, 4, 8)}}


def test_recipes_are_the_documented_ones_and_compress_as_stated():
    from fastml_strategy import codecs

    # RECIPES is the registry's: each codec module names its own recipes (a new codec adds its own)
    assert RECIPES == {k: v for cls in codecs.registered_codecs().values() for k, v in cls.recipes.items()}
    assert set(RECIPE_RATIOS) <= set(RECIPES)
    n = 1 << 20
    for name, ratio in RECIPE_RATIOS.items():
        plan = Plan.from_recipe(name)
        assert plan.name == name and plan.default is RECIPES[name]
        assert plan.default.describe() in (name, "fp32", "topk1%", "topk1%-int4")
        got = (2 * (2 - 1) / 2 * 4 * n) / codecs.wire_bytes(n, plan.default, 2, shape=(1024, 1024))
        assert got == pytest.approx(ratio, rel=0.002), (name, got)
        assert plan.default.lossy == (name != "none")
    # the recipe's codec is exactly what reaches the wire: "none" bit-exact, the others lossy
    x = torch.randn(4096)
    assert torch.equal(codecs.roundtrip(x, RECIPES["none"])[0], x)


def test_uniform():
    assert Plan.uniform(bits=3).default == CodecConfig(codec=Codec.QUANTIZE, bits=3)
    p = Plan.uniform(bits=4, topk=0.05, error_feedback=False, stochastic=True, min_numel=10)
    assert p.default.codec is Codec.TOPK and p.default.bits == 4 and p.default.topk == 0.05
    assert not p.default.error_feedback and p.default.stochastic and p.min_numel == 10


def test_save_load_roundtrip(tmp_path):
    plan = Plan.from_recipe("int4").with_layers({"re:.*bias": RECIPES["fp16"], "a.weight": RECIPES["topk1-int4"]})
    path = tmp_path / "plan.json"
    plan.save(path)
    assert json.loads(path.read_text())["format_version"] == PLAN_FORMAT_VERSION
    back = Plan.load(path)
    assert back == plan and back.digest() == plan.digest()
    assert resolve_plan(str(path)) == plan
    assert resolve_plan(plan.to_dict()) == plan
    assert not list(tmp_path.glob(".*tmp")), "no temporary file left behind"


def test_intra_node_codec_round_trips_and_refuses_lossy_codes(tmp_path):
    plan = Plan.from_recipe("int4", intra_node="bf16")
    assert plan.intra_node == RECIPES["bf16"] and plan.intra_node_dtype == torch.bfloat16
    assert Plan.from_recipe("int4", intra_node="fp16").intra_node_dtype == torch.float16
    assert Plan.from_recipe("int4", intra_node="none").intra_node_dtype is None
    plan.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back == plan and back.digest() == plan.digest()
    # it shapes the wire: ranks with and without it disagree on the digest; unset, the file is as before
    assert plan.digest() != Plan.from_recipe("int4").digest()
    assert "intra_node" not in Plan.from_recipe("int4").to_dict()
    for bad in ("int8", RECIPES["topk1"]):
        with pytest.raises(ValueError, match=r"intra_node is (int8|topk).*takes \['bf16', 'fp16', 'fp32'\] only"):
            Plan.from_recipe("int4", intra_node=bad)
    with pytest.raises(ValueError, match="intra_node is 'int5'"):
        Plan.from_recipe("int4", intra_node="int5")
    with pytest.raises(ValueError, match=r"plan.intra_node: bits"):
        Plan.from_dict({"format_version": 1, "intra_node": {"codec": "quantize", "bits": 0}})


@pytest.mark.parametrize(
    "cfg,field",
    [
        (dict(codec="quantize", bits=0), "bits"),
        (dict(codec="quantize", bits=9), "bits"),
        (dict(codec="quantize", bits=None), "bits"),
        (dict(codec="topk", topk=0.0), "topk"),
        (dict(codec="topk", topk=1.5), "topk"),
        (dict(codec="topk"), "topk"),
        (dict(codec="quantize", bits=4, block_size=100), "block_size"),
        (dict(codec="int5"), "codec"),
        (dict(codec="quantize", bits=4, colour="red"), "colour"),
    ],
)
def test_invalid_codec_settings_name_the_field(cfg, field):
    with pytest.raises(ValueError, match=field):
        Plan.from_dict({"format_version": 1, "default": cfg})


def test_unknown_recipe_and_version():
    with pytest.raises(ValueError, match="unknown recipe 'int5'"):
        Plan.from_recipe("int5")
    with pytest.raises(ValueError, match="format_version 99"):
        Plan.from_dict({"format_version": 99, "default": {"codec": "fp16"}})
    with pytest.raises(ValueError, match="neither a recipe"):
        resolve_plan("int5")


def test_plan_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Plan.load(bad)
    with pytest.raises(ValueError, match="does not exist"):
        Plan.load(tmp_path / "missing.json")


def test_check_parameters_names_unknown():
    plan = Plan.from_recipe("int4").with_layers({"enc.weight": RECIPES["int8"], "re:dec\\..*": RECIPES["int2"]})
    with pytest.raises(ValueError, match="enc.weight") as e:
        plan.check_parameters(["fc.weight", "fc.bias"])
    assert "re:dec" not in str(e.value)  # a pattern that matches nothing is a note, not an error
    with pytest.warns(UserWarning, match=r"re:dec.*matches no parameter"):
        plan.check_parameters(["enc.weight", "fc.bias"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan.check_parameters(["enc.weight", "dec.bias"])


def test_plan_names_an_alias_or_a_frozen_parameter():
    plan = Plan.from_recipe("int4").with_layers({"head.weight": RECIPES["int8"], "enc.weight": RECIPES["int2"]})
    resolved, notes = plan.resolve_names(["tok.weight", "head.bias"], aliases={"head.weight": "tok.weight"},
                                         frozen=["enc.weight"])
    assert resolved.for_parameter("tok.weight") == RECIPES["int8"]  # the alias resolves to its parameter
    assert resolved.for_parameter("enc.weight") == RECIPES["int2"]  # kept for when it trains
    assert any("another name of 'tok.weight'" in n for n in notes)
    assert any("'enc.weight' is frozen" in n for n in notes)
    assert plan.digest() != resolved.digest()


def test_env_plan(monkeypatch):
    monkeypatch.setenv("FASTML_PLAN", "int2")
    assert resolve_plan(None).default.bits == 2
    monkeypatch.delenv("FASTML_PLAN")
    assert resolve_plan(None).name == "int4"


# -- messages a user acts on (issue 34, items 7 and 14) ----------------------------------------------------
def test_recipe_typo_suggests_the_recipe():
    with pytest.raises(ValueError, match=r"did you mean 'int4'"):
        Plan.from_recipe("in4")
    with pytest.raises(ValueError, match=r"did you mean 'int8'"):
        resolve_plan("int88")


@pytest.mark.parametrize("field,value,needle", [
    ("bits", "4", "bits must be an integer, got the string '4'"),
    ("bits", 4.0, "bits must be an integer, got 4.0"),
    ("block_size", "512", "block_size must be an integer, got the string '512'"),
])
def test_quoted_number_is_refused_as_a_type_error_not_a_range(field, value, needle):
    d = {"format_version": PLAN_FORMAT_VERSION, "default": {"codec": "quantize", "bits": 4, field: value}}
    with pytest.raises(ValueError) as e:
        Plan.from_dict(d)
    assert needle in str(e.value) and "outside 1-8" not in str(e.value), str(e.value)


def test_plan_differences_name_the_field_and_each_rank_value():
    from fastml_strategy.comm._distributed import _plan_differences

    plans = [Plan.from_recipe("int4"), Plan.from_recipe("int4", intra_node="bf16"),
             Plan.from_recipe("int4", intra_node="fp16")]
    text = _plan_differences([(None,) * 6 + (p.to_dict(),) for p in plans])
    assert text == ": they differ in intra_node (rank 0: absent, rank 1: 'bf16', rank 2: 'fp16')", text
    text = _plan_differences([(None,) * 6 + (p.to_dict(),) for p in plans[1:]])
    assert text == ": they differ in intra_node.codec (rank 0: 'bf16', rank 1: 'fp16')", text
    text = _plan_differences([(None,) * 6 + (Plan.from_recipe("int4").to_dict(),),
                              (None,) * 6 + (Plan.from_recipe("int4", min_numel=8).to_dict(),)])
    assert text == ": they differ in min_numel (rank 0: 4096, rank 1: 8)", text
    assert _plan_differences([(None,) * 6]) == ""  # an older build sends no plan
