"""Plan files of the release before the codec registry (main 263ab2c) still load and give the same
bytes: the same JSON text when saved again (so the same plan digest, which ranks and checkpoints
compare), the same settings, the same encoded sizes and predicted wire bytes, and the same bytes on
the wire for fixed inputs.

``tests/data/plan_release_263ab2c.json`` (every recipe of that release and the corners of what each
codec read) and ``..._bytes.json`` were written by ``tests/data/make_release_plan.py`` running on the
code of 263ab2c; they are never regenerated."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from fastml_strategy import CodecConfig, Plan, codecs
from test_wire_digests import make_input

DATA = Path(__file__).with_name("data")
PLAN = DATA / "plan_release_263ab2c.json"
BYTES = json.loads((DATA / "plan_release_263ab2c_bytes.json").read_text())
SHAPES = {1: (1,), 13: (13,), 1000: (40, 25), 4099: (4099,)}


def _layers(plan: Plan):
    return (("default", plan.default), *plan.layers)


def test_release_plans_load_and_save_to_the_same_text():
    for name, key in ((PLAN.name, "plan_digest"), ("plan_release_263ab2c_local.json", "local_digest")):
        text = (DATA / name).read_text()
        plan = Plan.load(DATA / name)
        assert plan.to_json() == text, f"{name}: saving the loaded plan changed its text"
        assert plan.digest() == BYTES[key]


def test_release_plan_settings_and_sizes():
    plan = Plan.load(PLAN)
    assert [k for k, _ in _layers(plan)] == list(BYTES["layers"])
    for key, cfg in _layers(plan):
        row = BYTES["layers"][key]
        assert cfg.describe() == row["describe"], key
        codec = codecs.codec_for(cfg)
        for n in (1, 13, 1000, 4099):
            assert codec.nbytes(n) == row["nbytes"][str(n)], (key, n)
            assert [codecs.wire_bytes(n, cfg, w, SHAPES[n]) for w in (2, 3, 8)] == row["wire_bytes"][str(n)], (key, n)


@pytest.mark.parametrize("path", ["torch", "auto"])
def test_release_plan_gives_the_same_wire_bytes(path, monkeypatch):
    """The bytes each layer's codec puts on the wire (encode, two error-feedback steps and the residual,
    the reduce step) and its local round trip, for fixed inputs, on the reference and the default path.
    A low-rank layer's matrix round trip is a matmul (its float sums follow the BLAS build), so only its
    size is compared there."""
    if path == "torch":
        monkeypatch.setenv("FASTML_CPU_KERNEL", "0")
    plan = Plan.load(PLAN)
    for key, cfg in _layers(plan):
        row = BYTES["layers"][key]
        codec = codecs.codec_for(cfg)
        for i, n in enumerate((1, 13, 1000, 4099)):
            h = hashlib.sha256()
            for part in codec.wire_sample(make_input(n, torch.float32, seed=500 + i), seed=3 + i):
                h.update(part.contiguous().numpy().tobytes())
            assert h.hexdigest() == row["sample"][str(n)], (key, n)
            x = make_input(n, torch.float32, seed=600 + i).view(SHAPES[n])
            y, nb = codecs.roundtrip(x, cfg, seed=1)
            want_nb, want_hash = row["roundtrip"][str(n)]
            assert nb == want_nb, (key, n)
            if not (codec.lowrank and codec.compressible(SHAPES[n])):
                assert hashlib.sha256(y.contiguous().numpy().tobytes()).hexdigest() == want_hash, (key, n)


def test_flat_record_fields_a_codec_does_not_read_load_as_the_record_wrote_them():
    """Plan format 1 wrote every codec's fields for every codec, at the record's defaults where the
    codec did not read them: such a file still loads, and the settings object holds only its own
    fields. Any other value there is a setting that would do nothing (``topk`` on quantize is not
    top-k, ``bits`` on fp16 not int4): refused, naming the codecs that read it, not dropped."""
    cfg = CodecConfig.from_dict({"codec": "fp16", "bits": None, "block_size": 512, "stochastic": False,
                                 "topk": None, "topk_count": None, "error_feedback": True,
                                 "residual_dtype": "fp32", "fallback_bits": 8})
    assert cfg == CodecConfig(codec="fp16") and not hasattr(cfg, "bits")
    q = CodecConfig(codec="quantize", bits=4, topk=None, fallback_bits=8, rank=4)
    assert q == codecs.QuantizeConfig(bits=4) and not hasattr(q, "rank") and not hasattr(q, "topk")
    # a codec without a residual has no error feedback either way
    assert CodecConfig(codec="bf16", error_feedback=False) == CodecConfig(codec="bf16")
    for d, field, readers in [({"codec": "fp16", "bits": 3}, "bits", "quantize, topk"),
                              ({"codec": "quantize", "bits": 4, "topk": 0.01}, "topk", "topk"),
                              ({"codec": "quantize", "bits": 4, "rank": 2}, "rank", "lowrank"),
                              ({"codec": "fp32", "residual_dtype": "bf16"}, "residual_dtype", "fp8, lowrank"),
                              ({"codec": "lowrank", "rank": 2, "stochastic": True}, "stochastic", "quantize, topk"),
                              ({"codec": "quantize", "bits": 4, "fallback_bits": 4}, "fallback_bits", "topk")]:
        with pytest.raises(ValueError, match=rf"codec: the {d['codec']} codec does not read {field}=.*"
                                             rf"reads {field} \({readers}"):
            CodecConfig.from_dict(d)
        with pytest.raises(ValueError, match="does not read"):  # and in a plan, on every path
            Plan.from_dict({"format_version": 1, "default": d})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['colour'\]"):
        CodecConfig.from_dict({"codec": "quantize", "bits": 4, "colour": 1})
