"""Segment tables: one Triton launch encodes, or decodes and sums, every chunk of
several layers of different sizes, bit for bit as the torch reference does chunk by chunk. On CPU the
kernels run through Triton's interpreter (TRITON_INTERPRET=1, see tests/conftest.py); with
FASTML_TEST_DEVICE=cuda on the GPU."""

from __future__ import annotations

import pytest
import torch

from conftest import BACKENDS
from fastml_strategy.kernels import dequantize_reference, packed_nbytes, quantize_reference
from fastml_strategy.kernels.reference import num_blocks

pytestmark = pytest.mark.skipif("triton" not in BACKENDS, reason="Triton (or its interpreter) not available")

W = 3
HEADER = 64


def _chunks(numels, block_size):
    """(x offset, chunk elements) of every chunk: each layer cut into W chunks on block boundaries,
    as fastml_strategy.comm._layouts.chunk_bounds cuts them (an empty chunk where a layer has fewer than W blocks)."""
    out, off = [], 0
    for n in numels:
        units = -(-n // block_size)
        bounds = [min(n, (j * units // W) * block_size) for j in range(W)] + [n]
        out += [(off + bounds[j], bounds[j + 1] - bounds[j]) for j in range(W)]
        off += n
    return out


def _chunk_bytes(n, bits, block_size):
    return 8 * num_blocks(n, block_size) + ((packed_nbytes(n, bits) + 3) & ~3)


def _message(chunks, bits, block_size):
    """Byte offset of each chunk's encoding in a message [header | chunk | chunk | ...], and its size."""
    offs, pos = [], HEADER
    for _, n in chunks:
        offs.append(pos)
        pos += _chunk_bytes(n, bits, block_size)
    return offs, pos


@pytest.mark.parametrize("bits,block_size,stochastic,dtype", [
    (4, 512, False, torch.float32), (2, 64, True, torch.float32), (3, 64, False, torch.bfloat16),
    (8, 128, True, torch.float16), (1, 64, False, torch.float32)])
def test_encode_and_decode_tables_match_the_reference(device, bits, block_size, stochastic, dtype):
    from fastml_strategy.kernels import quantize_triton as qt

    # several layers of different sizes: tails, a layer of fewer blocks than ranks (empty chunks),
    # a layer longer than one program's worth under the interpreter
    numels = [5000, 37, 3 * block_size, 20011, 1, 2 * block_size + 5]
    total = sum(numels)
    gen = torch.Generator().manual_seed(bits * 1000 + block_size)
    x = (torch.randn(total, generator=gen) * 3).to(dtype)
    x[7] = float("nan") if dtype == torch.float32 else x[7]  # a non-finite block (and its residual)
    res = torch.randn(total, generator=gen) * 0.1
    chunks = _chunks(numels, block_size)
    offs, size = _message(chunks, bits, block_size)
    seeds = [1000003 * i + 17 for i in range(len(chunks))]

    # the reference, chunk by chunk
    ref_msg = torch.zeros(size, dtype=torch.uint8)
    ref_res = res.clone()
    ref_res_out = torch.full_like(res, -1.0)
    for (xo, n), mo, seed in zip(chunks, offs, seeds):
        if n == 0:
            continue
        nb = num_blocks(n, block_size)
        r = ref_res[xo: xo + n].clone()
        packed, meta = quantize_reference(x[xo: xo + n], bits, block_size, stochastic, seed, r)
        ref_res_out[xo: xo + n] = r
        ref_msg[mo: mo + 8 * nb].view(torch.float32).copy_(meta.reshape(-1))
        ref_msg[mo + 8 * nb: mo + 8 * nb + packed.numel()] = packed

    # one launch for every chunk of every layer
    table, g = qt.encode_table([(xo, xo, xo, mo, n, seed) for (xo, n), mo, seed in zip(chunks, offs, seeds)],
                               bits, block_size, device)
    assert len(table) >= len([c for c in chunks if c[1]])  # at least one program per chunk
    msg = torch.zeros(size, dtype=torch.uint8, device=device)
    r_in = res.to(device)
    r_out = torch.full((total,), -1.0, device=device)
    qt.quantize_segments(x.to(device), msg, table, g, bits, block_size, stochastic, r_in, r_out)
    assert torch.equal(msg.cpu(), ref_msg)
    torch.testing.assert_close(r_out.cpu(), ref_res_out, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(r_in.cpu(), res)  # read only

    # in place (residual_out defaults to residual)
    r_in2 = res.to(device)
    msg2 = torch.zeros(size, dtype=torch.uint8, device=device)
    qt.quantize_segments(x.to(device), msg2, table, g, bits, block_size, stochastic, r_in2)
    assert torch.equal(msg2.cpu(), ref_msg)
    torch.testing.assert_close(r_in2.cpu(), ref_res_out, rtol=0, atol=0, equal_nan=True)

    # decode and sum W copies of every chunk (three "ranks": the message and two variations of it,
    # at a stride), into an output laid out like x, stored and added
    others = []
    for k in range(1, W):
        m = ref_msg.clone()
        payload = torch.randint(0, 256, (size,), generator=gen, dtype=torch.uint8)
        for (_, n), mo in zip(chunks, offs):  # other codes, same metadata
            nb = num_blocks(n, block_size)
            m[mo + 8 * nb: mo + _chunk_bytes(n, bits, block_size)] = payload[mo + 8 * nb: mo + _chunk_bytes(n, bits, block_size)]
        others.append(m)
    stacked = torch.cat([ref_msg] + others)
    for accumulate in (False, True):
        start = torch.randn(total, generator=gen)
        want = start.clone()
        for (xo, n), mo in zip(chunks, offs):
            if n == 0:
                continue
            nb = num_blocks(n, block_size)
            acc = want[xo: xo + n]
            for s in range(W):
                m = stacked[s * size:]
                dec = dequantize_reference(m[mo + 8 * nb: mo + 8 * nb + packed_nbytes(n, bits)],
                                           m[mo: mo + 8 * nb].view(torch.float32).view(nb, 2), n, bits,
                                           block_size)
                acc = dec.clone() if s == 0 else acc + dec
            want[xo: xo + n] = start[xo: xo + n] + acc if accumulate else acc
        dtable, dg = qt.decode_table([(mo, xo, n) for (xo, n), mo in zip(chunks, offs)], bits, block_size,
                                     device)
        out = start.to(device)
        ok = qt.dequantize_segments(stacked.to(device), out, dtable, dg, bits, block_size, sources=W,
                                    src_stride=size, accumulate=accumulate)
        torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0, equal_nan=True)
        assert bool(ok.cpu()) == bool(torch.isfinite(want).all())
        # one source, stored: the all_gather stage
        out1 = torch.zeros(total, device=device)
        ok1 = qt.dequantize_segments(ref_msg.to(device), out1, dtable, dg, bits, block_size)
        want1 = torch.zeros(total)
        for (xo, n), mo in zip(chunks, offs):
            if n:
                nb = num_blocks(n, block_size)
                want1[xo: xo + n] = dequantize_reference(
                    ref_msg[mo + 8 * nb: mo + 8 * nb + packed_nbytes(n, bits)],
                    ref_msg[mo: mo + 8 * nb].view(torch.float32).view(nb, 2), n, bits, block_size)
        torch.testing.assert_close(out1.cpu(), want1, rtol=0, atol=0, equal_nan=True)
        assert bool(ok1.cpu()) == bool(torch.isfinite(want1).all())


def test_one_launch_per_table(device, monkeypatch):
    # the point of the table: one kernel launch however many chunks and layers
    from fastml_strategy.kernels import quantize_triton as qt

    launches = []
    real_enc, real_dec = qt._quantize_seg_kernel, qt._dequantize_seg_kernel

    class Count:
        def __init__(self, k):
            self.k = k

        def __getitem__(self, grid):
            launches.append(grid)
            return self.k[grid]

    monkeypatch.setattr(qt, "_quantize_seg_kernel", Count(real_enc))
    monkeypatch.setattr(qt, "_dequantize_seg_kernel", Count(real_dec))
    numels = [700, 1300, 64, 999]
    chunks = _chunks(numels, 64)
    offs, size = _message(chunks, 4, 64)
    x = torch.randn(sum(numels), device=device)
    table, g = qt.encode_table([(xo, 0, 0, mo, n, 0) for (xo, n), mo in zip(chunks, offs)], 4, 64, device)
    msg = torch.zeros(size, dtype=torch.uint8, device=device)
    qt.quantize_segments(x, msg, table, g, 4, 64)
    dtable, dg = qt.decode_table([(mo, xo, n) for (xo, n), mo in zip(chunks, offs)], 4, 64, device)
    out = torch.zeros_like(x)
    qt.dequantize_segments(msg, out, dtable, dg, 4, 64)
    assert len(launches) == 2, launches
    assert (out - x).abs().max() <= (x.max() - x.min()) / 15  # int4 of blocks of 64: within a step
