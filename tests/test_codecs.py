"""Contract tests run against every codec: round trip within the codec's bound, zeros, NaN/inf,
JSON round trip, error-feedback identity; the wire interface (sizes, finiteness); and the sampled
top-k selection against exact top-k semantics on tensors past 65,536 elements."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from fastml_strategy import RECIPES, Codec, CodecConfig, Plan
from fastml_strategy import codecs
from fastml_strategy.kernels import dequantize, quantize

CODECS = {
    **{name: cfg for name, cfg in RECIPES.items()},
    "int1": CodecConfig(codec=Codec.QUANTIZE, bits=1),
    "int3-b64": CodecConfig(codec=Codec.QUANTIZE, bits=3, block_size=64),
    "int7-sr": CodecConfig(codec=Codec.QUANTIZE, bits=7, stochastic=True),
    "topk10-int8": CodecConfig(codec=Codec.TOPK, topk=0.1, bits=8),
    "topk-count": CodecConfig(codec=Codec.TOPK, topk_count=17),
}


@pytest.fixture(params=sorted(CODECS), ids=sorted(CODECS))
def cfg(request):
    return CODECS[request.param]


@pytest.mark.parametrize("n", [1, 13, 1000, 4099])
def test_roundtrip_within_bound(cfg, n):
    torch.manual_seed(n)
    x = torch.randn(n) * 3
    y, nbytes = codecs.roundtrip(x, cfg)
    assert y.shape == x.shape and y.dtype == torch.float32
    if cfg.codec is Codec.FP32:
        assert torch.equal(x, y) and nbytes == 4 * n
    elif cfg.codec in (Codec.FP16, Codec.BF16):
        dt = torch.float16 if cfg.codec is Codec.FP16 else torch.bfloat16
        assert torch.equal(y, x.to(dt).float())
    elif cfg.codec is Codec.LOWRANK:  # a flat vector is no matrix: its fallback, fp32, exact
        assert torch.equal(x, y) and nbytes == 4 * n
    elif cfg.codec is Codec.QUANTIZE:
        levels = 2**cfg.bits - 1
        blocks = x.split(cfg.block_size)
        step = torch.cat([(b.max() - b.min()).expand(b.numel()) / levels for b in blocks])
        bound = step * (1.0 if cfg.stochastic else 0.5) * (1 + 1e-5) + 1e-6
        assert ((y - x).abs() <= bound).all()
    elif cfg.codec is Codec.TOPK:
        k = cfg.topk_k(n)
        kept = y != 0
        assert int(kept.sum()) <= k
        # the kept entries are the largest magnitudes: everything dropped is no larger than what's kept
        if kept.any() and (~kept).any():
            assert x[~kept].abs().max() <= x[kept].abs().min() + 1e-6
        if cfg.bits is None:
            assert torch.equal(y[kept], x[kept])
    else:  # a codec added since (its own bound is its module's test; the contract's bound here)
        assert float((y - x).abs().max()) <= 2 * float(x.abs().max())


def test_zeros(cfg):
    y, _ = codecs.roundtrip(torch.zeros(777), cfg)
    assert torch.equal(y, torch.zeros(777))


def test_nonfinite_reaches_the_output(cfg):
    x = torch.randn(2000)
    x[1500] = float("nan")
    y, _ = codecs.roundtrip(x, cfg)
    assert not torch.isfinite(y).all()
    x[1500] = float("inf")
    y, _ = codecs.roundtrip(x, cfg)
    assert not torch.isfinite(y).all()


def test_config_travels_to_another_process_unchanged(cfg):
    """A codec setting reaches other ranks (all_gather_object pickles it) and plan files (JSON) with
    the same wire format: the same digest, the same encoded bytes."""
    for back in (pickle.loads(pickle.dumps(cfg)), CodecConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))):
        assert back.describe() == cfg.describe() and back.uses_residual == cfg.uses_residual
        assert Plan(default=back).digest() == Plan(default=cfg).digest()
        x = torch.randn(4099, generator=torch.Generator().manual_seed(0))
        n = x.numel()
        a, b = (torch.zeros(codecs.chunk_nbytes(n, c), dtype=torch.uint8) for c in (cfg, back))
        codecs.encode_chunk(x, cfg, a, seed=3)
        codecs.encode_chunk(x, back, b, seed=3)
        assert torch.equal(a, b)


@pytest.mark.parametrize("n", [0, 1, 13, 4099])
def test_chunk_interface(cfg, n):
    """Sizes are multiples of 4 (the next part of a shared buffer stays aligned), a chunk boundary
    unit keeps blocks whole, and chunk_finite agrees with the decoded values."""
    x = torch.randn(n) * 3
    nbytes = codecs.chunk_nbytes(n, cfg)
    assert nbytes % 4 == 0 and codecs.chunk_unit(cfg) % (cfg.block_size if cfg.codec is Codec.QUANTIZE else 1) == 0
    buf = torch.empty(nbytes, dtype=torch.uint8)
    codecs.encode_chunk(x, cfg, buf)
    y = torch.zeros(n)
    codecs.decode_chunk(buf, n, cfg, y)
    assert bool(codecs.chunk_finite(buf, n, cfg))
    if n:
        x[n // 2] = float("nan")
        codecs.encode_chunk(x, cfg, buf)
        codecs.decode_chunk(buf, n, cfg, y)
        assert not bool(codecs.chunk_finite(buf, n, cfg)) and not bool(torch.isfinite(y).all())


@pytest.mark.parametrize("bits", range(1, 9))
def test_error_feedback_identity(bits):
    # decode(enc) + new residual == input + old residual (to fp32 rounding of one subtraction)
    torch.manual_seed(bits)
    x, r = torch.randn(3001), torch.randn(3001) * 0.1
    r_new = torch.empty_like(r)
    packed, meta = quantize(x, bits, 256, residual=r, residual_out=r_new)
    y = dequantize(packed, meta, 3001, bits, 256)
    torch.testing.assert_close(y + r_new, x + r, rtol=0, atol=1e-6)
    assert packed.numel() == (3001 * bits + 7) // 8


def test_nonfinite_block_keeps_residual():
    x, r = torch.randn(1024), torch.randn(1024)
    x[3] = float("nan")
    r_new = torch.full_like(r, 7.0)
    quantize(x, 4, 512, residual=r, residual_out=r_new)
    assert torch.equal(r_new[:512], r[:512]), "the non-finite block's residual is unchanged"
    assert torch.isfinite(r_new).all()


def test_topk_fallback_with_world_size():
    cfg = RECIPES["topk1"]
    assert codecs.effective_config(cfg, 10**6, 2) is cfg
    fallback = codecs.effective_config(cfg, 10**6, 64)
    assert fallback.codec is Codec.QUANTIZE and fallback.bits == cfg.fallback_bits
    # the switch happens exactly where sparse traffic exceeds dense traffic
    for w in range(2, 64):
        eff = codecs.effective_config(cfg, 10**6, w)
        sparse = (w - 1) * codecs.topk_nbytes(10**6, cfg)
        dense = 2 * (w - 1) / w * codecs.dense_nbytes(10**6, fallback)
        assert (eff.codec is Codec.TOPK) == (sparse <= dense)


def test_wire_bytes_ratio():
    n = 10**6
    fp32 = 2 * 4 * n / 2
    assert fp32 / codecs.wire_bytes(n, RECIPES["int4"], 2) > 7.5
    assert fp32 / codecs.wire_bytes(n, RECIPES["int2"], 2) > 14
    assert fp32 / codecs.wire_bytes(n, RECIPES["topk1"], 2) > 45
    assert codecs.wire_bytes(n, RECIPES["int4"], 1) == 0


# -- the sampled top-k selection (tensors past 65,536 elements) -------------------------------------------
def _check_topk(a: torch.Tensor, k: int, idx: torch.Tensor) -> None:
    """Exact top-k semantics: k distinct in-range indices; every selected non-NaN magnitude is >= every
    unselected non-NaN magnitude (ties at the k-th magnitude may go either way)."""
    n = a.numel()
    assert idx.numel() == k and idx.unique().numel() == k
    assert int(idx.min()) >= 0 and int(idx.max()) < n
    chosen = torch.zeros(n, dtype=torch.bool)
    chosen[idx] = True
    sel, rest = a[chosen], a[~chosen]
    sel, rest = sel[~sel.isnan()], rest[~rest.isnan()]
    if sel.numel() and rest.numel():
        assert float(sel.min()) >= float(rest.max()), (float(sel.min()), float(rest.max()))
    # ties: how many of the k-th magnitude were taken is all that may differ from torch.topk
    if not a.isnan().any():
        kth = torch.topk(a, k).values[-1]
        assert int((sel > kth).sum()) == int((a > kth).sum())


def _strided_trap(n: int) -> torch.Tensor:
    # Large values only where the strided sample looks (every 4th entry of 2**20): the sample
    # overestimates how many entries pass its threshold, so selection needs its retry.
    a = torch.rand(n)
    a[:: max(1, n // (1 << 18))] += 10.0
    return a


TOPK_INPUTS = {
    "random": lambda n: torch.randn(n, generator=torch.Generator().manual_seed(n)).abs(),
    "ties": lambda n: torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(1)).float(),
    "all-equal": lambda n: torch.ones(n),
    "zeros-and-one-spike": lambda n: torch.zeros(n).index_fill_(0, torch.tensor([n - 1]), 5.0),
    "strided-trap": _strided_trap,
    "inf": lambda n: torch.randn(n).abs().index_fill_(0, torch.tensor([7, n // 2]), float("inf")),
    "nan-sparse": lambda n: torch.randn(n).abs().index_fill_(0, torch.tensor([3, n - 2]), float("nan")),
    "nan-in-sample": lambda n: torch.randn(n).abs().index_fill_(0, torch.arange(0, n, 4), float("nan")),
}


@pytest.mark.parametrize("name", sorted(TOPK_INPUTS))
@pytest.mark.parametrize("n,k", [(65_537, 1), (65_537, 656), ((1 << 20) + 3, 10_486),
                                 ((1 << 20) + 3, (1 << 17) - 1), ((1 << 20) + 3, 100_000)])
def test_sampled_topk_selection_is_exact(name, n, k):
    torch.manual_seed(n + k)
    a = TOPK_INPUTS[name](n)
    idx = codecs.select_topk(a, k)
    _check_topk(a, k, idx)
    assert torch.equal(idx, codecs.select_topk(a.clone(), k)), "selection must be deterministic"


def test_sampled_topk_takes_every_path(monkeypatch):
    """The inputs above reach the first guess, the retry and the full fallback of the selection."""
    calls = []
    real = torch.topk

    def spy(t, k, *a, **kw):
        calls.append(t.numel())
        return real(t, k, *a, **kw)

    paths = {}
    monkeypatch.setattr(torch, "topk", spy)
    for name in ("random", "strided-trap", "nan-in-sample"):
        calls.clear()
        a = TOPK_INPUTS[name]((1 << 20) + 3)
        codecs.select_topk(a, 10_486)
        paths[name] = len(calls)
    # random: sample + candidates; strided-trap: sample, sample again, candidates; NaN in the
    # sample: both guesses fail, then the full torch.topk
    assert paths == {"random": 2, "strided-trap": 3, "nan-in-sample": 3}, paths


@pytest.mark.parametrize("bits", [None, 4])
def test_topk_message_past_the_sampled_size(bits):
    """The whole top-k codec on 2**20 + 3 elements: the message carries exactly the selected values,
    a NaN anywhere in the input reaches every receiver, and error feedback then keeps the residual."""
    n = (1 << 20) + 3
    cfg = CodecConfig(codec=Codec.TOPK, topk=0.01, bits=bits)
    k = cfg.topk_k(n)
    x = torch.randn(n, generator=torch.Generator().manual_seed(5))
    buf = torch.empty(codecs.chunk_nbytes(n, cfg), dtype=torch.uint8)
    r = torch.zeros(n)
    codecs.encode_chunk(x, cfg, buf, residual=r)
    y = torch.zeros(n)
    codecs.decode_chunk(buf, n, cfg, y)
    kept = y != 0
    assert int(kept.sum()) == k
    _check_topk(x.abs(), k, kept.nonzero().squeeze(1))
    if bits is None:
        assert torch.equal(y[kept], x[kept]) and torch.equal(r, torch.where(kept, 0.0, x))
    x[n - 5] = float("nan")  # not where the strided sample looks
    r_before = r.clone()
    codecs.encode_chunk(x, cfg, buf, residual=r)
    assert not bool(codecs.chunk_finite(buf, n, cfg))
    assert torch.equal(r, r_before), "a non-finite message must leave the residual alone"
