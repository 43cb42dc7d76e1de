"""Every quantize backend against the torch reference, bit-exactly (atol=0, rtol=0), plus the
properties the format promises: round-trip bound, stochastic rounding unbiased, error feedback,
accumulate mode, NaN/inf propagation."""

from __future__ import annotations

import math

import pytest
import torch

from fastml_strategy.kernels import (dequantize, dequantize_reference, packed_nbytes, quantize, quantize_reference,
                                     reduce_quantize, resolve_backend)
from fastml_strategy.kernels.reference import FLT_MAX, num_blocks, uniform

SIZES = [1, 13, 1000, 1024, 30011]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
EPS = 2.0**-23  # fp32 ulp of 1


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exactly equal (NaN == NaN; -0 == +0: a GPU may produce either zero for a block's min)."""
    a, b = a.cpu(), b.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
    if a.dtype == torch.uint8:
        assert torch.equal(a, b), f"{(a != b).sum()} of {a.numel()} bytes differ"
    else:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def make_input(n: int, dtype: torch.dtype, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


def encode_both(x, bits, backend, device, block_size=512, stochastic=False, seed=0, residual=None):
    """(reference on CPU, backend on ``device``) results: packed, meta, new residual."""
    r_ref = residual.clone() if residual is not None else None
    p_ref, m_ref = quantize_reference(x, bits, block_size, stochastic, seed, r_ref)
    r_dev = residual.to(device) if residual is not None else None
    p, m = quantize(x.to(device), bits, block_size, stochastic, seed, r_dev, backend=backend)
    return (p_ref, m_ref, r_ref), (p, m, r_dev)


# ---- bit-exactness -----------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_encode_decode_match_reference(backend, device, n, dtype, bits):
    x = make_input(n, dtype, seed=n * 8 + bits)
    residual = torch.randn(n, generator=torch.Generator().manual_seed(1)) * 0.1
    for res in (None, residual):
        ref, got = encode_both(x, bits, backend, device, residual=res)
        assert_same(got[0], ref[0])
        assert_same(got[1], ref[1])
        if res is not None:
            assert_same(got[2], ref[2])
    p_ref, m_ref, _ = ref
    y_ref = dequantize_reference(p_ref, m_ref, n, bits)
    assert_same(dequantize(p_ref.to(device), m_ref.to(device), n, bits, backend=backend), y_ref)


@pytest.mark.parametrize("block_size", [8, 64, 4096])
@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_block_sizes(backend, device, block_size, bits):
    n = 5003
    x = make_input(n, torch.float32, seed=block_size + bits)
    r = torch.randn(n) * 0.01
    ref, got = encode_both(x, bits, backend, device, block_size=block_size, residual=r)
    for a, b in zip(got, ref):
        assert_same(a, b)
    y = dequantize(ref[0].to(device), ref[1].to(device), n, bits, block_size, backend=backend)
    assert_same(y, dequantize_reference(ref[0], ref[1], n, bits, block_size))


def special_input() -> torch.Tensor:
    """Blocks of 64 (block_size=64), each exercising one edge case."""
    blocks = [
        torch.zeros(64),                                  # all zero
        torch.full((64,), 3.25),                          # constant: scale 0
        torch.randn(64).index_fill_(0, torch.tensor([5]), float("nan")),
        torch.randn(64).index_fill_(0, torch.tensor([0]), float("inf")),
        torch.randn(64).index_fill_(0, torch.tensor([63]), float("-inf")),
        torch.linspace(-3e38, 3e38, 64),                  # max - min overflows: mx/L - mn/L
        torch.randn(64) * 1e-42,                          # subnormal: 1/scale overflows to inf
        torch.tensor([0.0, -0.0] * 32),                   # signed zeros
        torch.randn(64),                                  # an ordinary block after the odd ones
        torch.full((64,), float("nan")),
        torch.tensor([FLT_MAX, -FLT_MAX] * 32),           # bits=1: even mx/L - mn/L overflows
        torch.randn(37),                                  # partial last block
    ]
    return torch.cat(blocks)


@pytest.mark.parametrize("bits", range(1, 9))
def test_special_values(backend, device, bits):
    x = special_input()
    n = x.numel()
    r = torch.randn(n) * 0.01
    ref, got = encode_both(x, bits, backend, device, block_size=64, residual=r.clone())
    for a, b in zip(got, ref):
        assert_same(a, b)
    # without a residual too, and with residual_out apart from the residual
    ref2, got2 = encode_both(x, bits, backend, device, block_size=64)
    assert_same(got2[0], ref2[0])
    assert_same(got2[1], ref2[1])
    r_dev, r_out = r.clone().to(device), torch.full((n,), 7.0, device=device)
    quantize(x.to(device), bits, 64, residual=r_dev, residual_out=r_out, backend=backend)
    assert_same(r_dev, r)  # untouched
    assert_same(r_out, ref[2])
    y = dequantize(ref[0].to(device), ref[1].to(device), n, bits, 64, backend=backend)
    assert_same(y, dequantize_reference(ref[0], ref[1], n, bits, 64))


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_nonfinite_blocks_propagate(backend, device, bits):
    """NaN/inf: meta (nan, nan), codes 0, decodes to NaN, residual unchanged; other blocks unaffected."""
    bs = 64
    x = torch.randn(4 * bs)
    x[bs + 3] = float("nan")
    x[2 * bs + 10] = float("-inf")
    r = torch.randn(4 * bs) * 0.01
    r_dev = r.clone().to(device)
    p, m = quantize(x.to(device), bits, bs, residual=r_dev, backend=backend)
    p, m, r_new = p.cpu(), m.cpu(), r_dev.cpu()
    assert torch.isnan(m[1:3]).all() and torch.isfinite(m[[0, 3]]).all()
    per_block = bs * bits // 8
    assert (p[per_block:3 * per_block] == 0).all()
    y = dequantize(p.to(device), m.to(device), 4 * bs, bits, bs, backend=backend).cpu()
    assert torch.isnan(y[bs:3 * bs]).all() and torch.isfinite(y[:bs]).all() and torch.isfinite(y[3 * bs:]).all()
    assert torch.equal(r_new[bs:3 * bs], r[bs:3 * bs])
    assert not torch.equal(r_new[:bs], r[:bs])


@pytest.mark.parametrize("pos", [5, 64 + 10, 64 + 35])
@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_nonfinite_in_simd_chunk_and_tail(backend, device, pos, value):
    """Blocks of 64 and 40 (one 32-element SIMD chunk + an 8-element scalar tail): a NaN or inf in a
    chunk or in the tail makes just its block non-finite."""
    x = torch.randn(64 + 40)
    x[pos] = value
    r = torch.randn(x.numel()) * 0.01
    ref, got = encode_both(x, 4, backend, device, block_size=64, residual=r)
    for a, b in zip(got, ref):
        assert_same(a, b)


def test_padding_bits_are_zero(backend, device):
    """Bits after the last element are 0 whatever the padding value would quantize to."""
    x = torch.arange(13, dtype=torch.float32).flip(0)  # the last block starts with its maximum
    for bits in range(1, 9):
        p, _ = quantize(x.to(device), bits, 8, backend=backend)
        used = 13 * bits - 8 * (packed_nbytes(13, bits) - 1)
        assert int(p[-1]) >> used == 0, (bits, hex(int(p[-1])))


def test_format_bit_stream():
    """The reference's packing against a bit-by-bit little-endian stream written out by hand."""
    g = torch.Generator().manual_seed(3)
    for bits in range(1, 9):
        n = 77
        x = torch.rand(n, generator=g)
        p, m = quantize_reference(x, bits, 8)
        mn, sc = m[:, 0].repeat_interleave(8)[:n], m[:, 1].repeat_interleave(8)[:n]
        inv = torch.where(sc > 0, 1.0 / sc, torch.zeros_like(sc))
        q = ((x - mn) * inv + 0.5).floor().clamp(0, 2**bits - 1).to(torch.int64).tolist()
        stream = 0
        for i, c in enumerate(q):
            stream |= c << (i * bits)
        expected = stream.to_bytes(packed_nbytes(n, bits), "little")
        assert bytes(p.tolist()) == expected


# ---- properties ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_round_trip_bound(backend, device, bits):
    """Round to nearest: |decoded - v| <= scale / 2 per element, plus fp32 rounding."""
    n, bs = 30011, 512
    v = make_input(n, torch.float32, seed=bits) * torch.linspace(0.01, 100, n)
    p, m = quantize(v.to(device), bits, bs, backend=backend)
    y = dequantize(p, m, n, bits, bs, backend=backend).cpu()
    m = m.cpu()
    scale = m[:, 1].repeat_interleave(bs)[:n]
    mag = v.abs() + m[:, 0].abs().repeat_interleave(bs)[:n] + scale * (2**bits - 1)
    assert ((y - v).abs() <= scale / 2 + 4 * EPS * mag).all()


def test_stochastic_unbiased(backend, device):
    """E[decoded] = v: the mean over S seeds is within 6 standard errors (scale / (2 sqrt S)). Triton's
    CPU interpreter takes 100 draws (its 800 launches took 19 s), the compiled paths 400."""
    n, bs, bits = 1000, 256, 2
    draws = 100 if backend == "triton" and device.type == "cpu" else 400
    v = make_input(n, torch.float32, seed=5).to(device)
    acc = torch.zeros(n, dtype=torch.float64)
    for s in range(draws):
        p, m = quantize(v, bits, bs, stochastic=True, seed=s, backend=backend)
        y = dequantize(p, m, n, bits, bs, backend=backend).cpu()
        scale = m.cpu()[:, 1].repeat_interleave(bs)[:n]
        assert ((y - v.cpu()).abs() < scale * (1 + 1e-5)).all()
        acc += y.double()
    mean_err = acc / draws - v.cpu().double()
    se = scale.double() / (2 * math.sqrt(draws))
    assert (mean_err.abs() <= 6 * se).all()
    assert abs(float(mean_err.mean())) <= 6 * float(se.mean()) / math.sqrt(n)  # no overall drift


@pytest.mark.parametrize("bits", [1, 3, 4, 8])
def test_stochastic_same_seed_same_bytes(backend, device, bits):
    n = 30011
    x = make_input(n, torch.float32, seed=11)
    r = torch.randn(n) * 0.05
    ref, got = encode_both(x, bits, backend, device, stochastic=True, seed=1234567, residual=r)
    for a, b in zip(got, ref):
        assert_same(a, b)
    other, _ = quantize(x.to(device), bits, stochastic=True, seed=1234568, backend=backend)
    assert not torch.equal(other.cpu(), ref[0])


def test_uniform_hash_values():
    """Known values of the counter-based hash (a change here breaks the wire format)."""
    u = uniform(42, torch.tensor([0, 1, 2, 3, 2**32 - 1, 2**32]))
    # lowbias32 of (i + 42 * 0x9E3779B9) mod 2**32, top 24 bits, computed by hand with Python ints
    assert (u * 2**24).long().tolist() == [382687, 6826439, 4198248, 788507, 2758842, 382687]
    h = uniform(0, torch.arange(1 << 16))
    assert abs(float(h.mean()) - 0.5) < 0.01 and len(set(h.tolist())) > 60000
    assert uniform(42 + 2**32, torch.arange(4)).tolist() == u[:4].tolist()  # seed taken mod 2**32


@pytest.mark.parametrize("bits", [1, 4, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_error_feedback_identity(backend, device, bits, dtype):
    """decode(encode(x + r)) + r_new == x + r, up to the rounding of r_new = v - y and of the sum."""
    n, bs = 10007, 512
    x = make_input(n, dtype, seed=bits)
    r = torch.randn(n) * 0.1
    r_dev = r.clone().to(device)
    p, m = quantize(x.to(device), bits, bs, residual=r_dev, backend=backend)
    y = dequantize(p, m, n, bits, bs, backend=backend).cpu()
    v = x.float() + r
    lhs = y + r_dev.cpu()
    assert ((lhs - v).abs() <= 2 * EPS * (v.abs() + (v - y).abs())).all()


@pytest.mark.parametrize("out_of_place", [False, True])
@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", [1, 4, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bf16_residual(backend, device, dtype, bits, stochastic, out_of_place):
    """A bf16 residual: encodes x + float(r) and writes the new residual rounded to nearest even,
    exactly as the reference on an fp32 copy followed by ``copy_`` into bf16 (the compiled CPU path
    reads and writes bf16 itself). Covers a non-finite block (its residual kept), residuals that
    round half-way (ties to even), a partial block and a partial SIMD chunk."""
    n, bs = 2 * 512 + 45, 512
    x = make_input(n, dtype, seed=bits)
    x[700] = float("inf")  # block 1 is non-finite: its residual stays as it was
    r = (torch.randn(n) * 0.05).to(torch.bfloat16)
    r32 = r.float()
    p_ref, m_ref = quantize_reference(x, bits, bs, stochastic, 3, r32)
    r_ref = r32.to(torch.bfloat16)
    r_dev = r.clone().to(device)
    r_out = torch.full((n,), 9.0, dtype=torch.bfloat16, device=device) if out_of_place else None
    p, m = quantize(x.to(device), bits, bs, stochastic, 3, r_dev, r_out, backend=backend)
    assert_same(p, p_ref)
    assert_same(m, m_ref)
    written = r_out if out_of_place else r_dev
    assert written.dtype == torch.bfloat16
    assert torch.equal(written.cpu().view(torch.int16), r_ref.view(torch.int16))
    if out_of_place:
        assert torch.equal(r_dev.cpu(), r)  # the input residual is left alone
    assert torch.equal(r_ref[512:1024], r[512:1024])


def test_bf16_residual_rounds_to_nearest_even(cpu_build):
    """The compiled store of a bf16 residual rounds as torch does (ties to even, carries into the
    exponent, subnormals), on every float32 bit pattern it is given. Blocks of 8 are [0, 1, v1..v6]
    with 0 <= v < scale / 2, so every v gets code 0, decodes to exactly 0, and its new residual is v."""
    cpu = cpu_build
    assert cpu.native_bf16_residual()
    g = torch.Generator().manual_seed(0)
    top = 0x3A800000  # 2**-10 < (1 / 255) / 2
    v = torch.randint(0, top, (6 * 4096,), generator=g, dtype=torch.int64)
    ties = torch.tensor([0x39808000, 0x39818000, 0x397F8000, 0x397FFFFF, 0x00008000, 0x00018000, 0x00007FFF,
                         0x007F8000, 0x3A7F8000, 0x3A7FC000, 0x39807FFF, 0x39808001], dtype=torch.int64)
    v = torch.cat([ties, v])
    v = v[: v.numel() // 6 * 6].to(torch.int32).view(torch.float32).view(-1, 6)
    x = torch.cat([torch.zeros(v.shape[0], 1), torch.ones(v.shape[0], 1), v], dim=1).reshape(-1)
    n = x.numel()
    r_out = torch.empty(n, dtype=torch.bfloat16)
    quantize(x, 8, 8, residual=torch.zeros(n, dtype=torch.bfloat16), residual_out=r_out, backend="cpu")
    got = r_out.view(-1, 8)[:, 2:]
    assert torch.equal(got.view(torch.int16), v.to(torch.bfloat16).view(torch.int16))


def test_accumulate(backend, device):
    """Decode-and-add: out + decoded, bit-exactly, and several messages added in order."""
    n, bits = 30011, 4
    msgs = [quantize_reference(make_input(n, torch.float32, seed=s), bits) for s in range(3)]
    out = torch.randn(n)
    expected = out.clone()
    got = out.to(device)
    for p, m in msgs:
        expected += dequantize_reference(p, m, n, bits)
        dequantize(p.to(device), m.to(device), n, bits, out=got, accumulate=True, backend=backend)
    assert_same(got, expected)
    fresh = dequantize(msgs[0][0].to(device), msgs[0][1].to(device), n, bits, accumulate=True, backend=backend)
    assert_same(fresh, dequantize_reference(msgs[0][0], msgs[0][1], n, bits))


def test_write_into_send_buffer_views(backend, device):
    """packed_out / meta_out: views of one buffer, as the collective lays out its message."""
    n, bits, bs = 5000, 3, 512
    x = make_input(n, torch.float32).to(device)
    nbytes, nb = packed_nbytes(n, bits), num_blocks(n, bs)
    buf = torch.zeros(8 * nb + nbytes + 16, dtype=torch.uint8, device=device)
    meta_view = buf[: 8 * nb].view(torch.float32).view(nb, 2)
    packed_view = buf[8 * nb: 8 * nb + nbytes]
    p, m = quantize(x, bits, bs, backend=backend, packed_out=packed_view, meta_out=meta_view)
    assert p.data_ptr() == packed_view.data_ptr() and m.data_ptr() == meta_view.data_ptr()
    p_ref, m_ref = quantize_reference(x.cpu(), bits, bs)
    assert_same(packed_view, p_ref)
    assert_same(meta_view, m_ref)
    assert (buf[8 * nb + nbytes:] == 0).all()  # nothing written past the payload


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_misaligned_packed_out(backend, device, offset):
    """A payload view at an odd byte offset: no word stores there, same bytes."""
    n, bits = 5000, 4
    x = make_input(n, torch.float32, seed=offset).to(device)
    buf = torch.zeros(packed_nbytes(n, bits) + 8, dtype=torch.uint8, device=device)
    view = buf[offset: offset + packed_nbytes(n, bits)]
    quantize(x, bits, 64, backend=backend, packed_out=view)
    assert_same(view, quantize_reference(x.cpu(), bits, 64)[0])
    y = dequantize(view, quantize_reference(x.cpu(), bits, 64)[1].to(device), n, bits, 64, backend=backend)
    assert_same(y, dequantize_reference(*quantize_reference(x.cpu(), bits, 64), n, bits, 64))


def _reduce_sources(n, bits, block_size, nsrc, seed=0, poison=None):
    """nsrc reference messages of n elements (scales differ per source); ``poison``: (source, index)
    whose input is NaN, so that block of that message is non-finite."""
    out = []
    for s in range(nsrc):
        x = make_input(n, torch.float32, seed=seed + s, scale=10.0 ** (s - 1))
        if poison is not None and poison[0] == s:
            x[poison[1]] = float("nan")
        out.append(quantize_reference(x, bits, block_size))
    return out


def _reduce_oracle(sources, n, bits, block_size, divisor, stochastic, seed):
    """The definition of the reduce step, on the torch reference: decode, add in order, divide, encode."""
    acc = torch.empty(n)
    for i, (p, m) in enumerate(sources):
        dequantize_reference(p, m, n, bits, block_size, out=acc, accumulate=i > 0)
    acc.div_(divisor)
    return quantize_reference(acc, bits, block_size, stochastic, seed)


@pytest.mark.parametrize("stochastic", [False, True])
@pytest.mark.parametrize("bits", [1, 3, 4, 8])
@pytest.mark.parametrize("nsrc", [1, 2, 3])
def test_reduce_quantize_matches_decode_sum_encode(backend, device, nsrc, bits, stochastic):
    """The fused reduce step (decode every source, add in source order, divide, encode) writes the
    bytes of the separate calls, on every backend; a non-finite source block makes that block
    non-finite (meta NaN, codes 0) and leaves the others alone. The length has a partial block and
    a partial SIMD chunk."""
    n, bs = 3 * 512 + 37, 512
    sources = _reduce_sources(n, bits, bs, nsrc, seed=bits, poison=(nsrc - 1, 600))
    expected = _reduce_oracle(sources, n, bits, bs, nsrc, stochastic, 11)
    got = reduce_quantize([(p.to(device), m.to(device)) for p, m in sources], n, bits, bs, nsrc, stochastic,
                          11, backend=backend)
    assert_same(got[0], expected[0])
    assert_same(got[1], expected[1])
    assert torch.isnan(expected[1][1]).all() and torch.isfinite(expected[1][[0, 2, 3]]).all()


def test_reduce_quantize_fused_cpu_bytes(monkeypatch, cpu_build):
    """The compiled CPU path's fused reduce, bit for bit (metadata compared as raw bytes, so a -0.0
    min would count), over several threads, into views of one send buffer, with a source message
    read from an odd offset; and the fused kernel is what runs (the fp32 scratch stays unwritten)."""
    cpu = cpu_build
    assert cpu.has_reduce()
    monkeypatch.setenv("FASTML_CPU_THREADS", "3")
    n, bits, bs, nsrc = 3 * cpu._MIN_ELEMS_PER_THREAD + 1234, 5, 256, 3
    sources = _reduce_sources(n, bits, bs, nsrc, seed=5)
    expected = _reduce_oracle(sources, n, bits, bs, nsrc, True, 4)
    shifted = torch.zeros(packed_nbytes(n, bits) + 1, dtype=torch.uint8)
    shifted[1:] = sources[1][0]
    sources[1] = (shifted[1:], sources[1][1])
    nb, pn = num_blocks(n, bs), packed_nbytes(n, bits)
    buf = torch.full((8 * nb + pn + 8,), 7, dtype=torch.uint8)
    meta_view, packed_view = buf[: 8 * nb].view(torch.float32).view(nb, 2), buf[8 * nb: 8 * nb + pn]
    acc = torch.full((n,), 123.0)
    reduce_quantize(sources, n, bits, bs, nsrc, True, 4, packed_out=packed_view, meta_out=meta_view, acc=acc,
                    backend="cpu")
    assert (acc == 123.0).all(), "the fused kernel did not run: the sum went through the scratch"
    assert torch.equal(packed_view, expected[0])
    assert torch.equal(meta_view.view(torch.int32), expected[1].view(torch.int32))
    assert (buf[8 * nb + pn:] == 7).all()  # nothing written past the payload


def test_cpu_threads_bit_exact(monkeypatch, cpu_build):
    """The compiled path split over threads (contiguous block ranges) gives the same bytes."""
    cpu = cpu_build
    monkeypatch.setenv("FASTML_CPU_THREADS", "3")
    n = 3 * cpu._MIN_ELEMS_PER_THREAD + 1234
    x = make_input(n, torch.bfloat16, seed=9)
    r = torch.randn(n) * 0.01
    r_ref, r_got = r.clone(), r.clone()
    ref = quantize_reference(x, 5, 512, True, 3, r_ref)
    got = quantize(x, 5, 512, True, 3, r_got, backend="cpu")
    assert_same(got[0], ref[0])
    assert_same(got[1], ref[1])
    assert_same(r_got, r_ref)
    out = torch.randn(n)
    expected = out + dequantize_reference(*ref, n, 5, 512)
    assert_same(dequantize(*ref, n, 5, 512, out=out, accumulate=True, backend="cpu"), expected)


def test_empty_tensor(backend, device):
    p, m = quantize(torch.empty(0, device=device), 4, backend=backend)
    assert p.numel() == 0 and m.shape == (0, 2)
    assert dequantize(p, m, 0, 4, backend=backend).numel() == 0


# ---- dispatch -----------------------------------------------------------------------------------


def test_invalid_arguments():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="1 to 8"):
        quantize(x, 9)
    with pytest.raises(ValueError, match="power of two"):
        quantize(x, 4, block_size=100)
    with pytest.raises(ValueError, match="backend"):
        quantize(x, 4, backend="numpy")


def test_automatic_backend_on_cpu(monkeypatch):
    from fastml_strategy.kernels import cpu

    x = torch.randn(10)
    assert resolve_backend(x, "torch") == "torch"
    assert resolve_backend(x, None) == ("cpu" if cpu.available() else "torch")
    monkeypatch.setenv("FASTML_CPU_KERNEL", "0")
    assert resolve_backend(x, None) == "torch"
    assert quantize(x.double(), 4)[0].numel() == 5  # float64: the reference converts it


def test_cpu_build_failure_falls_back(monkeypatch, tmp_path):
    """No compiler: one warning that says how to fix it, then the reference."""
    from fastml_strategy.kernels import cpu

    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_info", {})
    monkeypatch.setattr(cpu, "_compiler", lambda: None)
    monkeypatch.setenv("FASTML_CACHE_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="FASTML_CPU_KERNEL=0"):
        assert not cpu.available()
    assert resolve_backend(torch.zeros(1), None) == "torch"
    p, m = quantize(torch.randn(100), 4)
    assert p.numel() == 50


def test_cpu_build_without_ninja_falls_back(monkeypatch, tmp_path):
    """torch.utils.cpp_extension builds with ninja: without it, one warning naming the fix, then the
    reference (and no second warning)."""
    import warnings

    from torch.utils import cpp_extension

    from fastml_strategy.kernels import cpu

    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_info", {})
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    monkeypatch.setenv("FASTML_CACHE_DIR", str(tmp_path))
    with pytest.warns(RuntimeWarning, match="pip install ninja"):
        assert not cpu.available()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cpu.available() and resolve_backend(torch.zeros(1), None) == "torch"
    assert not any(tmp_path.iterdir())  # nothing was compiled
