"""The seeds FastML derives, identical on every rank: :func:`mix` hashes integers (the plan's seed,
the step, the rank, the stage, the layer) into the 32-bit seed of stochastic rounding or of a
generator; :func:`layer_key` is a layer's part of it, from its name, not from its position in a
bucket (DDP rebuilds buckets after the first iteration; a seed must not change with them).

A leaf module (no FastML import), so that the codecs (the low-rank codec's warm start) and the
collectives share one definition.
"""

from __future__ import annotations

from fastml_strategy.wire.messages import layer_key  # the one definition (tensor-free)

__all__ = ["mix", "layer_key"]

_M32 = 0xFFFFFFFF


def mix(*xs: int) -> int:
    """A 32-bit hash of integers (FNV-1a with a shift): the seeds of stochastic rounding, from the
    plan's seed, the step, the rank, the stage and the layer."""
    h = 0x811C9DC5
    for x in xs:
        h = ((h ^ (int(x) & _M32)) * 0x01000193) & _M32
        h ^= h >> 15
    return h
