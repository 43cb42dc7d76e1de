"""The contract every registered codec keeps (as optuna's sampler tests run one class against every
sampler): sizes and the metadata/codes split, round trip, error feedback, zeros, NaN/inf, pickling, the
reduce step, and a 2-rank gloo all-reduce and reduce-scatter through the worker pool. A new codec gets
these by registering its class (``fastml_strategy.codecs.register_codec``) and adding example settings
to ``EXAMPLES`` below, which the first test insists on.

Also here: the wire-format version ranks compare before the first step, so that FastML builds whose
bytes differ refuse to run together, naming both versions."""

from __future__ import annotations

import pickle

import pytest
import torch

from _dist import run_workers
from fastml_strategy import Codec, CodecConfig
from fastml_strategy import codecs

# Settings to run each registered codec with: its recipe, and the corners of what it reads.
EXAMPLES: dict[Codec, dict[str, CodecConfig]] = {
    Codec.FP32: {"fp32": CodecConfig(codec=Codec.FP32)},
    Codec.FP16: {"fp16": CodecConfig(codec=Codec.FP16)},
    Codec.BF16: {"bf16": CodecConfig(codec=Codec.BF16)},
    Codec.QUANTIZE: {
        "int4": CodecConfig(codec=Codec.QUANTIZE, bits=4),
        "int1": CodecConfig(codec=Codec.QUANTIZE, bits=1),
        "int3-b64-sr": CodecConfig(codec=Codec.QUANTIZE, bits=3, block_size=64, stochastic=True),
        "int8-rbf16": CodecConfig(codec=Codec.QUANTIZE, bits=8, residual_dtype="bf16"),
    },
    Codec.TOPK: {
        "topk10": CodecConfig(codec=Codec.TOPK, topk=0.1),
        "topk10-int8": CodecConfig(codec=Codec.TOPK, topk=0.1, bits=8, block_size=64),
        "topk17": CodecConfig(codec=Codec.TOPK, topk_count=17),
    },
    # A flat chunk is no matrix: the chunk tests below exercise its chunk form (its fp32 fallback);
    # the matrix path has its own tests in tests/test_lowrank.py, and the 2-rank run here gives the
    # layers their shapes (SHAPES).
    Codec.LOWRANK: {
        "lowrank2": CodecConfig(codec=Codec.LOWRANK, rank=2),
        "lowrank4-int8": CodecConfig(codec=Codec.LOWRANK, rank=4, factors="int8"),
        "lowrank1-bf16-rbf16": CodecConfig(codec=Codec.LOWRANK, rank=1, factors="bf16", residual_dtype="bf16"),
    },
    Codec.FP8: {
        "fp8": CodecConfig(codec=Codec.FP8),
        "fp8-b64-rbf16": CodecConfig(codec=Codec.FP8, block_size=64, residual_dtype="bf16"),
        "fp8-noef": CodecConfig(codec=Codec.FP8, error_feedback=False),
    },
}
# The shapes of the 2-rank run's layers (numels 5000, 40, 3000): the low-rank codec compresses the
# matrices and sends the 1-D tensor as fp32.
SHAPES = {"a": (100, 50), "b": (40,), "c": (60, 50)}
CASES = {name: cfg for per_codec in EXAMPLES.values() for name, cfg in per_codec.items()}


def test_every_registered_codec_has_examples():
    missing = sorted(c.value for c in codecs.registered_codecs() if c not in EXAMPLES)
    assert not missing, f"add example settings of {missing} to EXAMPLES in {__file__}"
    for codec, cls in codecs.registered_codecs().items():
        assert cls.codec is codec and issubclass(cls, codecs.WireCodec)
        assert isinstance(cls.family, str) and cls.family


def _x(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


def _encode(codec, x, residual=None, seed=7):
    buf = torch.zeros(codec.nbytes(x.numel()), dtype=torch.uint8)
    codec.encode(x, buf, residual, seed=seed)
    return buf


def _decode(codec, buf, n):
    out = torch.zeros(n)
    codec.decode(buf, n, out)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
class TestCodecContract:
    @pytest.fixture
    def codec(self, name):
        return codecs.codec_for(CASES[name])

    @pytest.mark.parametrize("n", [0, 1, 13, 1000, 4099])
    def test_sizes_and_split(self, codec, n):
        """A chunk's size is a multiple of 4 (the next part of a message stays aligned); its metadata
        comes first and its codes after, both inside the chunk; a chunk unit keeps blocks whole."""
        buf = _encode(codec, _x(n))
        assert buf.numel() % 4 == 0 and codec.chunk_unit() % 8 == 0
        meta, body = codec.split(buf, n)
        base = buf.data_ptr()
        assert meta.numel() == 0 or meta.data_ptr() == base
        assert body.numel() == 0 or body.data_ptr() == base + meta.numel()
        assert meta.numel() + body.numel() <= buf.numel()
        if codec.segment_tables:  # the layout the Triton tables are built from
            lay = codec.layout(n)
            assert (meta.numel(), body.numel(), buf.numel()) == (lay.meta, lay.codes, lay.nbytes)

    @pytest.mark.parametrize("n", [1, 13, 4099])
    def test_round_trip(self, codec, n):
        """Decoding gives what roundtrip() measures, errs by no more than twice the largest magnitude
        anywhere, and gives the input itself for a codec that is not lossy."""
        x = _x(n)
        y = _decode(codec, _encode(codec, x, seed=0), n)
        ref, nbytes = codecs.roundtrip(x, codec.cfg)
        assert nbytes == codec.nbytes(n) and torch.equal(y, ref)
        assert float((y - x).abs().max()) <= 2 * float(x.abs().max())
        if not codec.lossy:
            assert torch.equal(y, x)

    def test_error_feedback_identity(self, codec):
        """decode(enc) + new residual == input + old residual, for a codec that keeps a residual."""
        if not codec.cfg.uses_residual:
            pytest.skip("keeps no residual")
        x = _x(3001)
        r = (_x(3001, 1) * 0.03).to(codec.cfg.residual_torch_dtype)
        old = r.to(torch.float32, copy=True)
        buf = _encode(codec, x, r)
        y = _decode(codec, buf, 3001)
        tol = 1e-6 if r.dtype == torch.float32 else 0.02  # a bf16 residual is rounded
        torch.testing.assert_close(y + r.float(), x + old, rtol=0, atol=tol)

    def test_zeros(self, codec):
        buf = _encode(codec, torch.zeros(777))
        assert torch.equal(_decode(codec, buf, 777), torch.zeros(777)) and bool(codec.finite(buf, 777))

    @pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
    def test_nonfinite_reaches_every_receiver(self, codec, value):
        """A NaN/inf input is visible to every receiver (finite() says so, and the decoded values are
        not finite, so GradScaler skips the step), and no residual becomes non-finite."""
        x = _x(2000)
        x[1500] = value
        r = torch.zeros(2000, dtype=codec.cfg.residual_torch_dtype) if codec.cfg.uses_residual else None
        buf = _encode(codec, x, r)
        assert not bool(codec.finite(buf, 2000))
        assert not bool(torch.isfinite(_decode(codec, buf, 2000)).all())
        if r is not None:
            assert bool(torch.isfinite(r).all())

    def test_pickles_as_its_settings(self, codec):
        """Codecs reach other ranks and processes pickled: the same instance and bytes come back."""
        back = pickle.loads(pickle.dumps(codec))
        assert back is codecs.codec_for(codec.cfg) and back.cfg == codec.cfg
        cfg_back = pickle.loads(pickle.dumps(codec.cfg))
        x = _x(4099)
        assert torch.equal(_encode(codecs.codec_for(cfg_back), x), _encode(codec, x))
        assert codec.describe(codec.cfg) == codec.cfg.describe()

    def test_reduce_is_decode_sum_divide_encode(self, codec):
        """The reduce step, byte for byte the steps one by one (a codec may fuse them)."""
        if codec.sparse:
            pytest.skip("sparse messages are all-gathered, never reduced")
        n = 1500
        bufs = [_encode(codec, _x(n, s)) for s in range(3)]
        out = torch.zeros(codec.nbytes(n), dtype=torch.uint8)
        codec.reduce(bufs, n, out, 3.0, torch.empty(n), seed=5)
        want = torch.zeros_like(out)
        codecs.WireCodec.reduce(codec, bufs, n, want, 3.0, torch.empty(n), seed=5)
        assert torch.equal(out, want)

    def test_two_ranks(self, name):
        """A 2-rank gloo all-reduce (the DDP path) and reduce-scatter (the FSDP path) with this codec
        for every layer: replicas identical, results finite, exact where the codec is not lossy and
        within a few times the mean's size otherwise (1-bit quantization of a Gaussian errs by about
        twice its size)."""
        for r in run_workers(_two_ranks, 2, CASES[name], timeout=120):
            assert r["replicas_equal"] and r["finite"], r
            if codecs.codec_for(CASES[name]).lowrank:  # both matrices in one section: one P, one Q round
                assert r["lowrank_sections"] == 1, r
            if not codecs.codec_for(CASES[name]).lossy:
                assert r["allreduce_err"] == 0.0 and r["scatter_err"] == 0.0, r
            else:
                assert r["allreduce_err"] < 4.0 and r["scatter_err"] < 4.0, r


def _two_ranks(rank, world_size, cfg):
    import torch.distributed as dist

    from fastml_strategy import Plan
    from fastml_strategy.comm._layouts import ShardedTensor
    from fastml_strategy.comm._reduce_scatter import CompressedReduceScatter
    from fastml_strategy.comm.collective import CompressedAllReduce

    plan = Plan(default=cfg, min_numel=64)
    numels = [5000, 40, 3000]  # two layers with this codec and one small tensor (uncompressed)
    names = ["a", "b", "c"]
    offsets = [0, 5000, 5040]
    grads = [torch.randn(sum(numels), generator=torch.Generator().manual_seed(100 + r)) for r in range(world_size)]
    mean = sum(grads) / world_size
    eng = CompressedAllReduce(plan, dist.group.WORLD, rank, world_size)
    eng.shapes = dict(SHAPES)
    lay = eng.layout_for(names, offsets, numels, torch.device("cpu"))
    buf = grads[rank].clone()
    finite = eng.run(lay, buf, step=1)
    mine = buf.clone()
    others = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(others, mine)
    # reduce-scatter: row j of the input is every tensor's chunk j
    tensors = [ShardedTensor(n, (k // 2, k - k // 2), k - k // 2) for n, k in zip(names, numels)]
    row = sum(t.padded for t in tensors)
    inp = torch.zeros(world_size * row)
    full = grads[rank]
    pos = [0, 0]
    for t, off in zip(tensors, offsets):
        lo = 0
        for j, c in enumerate(t.chunk_numels):
            inp[j * row + pos[j]: j * row + pos[j] + c] = full[off + lo: off + lo + c]
            lo += c
            pos[j] += t.padded
    rs = CompressedReduceScatter(plan, dist.group.WORLD, rank, world_size)
    out = torch.zeros(row)
    rs_finite = rs.reduce_scatter(rs.layout_for(tensors, torch.device("cpu"), torch.float32), inp, out, step=1,
                                  scale=1.0 / world_size)
    want, p = torch.zeros(row), 0
    for t, off in zip(tensors, offsets):
        lo = sum(t.chunk_numels[:rank])
        want[p: p + t.chunk_numels[rank]] = mean[off + lo: off + lo + t.chunk_numels[rank]]
        p += t.padded
    lowrank = codecs.codec_for(cfg).lowrank
    return {"replicas_equal": all(torch.equal(o, others[0]) for o in others),
            "lowrank_sections": len(lay.lowrank) if lowrank else None,
            "finite": bool(finite) and rs_finite and bool(torch.isfinite(mine).all()),
            "allreduce_err": float((mine - mean).norm() / mean.norm()),
            "scatter_err": float((out - want).norm() / want.norm())}


# -- the wire-format version -----------------------------------------------------------------------------------------
def _mixed_builds(rank, world_size):
    import torch.distributed as dist

    from fastml_strategy.comm._distributed import agreed_plan

    real = codecs.WIRE_FORMAT_VERSION
    if rank == 1:
        codecs.WIRE_FORMAT_VERSION = real + 98  # this rank runs another build
    try:
        agreed_plan("int4", ["w"], dist.group.WORLD, world_size)
        return "no error"
    except ValueError as e:
        return str(e)
    finally:
        codecs.WIRE_FORMAT_VERSION = real


def test_ranks_of_different_wire_formats_refuse_to_start():
    msgs = run_workers(_mixed_builds, 2, timeout=60)
    assert msgs[0] == msgs[1], "every rank must raise the same error"
    v = codecs.WIRE_FORMAT_VERSION
    assert f"rank 0: wire format {v} (FastML" in msgs[0] and f"rank 1: wire format {v + 98} (FastML" in msgs[0]
    assert "install the same FastML on every machine" in msgs[0]
