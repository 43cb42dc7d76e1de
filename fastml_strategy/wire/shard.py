"""FSDP2's reduce-scatter on the wire, without tensors: its dim-0 sharding rule (:func:`shard_chunks`)
and FastML's compressed reduce-scatter of one unit (:func:`shard_wire`).

The reduce-scatter input is W equal rows: row j is the concatenation, over the unit's gradients in
order, of each gradient's chunk j padded to its ``padded`` size. Each compressed gradient is a group
of its own whose chunk j is read straight from row j; the uncompressed ones are gathered into one
batched group per wire codec (as in a DDP bucket), chunk-major (chunk j of the group is every
tensor's chunk j). One all_to_all sends
message j (``[header | group 0 chunk j | ...]``, :func:`~fastml_strategy.wire.messages.message_offsets`)
to rank j, which decodes and sums its chunk of every group. It is never cut into pieces.

As in :mod:`fastml_strategy.wire.bucket`, ``codecs`` (:mod:`fastml_strategy.codecs`) answers every
codec size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from fastml_strategy.wire.messages import HEADER, itemsize, message_offsets

__all__ = ["shard_chunks", "ShardGroupWire", "ShardWire", "shard_wire"]

CodecConfig = Any  # a fastml_strategy.config.CodecConfig (not imported here: see the module docstring)


def shard_chunks(shape: Sequence[int], world_size: int, shard_dim: int = 0) -> tuple[tuple[int, ...], int]:
    """How FSDP2 lays out one gradient in its reduce-scatter input: ``(elements of chunk j for each
    rank j, padded elements per chunk)``.

    ``Shard(0)``: dim 0 is cut with ``torch.chunk`` (chunks of ``ceil(d0 / W)`` rows, the last ones
    shorter or empty), each chunk zero-padded to ``ceil(d0 / W)`` rows. ``Shard(i)``, i > 0, needs
    ``d_i`` divisible by W and gives W equal chunks (FSDP concatenates them along dim 0 first). The
    chunks, in rank order, are the gradient's elements in order (dim 0) or its dim-i chunks in order.
    """
    shape = tuple(int(d) for d in shape)
    if not shape:  # a scalar parameter is sharded as a 1-element vector
        shape = (1,)
    numel = math.prod(shape)
    if shard_dim != 0:
        if shape[shard_dim] % world_size:
            raise ValueError(f"Shard({shard_dim}) of a {list(shape)} tensor needs dim {shard_dim} "
                             f"divisible by {world_size}")
        n = numel // world_size
        return (n,) * world_size, n
    d0 = shape[0]
    rest = numel // d0 if d0 else 0
    rows = -(-d0 // world_size)
    chunks = tuple(max(0, min(rows, d0 - j * rows)) * rest for j in range(world_size))
    return chunks, rows * rest


@dataclass(frozen=True)
class ShardGroupWire:
    """One group of a reduce-scatter: a compressed tensor (``tensors`` holds its index alone) or the
    batched uncompressed ones. Its flat vector is cut at ``bounds`` (chunk j: rank j's, ``nbytes[j]``
    encoded); ``pieces``: (row, offset in the input, offset in the flat vector, elements), where the
    flat vector lies in the W-row input (row j's pieces make chunk j)."""

    config: CodecConfig
    tensors: tuple[int, ...]
    bounds: tuple[int, ...]
    nbytes: tuple[int, ...]
    pieces: tuple[tuple[int, int, int, int], ...]
    batched: bool

    @property
    def length(self) -> int:
        return self.bounds[-1]


@dataclass(frozen=True)
class ShardWire:
    """The compressed reduce-scatter of one FSDP unit (:func:`shard_wire`): ``offsets[t]``, tensor
    t's offset in a row of ``row_numel`` elements; ``configs[t]``, its wire codec; ``groups``; and the
    all_to_all message to rank j, ``split_sizes[j]`` bytes, group g's chunk j at ``offsets_in[g][j]``."""

    world_size: int
    row_numel: int
    elem_size: int
    offsets: tuple[int, ...]
    padded: tuple[int, ...]
    chunk_numels: tuple[tuple[int, ...], ...]
    configs: tuple[CodecConfig, ...]
    groups: tuple[ShardGroupWire, ...]
    split_sizes: tuple[int, ...]
    offsets_in: tuple[tuple[int, ...], ...]

    def out_pieces(self, g: int, rank: int) -> list[tuple[int, int, int]]:
        """Where rank ``rank``'s chunk of group ``g`` goes in its output (one row): (output offset,
        offset in the chunk, elements)."""
        grp = self.groups[g]
        return [(off - j * self.row_numel, goff - grp.bounds[rank], n)
                for j, off, goff, n in grp.pieces if j == rank]

    def padding(self, rank: int) -> list[tuple[int, int]]:
        """(output offset, elements) of rank ``rank``'s output padding (zero, as in FSDP's own)."""
        return [(off + c[rank], p - c[rank]) for off, p, c in zip(self.offsets, self.padded, self.chunk_numels)
                if p > c[rank]]

    def baseline_bytes(self) -> int:
        """Bytes FSDP's own (uncompressed) reduce-scatter sends from each rank, in the input's dtype."""
        return (self.world_size - 1) * self.row_numel * self.elem_size

    def bytes_sent(self, rank: int | None = None) -> int:
        """Bytes ``rank`` sends (its all_to_all, headers included), as the runtime counts them; None:
        the mean over ranks, each group's rounded on its own (``codecs.reduce_scatter_bytes``'s)."""
        W = self.world_size
        if W <= 1:
            return 0
        if rank is not None:
            return sum(self.split_sizes) - self.split_sizes[rank]
        return sum(int(round(sum(g.nbytes) * (W - 1) / W)) for g in self.groups) + (W - 1) * HEADER


def shard_wire(codecs: Any, chunk_numels: Sequence[Sequence[int]], padded: Sequence[int],
               planned: Sequence[CodecConfig], world_size: int, dtype: Any = "fp32",
               names: Sequence[str] | None = None) -> ShardWire:
    """The compressed reduce-scatter of a unit whose gradients (in FSDP's order) have
    ``chunk_numels[t][j]`` real elements in row j, padded to ``padded[t]`` (:func:`shard_chunks`),
    and whose plan names ``planned[t]``, for gradients of ``dtype`` (a torch dtype, handed to
    ``codecs.wire_config``). A tensor the plan does not compress joins the batched group. ``names``:
    the tensors' names, for the error a misfit raises."""
    W = world_size
    offsets, pos = [], 0
    for t, (c, p) in enumerate(zip(chunk_numels, padded)):
        if len(c) != W or any(n < 0 or n > p for n in c):
            name = names[t] if names is not None else f"tensor {t}"
            raise ValueError(f"ShardLayout: {name}: chunk sizes {tuple(c)} do not fit {W} rows of {p} elements")
        offsets.append(pos)
        pos += p
    row = pos
    configs, groups, batched = [], [], {}
    for t, (c, cfg) in enumerate(zip(chunk_numels, planned)):
        configs.append(codecs.wire_config(cfg, dtype))
        if not cfg.lossy:
            batched.setdefault(configs[t], []).append(t)
            continue
        bounds = [0]
        for n in c:
            bounds.append(bounds[-1] + n)
        groups.append(ShardGroupWire(configs[t], (t,), tuple(bounds),
                                     tuple(codecs.chunk_nbytes(n, configs[t]) for n in c),
                                     tuple((j, j * row + offsets[t], bounds[j], c[j]) for j in range(W)), False))
    groups += [_batched(codecs, cfg, chunk_numels, offsets, idx, row, W) for cfg, idx in batched.items()]
    sizes, offs = message_offsets([g.nbytes for g in groups], W)
    return ShardWire(W, row, itemsize(dtype), tuple(offsets), tuple(int(p) for p in padded),
                     tuple(tuple(c) for c in chunk_numels), tuple(configs), tuple(groups), tuple(sizes),
                     tuple(map(tuple, offs)))


def _batched(codecs: Any, cfg: CodecConfig, chunk_numels, offsets, batched: list[int], row: int,
             W: int) -> ShardGroupWire:
    """Uncompressed tensors of one wire codec as one group, chunk-major: chunk j is every such
    tensor's chunk j."""
    pieces, bounds, goff = [], [0], 0
    for j in range(W):
        for t in batched:
            n = chunk_numels[t][j]
            pieces.append((j, j * row + offsets[t], goff, n))
            goff += n
        bounds.append(goff)
    return ShardGroupWire(cfg, tuple(batched), tuple(bounds),
                          tuple(codecs.chunk_nbytes(b - a, cfg) for a, b in zip(bounds[:-1], bounds[1:])),
                          tuple(pieces), True)
