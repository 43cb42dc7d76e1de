"""The pieces every collective's layout is made of: the message header, chunk boundaries, and where
each chunk lies in a message.

A FastML message to (or from) rank ``j`` is ``[header | group 0 chunk j | group 1 chunk j | ...]``:
:data:`HEADER` bytes of status (:mod:`fastml_strategy.comm._status` writes and reads them), then one chunk
of every group, each a multiple of 4 bytes (the codec's ``nbytes``). :func:`message_offsets` gives
the sizes and offsets of such messages; the DDP bucket's all_to_all and all_gather, the FSDP
reduce-scatter's all_to_all and the cost model all take them from it.
"""

from __future__ import annotations

import math
import zlib
from typing import Any, Sequence

__all__ = ["HEADER", "PIECE_NUMEL", "itemsize", "layer_key", "chunk_bounds", "message_offsets"]

HEADER = 64  # bytes: int32 status, int32 rank, 56 bytes of UTF-8 error text (fastml_strategy.comm._status)

# Pipelining: a bucket is cut into pieces of about this many gradient elements, each with its own
# all_to_all and all_gather, so that piece k+1 is encoded while piece k is on the wire and piece k-1
# is decoded. 4M elements is 16 MB of fp32 gradient and 2 MB of int4 message (17 ms at 1 Gbit/s); the
# README MLP's 16.8M-element layer becomes 4 pieces. Measured on that MLP (2 ranks on a shared 2-core
# EPYC, load 3; steps alternating between pieces and one piece per bucket in one process): 4M elements
# 1.07-1.11x faster at 1 Gbit/s and 1.00-1.04x with no link limit; 2M elements 1.05-1.08x and
# 0.91-0.96x (with a fast link, the extra collectives' thread hand-offs cost more than they hide).
PIECE_NUMEL = 1 << 22

# bytes per element by the names the plans and the autotuner use (a torch dtype answers .itemsize)
_ITEMSIZE = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "fp64": 8, "float64": 8}


def itemsize(dtype: Any) -> int:
    """Bytes per element of ``dtype``: a torch dtype (its ``itemsize``; no torch import here) or one of
    the names ``"fp32"``, ``"fp16"``, ``"bf16"``, ``"fp64"`` (or ``"float32"``, ...)."""
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        raise ValueError(f"dtype {dtype!r}: use a torch dtype or one of {sorted(set(_ITEMSIZE))}")
    return _ITEMSIZE[name]


def layer_key(name: str) -> int:
    """A seed component that depends on the layer, not on its position in a bucket (buckets are
    rebuilt after the first iteration; stochastic rounding must not change with them)."""
    return zlib.crc32(name.encode())


def chunk_bounds(length: int, unit: int, W: int) -> list[int]:
    """W + 1 boundaries cutting ``length`` elements into W near-equal chunks on ``unit`` boundaries."""
    units = math.ceil(length / unit)
    return [min(length, (j * units // W) * unit) for j in range(W)] + [length]


def message_offsets(nbytes: Sequence[Sequence[int]], world_size: int
                    ) -> tuple[list[int], list[list[int]]]:
    """The messages ``[header | group 0 chunk j | group 1 chunk j | ...]`` for ``j`` in
    ``range(world_size)``, where ``nbytes[g][j]`` is the encoded size of group g's chunk j:
    ``(size of message j, offsets[g][j])``, the offset of group g's chunk inside message j. An
    all_to_all sends message j to rank j (rank j receives every rank's message j, so it finds
    group g of each at ``offsets[g][j]``); an all_gather of chunk messages uses the same offsets."""
    sizes: list[int] = []
    offsets: list[list[int]] = [[] for _ in nbytes]
    for j in range(world_size):
        size = HEADER
        for g, nb in enumerate(nbytes):
            offsets[g].append(size)
            size += nb[j]
        sizes.append(size)
    return sizes, offsets
