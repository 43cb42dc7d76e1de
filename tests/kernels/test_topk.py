"""Top-k: selection, error feedback, quantized values, scatter-add decode; every backend against the
torch reference bit-exactly."""

from __future__ import annotations

import pytest
import torch

from fastml_strategy.kernels.topk import topk_decode_add, topk_encode

EPS = 2.0**-23


def inputs(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1


def test_selects_largest_magnitudes(device):
    x, r = inputs(10007)
    acc = x + r
    t = topk_encode(x.to(device), 100, residual=r.clone().to(device))
    idx = t.indices.cpu().long()
    assert t.indices.dtype == torch.int32 and (idx[1:] > idx[:-1]).all()
    assert torch.equal(idx, acc.abs().topk(100).indices.sort().values)
    assert torch.equal(t.values.cpu(), acc[idx])


def test_error_feedback_exact_for_fp32_values(backend, device):
    """Sent values plus the new residual are exactly x + r (0 at the sent indices)."""
    n = 10007
    x, r = inputs(n, 1)
    r_dev = r.clone().to(device)
    t = topk_encode(x.to(device), 300, residual=r_dev)
    out = torch.zeros(n, device=device)
    topk_decode_add(out, t.indices, t.values, backend=backend)
    assert torch.equal((out + r_dev).cpu(), x + r)
    assert (r_dev.cpu()[t.indices.cpu().long()] == 0).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantized_values_match_reference(backend, device, bits):
    n, k = 30011, 3000
    x, r = inputs(n, bits)
    r_ref = r.clone()
    ref = topk_encode(x, k, bits=bits, block_size=256, residual=r_ref, backend="torch")
    r_dev = r.clone().to(device)
    got = topk_encode(x.to(device), k, bits=bits, block_size=256, residual=r_dev, backend=backend)
    assert torch.equal(got.indices.cpu(), ref.indices)
    assert torch.equal(got.packed.cpu(), ref.packed)
    assert torch.equal(got.meta.cpu(), ref.meta)
    assert torch.equal(r_dev.cpu(), r_ref)

    base = torch.randn(n)
    expected = topk_decode_add(base.clone(), ref.indices, packed=ref.packed, meta=ref.meta, bits=bits,
                               block_size=256, backend="torch")
    out = base.clone().to(device)
    topk_decode_add(out, got.indices, packed=got.packed, meta=got.meta, bits=bits, block_size=256, backend=backend)
    assert torch.equal(out.cpu(), expected)

    # error feedback: decoded + new residual = x + r, up to the rounding of r_new = v - y
    dec = topk_decode_add(torch.zeros(n), ref.indices, packed=ref.packed, meta=ref.meta, bits=bits,
                          block_size=256, backend="torch")
    v = x + r
    assert ((dec + r_ref - v).abs() <= 2 * EPS * (v.abs() + (v - dec).abs())).all()


def test_messages_add_in_rank_order(backend, device):
    """Three ranks' messages scatter-added one after the other: same sum as the reference."""
    n = 5003
    msgs = [topk_encode(inputs(n, s)[0], 400) for s in range(3)]
    expected = torch.zeros(n)
    out = torch.zeros(n, device=device)
    for t in msgs:
        expected.index_add_(0, t.indices.long(), t.values)
        topk_decode_add(out, t.indices.to(device), t.values.to(device), backend=backend)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.parametrize("bits", [None, 4])
def test_nonfinite_reaches_decode_and_spares_residual(backend, device, bits):
    n = 1000
    x, r = inputs(n, 3)
    x[17] = float("nan")
    r_dev = r.clone().to(device)
    t = topk_encode(x.to(device), 10, bits=bits, block_size=8, residual=r_dev, backend=backend)
    assert 17 in t.indices.cpu().tolist()
    out = topk_decode_add(torch.zeros(n, device=device), t.indices, t.values, packed=t.packed, meta=t.meta,
                          bits=bits, block_size=8, backend=backend)
    assert torch.isnan(out.cpu()[17])
    assert torch.equal(r_dev.cpu(), r)


def test_invalid_k():
    with pytest.raises(ValueError, match="k=0"):
        topk_encode(torch.randn(10), 0)
    with pytest.raises(ValueError, match="k=11"):
        topk_encode(torch.randn(10), 11)
