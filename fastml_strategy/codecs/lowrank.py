"""The low-rank codec (PowerSGD, Vogels et al. 2019): an m x n gradient matrix travels as its rank-r
factors P (m x r) and Q (n x r), all low-rank layers of a bucket in one all-reduce per factor, with a
warm-started Q and error feedback. :mod:`fastml_strategy.comm._lowrank` runs the two rounds inside the
collectives (the algorithm in steps is there); this module owns the codec's settings, its fallback
rule, its sizes and its math: the matrix view, Gram-Schmidt and the seeded warm start, and the local
round trip the autotuner measures.

A layer it cannot compress with gain (1-D, ``(m + n) r >= m n``, no known shape) falls back to fp32
(:meth:`LowRankCodec.effective`), batched with the bucket's other uncompressed tensors, as torch's
PowerSGD hook all-reduces those uncompressed. It runs in the DDP hook only: FSDP/HSDP refuse it (a
shard is no matrix), so the autotuner does not search it there.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from fastml_strategy._seeds import layer_key, mix
from fastml_strategy._validate import _is_int, type_problem
from fastml_strategy.codecs._base import (DEFAULT_BLOCK_SIZE, CodecConfig, ResidualConfig, WireCodec,
                                          check_block_size, codec_for, register_codec, ring_bytes)
from fastml_strategy.codecs.plain import Bf16Config, Fp16Config, Fp32Config
from fastml_strategy.codecs.quantize import QuantizeConfig

__all__ = ["LowRankConfig", "LowRankCodec", "FACTORS", "LOWRANK_START", "START_CODEC", "matrix_shape", "orthogonalise_", "initial_q",
           "low_rank_roundtrip", "local_power_step"]

# How the factors P and Q travel: a plain fp32 all-reduce (torch's PowerSGD hook), or through FastML's
# compressed all-reduce in fp16/bf16 (half the bytes) or int8 (a quarter).
FACTORS = ("fp32", "fp16", "bf16", "int8")
# The steps a low-rank layer travels whole (as int8) before its approximation starts (LowRankConfig.start)
LOWRANK_START = 2
# the codec of those steps: int8 through the compressed all-reduce, without error feedback (a quarter of
# fp32's bytes; measured as good as fp32 for the warm-up, benchmarks/RESULTS.md)
START_CODEC = QuantizeConfig(bits=8, error_feedback=False)
# Gram-Schmidt's guard against a zero column (a layer whose gradient is zero): the smallest normal
# fp32, so that 0 / (0 + eps) = 0 and any column with a normal norm is divided by its norm exactly.
_EPS = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class LowRankConfig(ResidualConfig):
    """PowerSGD of one matrix (``CodecConfig(codec="lowrank", rank=4)``)."""

    legacy = True
    # the rank r of the approximation P Q^T of each m x n gradient matrix; it sends (m + n) r numbers
    # instead of m n (rank 4 of a 1024 x 1024 layer: 128x fewer)
    rank: int = 4
    # how the factors travel: "fp32" (a plain all-reduce, as torch's PowerSGD hook), "fp16" / "bf16"
    # (half the bytes) or "int8" (a quarter) through the compressed all-reduce, which costs two
    # collectives per round instead of one; error feedback absorbs their rounding
    factors: str = "fp32"
    # the int8 factors' quantization block
    block_size: int = DEFAULT_BLOCK_SIZE
    # the steps before the approximation starts (torch's start_powerSGD_iter): the first ``start`` steps
    # this layer's gradient travels whole, as int8 through the compressed all-reduce (no error
    # feedback); the low-rank rounds begin at step ``start``. Adam-type optimisers need it: their
    # second-moment estimate starts from the first gradients, and from a rank-r one training stalls
    # (benchmarks/RESULTS.md: a 2.7M GPT under NAdam at loss 1.87 after 120 steps with start 0, 1.06
    # with start 2, torch's hook 1.06). 0 compresses from the first step.
    start: int = LOWRANK_START

    def check(self, fail) -> None:
        if not _is_int(self.rank) or self.rank < 1:
            fail("rank", type_problem(self.rank) or f"is {self.rank!r}", "give the rank of the approximation, a "
                 "whole number >= 1 (4 is PowerSGD's usual choice)")
        if not _is_int(self.start) or self.start < 0:
            fail("start", type_problem(self.start) or f"is {self.start!r}", "give the steps before the low-rank "
                 f"approximation starts, a whole number >= 0 ({LOWRANK_START} by default; 0 compresses from the "
                 "first step)")
        if self.factors not in FACTORS:
            fail("factors", f"is {self.factors!r}", f"use one of {list(FACTORS)} (how P and Q travel)")
        check_block_size(self, fail)
        super().check(fail)

    def label(self) -> str:
        return (f"lowrank{self.rank}" + ("" if self.factors == "fp32" else f"-{self.factors}")
                + ("" if self.start == LOWRANK_START else f"-start{self.start}"))

    def to_dict(self) -> dict:
        # written only when not the default, so that a plan file of a release before the field saves to
        # the same text (and digest); such a file loads with the default's warm-up
        d = super().to_dict()
        if d.get("start") == LOWRANK_START:
            del d["start"]
        return d


# -- the math ---------------------------------------------------------------------------------------------
def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The m x n matrix a tensor of ``shape`` is viewed as (torch's PowerSGD: the first dimension
    against the rest)."""
    m = int(shape[0]) if len(shape) else 1
    return m, int(math.prod(shape[1:])) if len(shape) > 1 else 1


def orthogonalise_(p: torch.Tensor) -> torch.Tensor:
    """Orthonormalise the columns of ``p`` (m x r, fp32) in place: Gram-Schmidt with a second
    projection pass per column ("twice is enough"), so that the basis stays orthonormal when the
    matrix has rank below r (one pass leaves the last columns' roundoff along the earlier ones, which
    normalising then blows up; torch's hook switches to Householder QR above rank 2 for this).
    Deterministic: the same bits on every rank for the same input. A zero column stays zero."""
    r = p.shape[1]
    for i in range(r):
        col = p[:, i: i + 1]
        if i:
            prev = p[:, :i]
            for _ in range(2):
                col -= prev @ (prev.t() @ col)
        col /= torch.linalg.vector_norm(col) + _EPS
    return p


def initial_q(name: str, n: int, rank: int, seed: int, device) -> torch.Tensor:
    """The first warm start ``Q`` (n x r, flat) of layer ``name``: standard normal numbers from a
    generator seeded by the plan's seed and the name, the same on every rank."""
    gen = torch.Generator().manual_seed(mix(seed, 0x10E4, layer_key(name)))
    return torch.randn(n * rank, generator=gen, dtype=torch.float32).to(device)


def _power_steps(x: torch.Tensor, q: torch.Tensor, iterations: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``iterations`` power steps on ``x`` viewed as its m x n matrix, from ``q`` (n x r, not changed):
    ``P = orth(M orth(Q))``, ``Q = M^T P`` each; returns the last ``(P, Q)``."""
    m, n = matrix_shape(x.shape)
    M = x.detach().reshape(m, n).to(torch.float32)
    q = q.reshape(n, -1).clone()
    for _ in range(iterations):
        p = orthogonalise_(M @ orthogonalise_(q))
        q = M.t() @ p
    return p, q


@torch.no_grad()
def low_rank_roundtrip(x: torch.Tensor, rank: int, seed: int = 0, iterations: int = 2) -> torch.Tensor:
    """What one rank's low-rank codec makes of ``x`` (an m x n view) without communication: ``P Q^T``
    after ``iterations`` power steps from the seeded start (the warm start converges over training
    steps; two steps measure where it stands after a few). The autotuner's profile measures the error
    of this, as :func:`fastml_strategy.codecs.roundtrip` does for the other codecs."""
    p, q = _power_steps(x, initial_q("roundtrip", matrix_shape(x.shape)[1], rank, seed, x.device), iterations)
    return (p @ q.t()).reshape(x.shape)


@torch.no_grad()
def local_power_step(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One step of the codec on one rank alone (world size 1, as the autotuner's calibration trains):
    ``P = orth(M orth(Q))``, ``Q' = M^T P``; returns ``P Q'^T`` in ``x``'s shape and the new warm start
    ``Q'`` (n x r), the runtime's steps 2-6 (:mod:`fastml_strategy.comm._lowrank`) without the
    all-reduces."""
    p, q_new = _power_steps(x, q, 1)
    return (p @ q_new.t()).reshape(x.shape), q_new


def _lr(rank: int) -> LowRankConfig:
    return LowRankConfig(rank=rank)


# -- the codec --------------------------------------------------------------------------------------------
@register_codec("lowrank")
class LowRankCodec(WireCodec):
    """PowerSGD: an m x n gradient matrix travels as its rank-``rank`` factors P (m x r) and Q (n x r),
    all-reduced per bucket in two rounds with warm-started Q and error feedback
    (:mod:`fastml_strategy.comm._lowrank` runs it; its layers are a section of the bucket layout of their
    own, not chunks). A layer it cannot compress with gain falls back to fp32 (:meth:`effective`).

    A flat chunk has no matrix shape, so where a collective hands this codec a chunk (a reduce-scatter,
    the reduce step) it is that fallback's chunk: the chunk methods below are fp32's, and so is
    :meth:`wire_sample` (the factors travel as fp32 arrays or through the fp16/bf16/int8 codecs, whose
    bytes have digests of their own; a matmul's float sums may differ across BLAS builds, so their values
    are not a machine-independent digest)."""

    settings = LowRankConfig
    family = "lowrank"
    error_feedback = True
    lowrank = True
    sharded = False  # FSDP/HSDP refuse it (fastml_strategy.comm._lowrank.refuse_lowrank): a shard is no matrix
    # rank-r factors in fp32, error feedback, warm-started Q: (m + n) r factor numbers per m x n matrix,
    # two all-reduces per bucket
    recipes = {f"lowrank{r}": _lr(r) for r in (1, 2, 4, 8)}
    candidates = recipes
    uniform = ("lowrank4",)
    # on gpt2 of benchmarks/gpt_workload.py uniform lowrank4 was the first uniform recipe to the target
    # in 6 runs of 6, and ahead of the tuner's answer in 5 (benchmarks/RESULTS.md, issue 36)
    check = "lowrank4"
    __slots__ = ("flat", "factor", "start_cfg")

    def __init__(self, cfg: LowRankConfig) -> None:
        super().__init__(cfg)
        self.flat = codec_for(Fp32Config())  # the chunk form (no shape: no matrix)
        # the codec of the factors through the compressed all-reduce (None: a plain fp32 all-reduce)
        self.factor: CodecConfig | None = {
            "fp32": None, "fp16": Fp16Config(), "bf16": Bf16Config(),
            "int8": QuantizeConfig(bits=8, block_size=cfg.block_size, error_feedback=False),
        }.get(cfg.factors)
        # the codec of the warm-up steps (LowRankConfig.start): int8 in the factors' block size
        self.start_cfg: CodecConfig = dataclasses.replace(START_CODEC, block_size=cfg.block_size)

    # -- what the layer becomes ---------------------------------------------------------------------------
    def compressible(self, shape) -> bool:
        """Whether a tensor of ``shape`` gains: a matrix (2-D or more) with ``(m + n) r < m n``."""
        if shape is None or len(shape) < 2:
            return False
        m, n = matrix_shape(shape)
        return (m + n) * self.cfg.rank < m * n

    def effective(self, numel: int, world_size: int, shape=None) -> CodecConfig:
        return self.cfg if self.compressible(shape) else self.flat.cfg

    def factor_numels(self, shape) -> tuple[int, int]:
        """Elements of P and Q of a tensor of ``shape``: ``(m r, n r)``."""
        m, n = matrix_shape(shape)
        return m * self.cfg.rank, n * self.cfg.rank

    def factor_nbytes(self, numel: int) -> int:
        """Encoded bytes of ``numel`` factor elements (4 each as a plain fp32 all-reduce)."""
        return 4 * numel if self.factor is None else codec_for(self.factor).nbytes(numel)

    def factor_round_bytes(self, numel: int, world_size: int) -> float:
        """Codec bytes this rank sends for ``numel`` factor elements in one round (a ring all-reduce's
        2(W-1)/W of their encoding; headers not included)."""
        return ring_bytes(self.factor_nbytes(numel), world_size)

    def rank_bytes(self, numel: int, world_size: int, shape=None) -> float:
        return sum(self.factor_round_bytes(n, world_size) for n in self.factor_numels(shape))

    def roundtrip(self, x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, int]:
        if not self.compressible(tuple(x.shape)):
            return self.flat.roundtrip(x, seed)  # its fallback
        nbytes = sum(self.factor_nbytes(k) for k in self.factor_numels(tuple(x.shape)))
        return low_rank_roundtrip(x, self.cfg.rank, seed=seed), nbytes

    # -- the chunk form: fp32's ----------------------------------------------------------------------
    def nbytes(self, numel):
        return self.flat.nbytes(numel)

    def split(self, buf, numel):
        return self.flat.split(buf, numel)

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        self.flat.encode(x, out)

    def decode(self, buf, numel, out, accumulate=False) -> None:
        self.flat.decode(buf, numel, out, accumulate)

    def finite(self, buf, numel):
        return self.flat.finite(buf, numel)
