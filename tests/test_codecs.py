"""Contract tests run against every codec (STYLE.md #6): round trip within the codec's bound, zeros,
NaN/inf, pickling, error-feedback identity."""

from __future__ import annotations

import pickle

import pytest
import torch

from fastml_strategy import RECIPES, Codec, CodecConfig
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
    elif cfg.codec is Codec.QUANTIZE:
        levels = 2**cfg.bits - 1
        blocks = x.split(cfg.block_size)
        step = torch.cat([(b.max() - b.min()).expand(b.numel()) / levels for b in blocks])
        bound = step * (1.0 if cfg.stochastic else 0.5) * (1 + 1e-5) + 1e-6
        assert ((y - x).abs() <= bound).all()
    else:
        k = cfg.topk_k(n)
        kept = y != 0
        assert int(kept.sum()) <= k
        # the kept entries are the largest magnitudes: everything dropped is no larger than what's kept
        if kept.any() and (~kept).any():
            assert x[~kept].abs().max() <= x[kept].abs().min() + 1e-6
        if cfg.bits is None:
            assert torch.equal(y[kept], x[kept])


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


def test_pickle(cfg):
    assert pickle.loads(pickle.dumps(cfg)) == cfg


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
