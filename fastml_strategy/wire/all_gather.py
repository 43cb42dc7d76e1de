"""FSDP2's parameter all-gather quantized (``fastml_strategy.fsdp.register(all_gather_bits=...)``,
ZeRO++'s "qwZ") on the wire, without tensors.

Every rank quantizes each parameter's padded shard on its own (max-min blocks of
:data:`ALL_GATHER_BLOCK`, round to nearest), concatenates the bytes in FSDP's parameter order, and
one all_gather gives every rank every shard: each rank sends its ``total`` bytes to the W - 1 others.
There is no header: a failure surfaces through the step's other collectives. The runtime
(:mod:`fastml_strategy.fsdp`) encodes and decodes at these offsets; the cost model prices the same
:class:`AllGatherWire`.

``codecs`` (:mod:`fastml_strategy.codecs`) answers the codec sizes, as everywhere in
:mod:`fastml_strategy.wire`. The codec settings are built from :mod:`fastml_strategy.config` on first
use (it imports the codecs, and so torch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from fastml_strategy.wire.messages import itemsize

__all__ = ["ALL_GATHER_BLOCK", "all_gather_config", "AllGatherWire", "all_gather_wire"]

# ZeRO++'s block size for the quantized weights (qwZ): each block of 256 elements carries its own
# two fp32 scales (8 bytes beside 256 bytes of int8).
ALL_GATHER_BLOCK = 256


def all_gather_config(bits: int) -> Any:
    """The codec of ``register(all_gather_bits=bits)``: max-min quantization to ``bits`` bits in
    blocks of :data:`ALL_GATHER_BLOCK`, round to nearest."""
    from fastml_strategy.config import Codec, CodecConfig

    return CodecConfig(codec=Codec.QUANTIZE, bits=bits, block_size=ALL_GATHER_BLOCK)


@dataclass(frozen=True)
class AllGatherWire:
    """One rank's message in a unit's quantized all-gather: each segment's ``numels[k]`` elements
    encoded into ``nbytes[k]`` bytes at ``offsets[k]``, ``total`` bytes in all, sent to W - 1 ranks."""

    world_size: int
    config: Any  # the CodecConfig of all_gather_config
    numels: tuple[int, ...]
    nbytes: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int
    elem_size: int

    def bytes_sent(self) -> int:
        """Bytes every rank sends per all-gather (``FSDPState.stats()["all_gather"]["bytes_sent"]``)."""
        return (self.world_size - 1) * self.total

    def bytes_uncompressed(self) -> int:
        """What FSDP's own all-gather of the same shards sends, in the parameters' dtype."""
        return (self.world_size - 1) * sum(self.numels) * self.elem_size


def all_gather_wire(codecs: Any, padded: Sequence[int], input_numel: int, bits: int, world_size: int,
                    dtype: Any = "fp32") -> AllGatherWire:
    """The quantized all-gather of one unit whose parameters' padded shards have ``padded``
    elements (FSDP's order) and whose all-gather input has ``input_numel`` elements of ``dtype``:
    one segment per parameter, or one for the whole input when the shards do not add up to it."""
    segs = [int(k) for k in padded]
    if sum(segs) != input_numel:
        segs = [int(input_numel)]
    cfg = all_gather_config(bits)
    sizes = [codecs.chunk_nbytes(k, cfg) for k in segs]
    offs, pos = [], 0
    for nb in sizes:
        offs.append(pos)
        pos += nb
    return AllGatherWire(world_size, cfg, tuple(segs), tuple(sizes), tuple(offs), pos, itemsize(dtype))
