"""Property-based fuzzing (hypothesis) of every codec and of the plan loader.

Codecs: random shapes (empty included), dtypes (fp32/fp16/bf16), values (zeros, subnormals, huge ~1e38,
NaN/inf), bit widths, sparsities, block sizes. Every codec must never crash, and

- finite input: the error respects the codec's bound (round to nearest: half a quantization step per
  element, plus fp32 rounding; stochastic rounding: one step), except a quantization block whose
  range exceeds fp32 (max - min > FLT_MAX), which no (min, scale) pair can represent: it decodes to
  NaN, like a non-finite block, so the step is skipped rather than silently wrong;
- non-finite input: the output is non-finite too (so every rank sees it and skips the step), and error
  feedback leaves the residual of that block unchanged;
- with error feedback: decoded + new residual == input + old residual (to fp32 rounding), residuals
  stay finite; every backend (torch reference, compiled CPU, Triton interpreter) writes the same bytes.

Plan loader: random JSON, mutated valid plans, truncated and binary files: always a Plan or a
ValueError with a message, never another exception.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastml_strategy import RECIPES, CodecConfig, Plan, codecs, kernels
from fastml_strategy.config import Codec

# Triton's interpreter (numpy) warns on the overflows these inputs are made of.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

FLT_MAX = 3.4028234663852886e38
EPS = 2.0 ** -23  # fp32 machine epsilon (spacing at 1)
# Absolute slack for subnormal arithmetic: when the scale is subnormal, 1/scale may overflow and the
# codes degrade, but the error stays below the block's range, itself below L * 2**-126 <= 2**-118.
TINY = 2.0 ** -118

FUZZ = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# -- inputs -------------------------------------------------------------------------------------------
SPECIALS = [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, FLT_MAX, -FLT_MAX, 1e-45, -1e-45,
            1.17549435e-38, 3e38, -3e38]


@st.composite
def tensors(draw, max_numel: int = 600, finite: bool | None = None):
    """A tensor of a random shape and dtype; values from one of several regimes, plus a few specials."""
    ndim = draw(st.integers(1, 3))
    limit = {1: max_numel, 2: 30, 3: 9}[ndim]
    shape = tuple(draw(st.integers(0, limit)) for _ in range(ndim))
    n = math.prod(shape)
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    regime = draw(st.sampled_from(["normal", "zeros", "subnormal", "huge", "wide", "constant"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    if regime == "normal":
        v = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** draw(st.integers(-6, 6))
    elif regime == "zeros":
        v = torch.zeros(n, dtype=torch.float64)
    elif regime == "subnormal":
        v = torch.randn(n, generator=g, dtype=torch.float64) * 1e-41
    elif regime == "huge":  # both signs near fp32's limit: max - min overflows fp32
        v = (torch.rand(n, generator=g, dtype=torch.float64) * 2 - 1) * 3.4e38
    elif regime == "wide":  # magnitudes from 1e-40 to 1e38 side by side
        v = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** (
            torch.rand(n, generator=g, dtype=torch.float64) * 78 - 40)
    else:
        v = torch.full((n,), draw(st.floats(-1e30, 1e30)), dtype=torch.float64)
    v = v.to(torch.float32)
    if n and (finite is not True):
        specials = draw(st.lists(st.tuples(st.integers(0, n - 1), st.sampled_from(SPECIALS)),
                                 max_size=3))
        for i, s in specials:
            v[i] = s
    if finite is True:
        v = torch.nan_to_num(v, nan=0.0, posinf=FLT_MAX, neginf=-FLT_MAX)
    elif finite is False and n:
        v[draw(st.integers(0, n - 1))] = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
    x = v.to(dtype)  # fp16/bf16 may round huge values to inf: then the input is non-finite
    return x.reshape(shape)


def dense_configs():
    quant = st.builds(
        lambda bits, bs, sr: CodecConfig(codec=Codec.QUANTIZE, bits=bits, block_size=bs, stochastic=sr),
        st.integers(1, 8), st.sampled_from([8, 16, 64, 512, 4096]), st.booleans())
    casts = st.sampled_from([CodecConfig(codec=c) for c in (Codec.FP32, Codec.FP16, Codec.BF16)])
    return st.one_of(quant, casts)


def topk_configs():
    frac = st.floats(1e-4, 1.0, exclude_min=False)
    return st.one_of(
        st.builds(lambda f, b, bs: CodecConfig(codec=Codec.TOPK, topk=f, bits=b, block_size=bs),
                  frac, st.one_of(st.none(), st.integers(1, 8)), st.sampled_from([8, 64, 512])),
        st.builds(lambda c, b: CodecConfig(codec=Codec.TOPK, topk_count=c, bits=b),
                  st.integers(1, 5000), st.one_of(st.none(), st.integers(1, 8))),
    )


# -- bounds ---------------------------------------------------------------------------------------------
def quantize_check(v: torch.Tensor, y: torch.Tensor, bits: int, block_size: int, stochastic: bool,
                   where: str) -> None:
    """``y`` (fp32) decodes ``v`` (fp32, flat) under the quantize codec: per block, within the bound
    when the block is finite and representable, all NaN when it is not."""
    L = (1 << bits) - 1
    n = v.numel()
    assert y.shape == (n,) and y.dtype == torch.float32, where
    v64, y64 = v.double(), y.double()
    for start in range(0, n, block_size):
        b = slice(start, min(n, start + block_size))
        vb, yb = v64[b], y64[b]
        if not bool(torch.isfinite(vb).all()):
            assert bool(torch.isnan(yb).all()), f"{where}: non-finite block {start} must decode to NaN"
            continue
        mn, mx = float(vb.min()), float(vb.max())
        rng = mx - mn
        if rng > FLT_MAX * (1 - 2 ** -20):
            # Beyond fp32's range (or within rounding of it): not representable, so all NaN; right at
            # the edge, a representable block must still honour the bound.
            if rng > FLT_MAX * (1 + 2 ** -20) or bool(torch.isnan(yb).all()):
                assert bool(torch.isnan(yb).all()), f"{where}: block {start} spans {rng:.3g} > FLT_MAX"
                continue
        assert bool(torch.isfinite(yb).all()), f"{where}: finite block {start} decoded to non-finite"
        scale = rng / L * (1 + 2 * EPS)  # the fp32 scale is (mx - mn) / L rounded twice
        step = 1.0 if stochastic else 0.5
        bound = scale * (step + 2 ** -13) + 4 * EPS * (rng + abs(mn) + vb.abs()) + TINY
        err = (yb - vb).abs()
        bad = err > bound
        assert not bool(bad.any()), (
            f"{where}: block {start}: max error {float(err.max()):.6g} over the bound "
            f"(scale {scale:.6g}, L {L}, at {int(bad.nonzero()[0])}: v={float(vb[bad][0])!r}, "
            f"y={float(yb[bad][0])!r})")


def cast_check(x32: torch.Tensor, y: torch.Tensor, dtype: torch.dtype, where: str) -> None:
    mant, top = (10, 65504.0) if dtype is torch.float16 else (7, 3.3895313892515355e38)
    tiny = 2.0 ** (-25 if dtype is torch.float16 else -134)  # half the smallest subnormal
    x64, y64 = x32.double(), y.double()
    fin = torch.isfinite(x64)
    assert torch.equal(torch.isnan(y64), torch.isnan(x64)), f"{where}: NaN must stay NaN"
    overflow = fin & (x64.abs() >= top * (1 + 2.0 ** -(mant + 1)))
    assert bool(torch.isinf(y64[overflow]).all()), f"{where}: values past the dtype's max become inf"
    ok = fin & ~overflow
    bound = x64[ok].abs() * 2.0 ** -(mant + 1) + tiny
    assert bool(((y64[ok] - x64[ok]).abs() <= bound).all()), f"{where}: cast error over half an ulp"
    inf = torch.isinf(x64)
    assert torch.equal(y64[inf], x64[inf]), f"{where}: inf must stay inf"


# -- codecs.roundtrip (the path the hook and the autotuner use) ---------------------------------------------
@FUZZ
@given(x=tensors(), cfg=dense_configs(), seed=st.integers(0, 2**32 - 1))
def test_dense_codecs_roundtrip(x, cfg, seed):
    y, nbytes = codecs.roundtrip(x, cfg, seed=seed)
    n = x.numel()
    assert y.shape == x.shape and y.dtype == torch.float32
    assert nbytes == codecs.dense_nbytes(n, cfg)
    x32, y = x.reshape(-1).to(torch.float32), y.reshape(-1)
    where = f"{cfg.describe()} bs={getattr(cfg, 'block_size', None)} n={n} {x.dtype}"
    if cfg.codec is Codec.FP32:
        assert torch.equal(y.nan_to_num(1.0), x32.nan_to_num(1.0)) and torch.equal(
            torch.isnan(y), torch.isnan(x32)), where
    elif cfg.codec in (Codec.FP16, Codec.BF16):
        cast_check(x32, y, torch.float16 if cfg.codec is Codec.FP16 else torch.bfloat16, where)
    else:
        quantize_check(x32, y, cfg.bits, cfg.block_size, cfg.stochastic, where)


@FUZZ
@given(x=tensors(), cfg=topk_configs(), seed=st.integers(0, 2**32 - 1))
def test_topk_codecs_roundtrip(x, cfg, seed):
    n = x.numel()
    y, nbytes = codecs.roundtrip(x, cfg, seed=seed)
    assert y.shape == x.shape and nbytes == codecs.topk_nbytes(n, cfg)
    if n == 0:
        return
    v = x.reshape(-1).to(torch.float32)
    where = f"{cfg.describe()} n={n} {x.dtype}"
    buf = torch.empty(codecs.topk_nbytes(n, cfg), dtype=torch.uint8)
    idx, sent = codecs.encode_topk(v.clone(), cfg, buf, seed=seed)
    k = cfg.topk_k(n)
    assert idx.numel() == k == sent.numel() and len(set(idx.tolist())) == k, where
    if not bool(torch.isfinite(v).all()):
        # A NaN/inf anywhere must reach the receivers, so the step is skipped everywhere.
        assert not bool(torch.isfinite(y).all()), f"{where}: non-finite input decoded to finite"
        return
    kept = torch.zeros(n, dtype=torch.bool)
    kept[idx] = True
    y = y.reshape(-1)
    assert bool((y[~kept] == 0).all()), f"{where}: an unselected entry was sent"
    if (~kept).any():  # top-k: nothing dropped is larger than anything kept
        assert float(v[~kept].abs().max()) <= float(v[kept].abs().min()), where
    if cfg.bits is None:
        assert torch.equal(y[idx], v[idx]), f"{where}: fp32 values must arrive exactly"
    else:
        quantize_check(v[idx], sent, cfg.bits, cfg.block_size, cfg.stochastic, where)
        assert torch.equal(y[idx].nan_to_num(7.0), sent.nan_to_num(7.0)), where


# -- kernels.quantize / dequantize with error feedback, every backend ---------------------------------------
BACKENDS = kernels.available_backends("cpu")


@FUZZ
@given(x=tensors(max_numel=300), bits=st.integers(1, 8), bs=st.sampled_from([8, 32, 128, 512]),
       stochastic=st.booleans(), seed=st.integers(0, 2**32 - 1),
       res_scale=st.sampled_from([0.0, 1e-3, 1.0, 1e38]))
def test_quantize_kernels_error_feedback(x, bits, bs, stochastic, seed, res_scale):
    n = x.numel()
    x = x.reshape(-1)
    g = torch.Generator().manual_seed(seed % 2**31)
    r = (torch.randn(n, generator=g, dtype=torch.float64) * res_scale).clamp(-FLT_MAX, FLT_MAX).float()
    outs = {}
    for be in BACKENDS:
        r_out = torch.full((n,), 12345.0)
        packed, meta = kernels.quantize(x, bits, bs, stochastic, seed, residual=r, residual_out=r_out,
                                        backend=be)
        y = kernels.dequantize(packed, meta, n, bits, bs, backend=be)
        outs[be] = (packed, meta, r_out, y)
    ref = outs["torch"]
    for be, got in outs.items():  # every backend writes the same bytes
        for a, b in zip(got, ref):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float32 else a,
                               b.view(torch.uint8) if b.dtype == torch.float32 else b), be
    packed, meta, r_out, y = ref
    assert packed.numel() == kernels.packed_nbytes(n, bits) and meta.shape == (kernels.num_blocks(n, bs), 2)
    v = x.to(torch.float32) + r  # what the codec encodes
    where = f"int{bits} bs={bs} sr={stochastic} n={n} {x.dtype} res~{res_scale:g}"
    quantize_check(v, y, bits, bs, stochastic, where)
    for blk in range(kernels.num_blocks(n, bs)):
        b = slice(blk * bs, min(n, (blk + 1) * bs))
        if bool(torch.isfinite(meta[blk]).all()):
            # error feedback: decoded + new residual == input + old residual, to fp32 rounding
            assert bool(torch.isfinite(y[b]).all() and torch.isfinite(r_out[b]).all()), where
            gap = (y[b].double() + r_out[b].double() - v[b].double()).abs()
            assert bool((gap <= EPS * (v[b] - y[b]).double().abs()).all()), f"{where}: EF identity"
        else:
            assert bool(torch.isnan(meta[blk]).all()), f"{where}: half-NaN metadata"
            assert bool(torch.isnan(y[b]).all()), f"{where}: non-finite block decodes to NaN"
            assert torch.equal(r_out[b], r[b]), f"{where}: non-finite block must keep its residual"


@FUZZ
@given(x=tensors(max_numel=300), frac=st.floats(0.001, 1.0), bits=st.one_of(st.none(), st.integers(1, 8)),
       res_scale=st.sampled_from([0.0, 1e-3, 1e38]), seed=st.integers(0, 2**31 - 1))
def test_topk_chunk_error_feedback(x, frac, bits, res_scale, seed):
    """The live top-k path (codecs.encode_chunk / decode_chunk) with error feedback."""
    x = x.reshape(-1).to(torch.float32)
    n = x.numel()
    if n == 0:
        return
    k = max(1, min(n, int(n * frac)))
    cfg = CodecConfig(codec=Codec.TOPK, topk_count=k, bits=bits, block_size=64)
    g = torch.Generator().manual_seed(seed)
    r = (torch.randn(n, generator=g, dtype=torch.float64) * res_scale).clamp(-FLT_MAX, FLT_MAX).float()
    r_out = torch.full((n,), 12345.0)
    buf = torch.empty(codecs.chunk_nbytes(n, cfg), dtype=torch.uint8)
    codecs.encode_chunk(x, cfg, buf, residual=r, residual_out=r_out, seed=seed)
    out = torch.zeros(n)
    codecs.decode_chunk(buf, n, cfg, out)
    assert bool(codecs.chunk_finite(buf, n, cfg)) == bool(torch.isfinite(out).all())
    acc = x + r
    where = f"topk k={k} bits={bits} n={n} res~{res_scale:g}"
    if bool(torch.isfinite(out).all()):
        # What was sent plus what is kept back is exactly what there was to send.
        gap = (out.double() + r_out.double() - acc.double()).abs()
        assert bool((gap <= EPS * (acc - out).double().abs()).all()), f"{where}: EF identity"
        assert bool(torch.isfinite(r_out).all()), where
    else:
        # Nothing usable was sent: the residual must not move (the step will be skipped everywhere).
        assert torch.equal(r_out, r), f"{where}: residual changed although the message is non-finite"
    if not bool(torch.isfinite(acc).all()):
        assert not bool(torch.isfinite(out).all()), f"{where}: a NaN/inf must reach the receiver"


# -- regressions found by the fuzzing above ------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_range_beyond_fp32_is_nonfinite_not_inf(backend, bits):
    """A block spanning more than fp32's range ([-3e38, 3e38]) used to keep finite metadata and decode
    its top values to inf (or, for 1 bit, to a wrong finite value), and error feedback then stored
    -inf residuals. It is now non-finite: NaN metadata, decodes to NaN, residual unchanged."""
    bs = 8
    x = torch.cat([torch.tensor([-3e38, 3e38, 1e38, 0.0, 5.0, -2e38, 1.0, 2.0]), torch.randn(8)])
    r = torch.randn(16) * 1e-3
    r_out = torch.full((16,), 7.0)
    packed, meta = kernels.quantize(x, bits, bs, residual=r, residual_out=r_out, backend=backend)
    y = kernels.dequantize(packed, meta, 16, bits, bs, backend=backend)
    assert bool(torch.isnan(meta[0]).all()) and bool(torch.isnan(y[:8]).all())
    assert torch.equal(r_out[:8], r[:8])
    assert bool(torch.isfinite(meta[1]).all()) and bool(torch.isfinite(y[8:]).all())
    quantize_check(x + r, y, bits, bs, False, f"{backend} int{bits}")


def test_topk_keeps_the_residual_when_quantized_values_are_not_representable():
    """Found by the fuzzing: finite values spanning more than fp32's range quantize to NaN, yet a
    new residual was stored as if they had been sent."""
    cfg = CodecConfig(codec=Codec.TOPK, topk_count=3, bits=1, block_size=8)
    r = torch.tensor([3e38, -3e38, 1.0])
    r_out = torch.full((3,), 7.0)
    buf = torch.empty(codecs.chunk_nbytes(3, cfg), dtype=torch.uint8)
    codecs.encode_chunk(torch.zeros(3), cfg, buf, residual=r, residual_out=r_out)
    assert not bool(codecs.chunk_finite(buf, 3, cfg))
    assert torch.equal(r_out, r)


def test_topk_of_an_empty_tensor():
    """A zero-element parameter under top-k (min_numel=0) crashed torch.topk (k=1 of 0)."""
    for cfg in (RECIPES["topk1"], RECIPES["topk1-int4"], CodecConfig(codec=Codec.TOPK, topk_count=3)):
        y, nbytes = codecs.roundtrip(torch.empty(0, 5), cfg)
        assert y.shape == (0, 5) and nbytes == 0
        assert codecs.wire_bytes(0, cfg, 2) == 0


# -- the plan loader ----------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=12,
)
PLAN_KEYS = ["format_version", "default", "layers", "min_numel", "seed", "name", "meta"]
CODEC_KEYS = ["codec", "bits", "block_size", "stochastic", "topk", "topk_count", "error_feedback",
              "fallback_bits"]
GOOD = [Plan.from_recipe(r).to_dict() for r in sorted(RECIPES)] + [
    Plan.from_recipe("int4").with_layers({"0.weight": RECIPES["topk1-int4"],
                                          "re:.*bias": RECIPES["fp16"]}).to_dict()]


def _expect_plan_or_value_error(fn):
    try:
        plan = fn()
    except ValueError as e:
        assert str(e), "a ValueError must say what is wrong"
        return None
    assert isinstance(plan, Plan)
    assert Plan.from_dict(plan.to_dict()) == plan  # what loads, round-trips
    return plan


@FUZZ
@given(d=json_values)
def test_plan_from_random_json(d):
    _expect_plan_or_value_error(lambda: Plan.from_dict(d))


@st.composite
def mutated_plans(draw):
    d = json.loads(json.dumps(draw(st.sampled_from(GOOD))))
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(["plan", "default", "layer"]))
        if target == "plan":
            obj, keys = d, PLAN_KEYS
        elif target == "default" and isinstance(d.get("default"), dict):
            obj, keys = d["default"], CODEC_KEYS
        elif isinstance(d.get("layers"), dict) and d["layers"]:
            obj = d["layers"][draw(st.sampled_from(sorted(d["layers"])))]
            keys = CODEC_KEYS
            if not isinstance(obj, dict):
                continue
        else:
            continue
        key = draw(st.sampled_from(keys + ["unknown_field"]))
        if draw(st.integers(0, 4)) == 0:
            obj.pop(key, None)
        else:
            obj[key] = draw(json_values | st.sampled_from(
                [0, -1, 9, 1.5, "4", True, 1e400, float("nan"), [], {}, "quantize", "topk", 0.0, 2.0]))
    return d


@FUZZ
@given(d=mutated_plans())
def test_plan_from_mutated_dict(d):
    _expect_plan_or_value_error(lambda: Plan.from_dict(d))


@FUZZ
@given(good=st.sampled_from(GOOD), cut=st.floats(0.0, 1.0), junk=st.binary(max_size=40),
       mode=st.sampled_from(["truncate", "binary", "append", "json_value"]), value=json_values)
def test_plan_load_corrupted_file(tmp_path_factory, good, cut, junk, mode, value):
    path = tmp_path_factory.mktemp("plans") / "plan.json"
    text = json.dumps(good, indent=2).encode()
    if mode == "truncate":
        data = text[: int(len(text) * cut)]
    elif mode == "binary":
        data = junk
    elif mode == "append":
        data = text + junk
    else:
        data = json.dumps(value).encode()
    path.write_bytes(data)
    _expect_plan_or_value_error(lambda: Plan.load(path))


@pytest.mark.parametrize("content", [
    b"[" * 100000,                      # nesting deeper than the JSON parser's recursion limit
    b'{"format_version": 1, "min_numel": 1' + b"0" * 5000 + b"}",  # an int past Python's digit limit
    b"\xff\xfe\x00garbage",             # not UTF-8
    b"",                                # empty file
    b'{"format_version": true}',        # a bool is not a version
], ids=["deep-nesting", "huge-int", "not-utf8", "empty", "bool-version"])
def test_plan_load_pathological_files(tmp_path, content):
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="plan"):
        Plan.load(path)


def test_plan_load_directory_and_missing(tmp_path):
    with pytest.raises(ValueError, match="directory"):
        Plan.load(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        Plan.load(tmp_path / "nope.json")
