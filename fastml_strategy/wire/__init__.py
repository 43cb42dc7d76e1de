"""Every collective's layout, without tensors: the one place the bytes on FastML's wire are laid out.

The runtime builds its tensor views from these layouts and the autotuner's cost model prices the
same ones, so a change to a message changes both (no layout is written twice):

========================================  ============================================  ==================================
collective                                layout (this package)                         runtime built from it
========================================  ============================================  ==================================
DDP bucket: scatter-reduce-allgather      :func:`bucket_wire` (groups, chunks, pipeline  ``_layouts.BucketLayout``
                                          pieces, message offsets, :data:`HEADER`)
hierarchical parts inside a machine       :func:`hier_parts`                            ``hierarchical.HierLayout``
FSDP2 reduce-scatter of a unit            :func:`shard_chunks` (dim-0 rule),            ``_layouts.ShardLayout``
                                          :func:`shard_wire`
quantized parameter all-gather (qwZ)      :func:`all_gather_wire`                       ``fsdp`` (``all_gather_bits``)
halving schedule and the ring/halving     :mod:`fastml_strategy.wire.schedule`          ``_halving.HalvingRun``,
choice                                                                                  ``collective``
LocalSGD fragments                        :func:`split_fragments`                       ``localsgd.LocalSGD``
========================================  ============================================  ==================================

Nothing here imports torch or handles a tensor: sizes are numbers, dtypes are passed through (a
torch dtype or a name such as ``"fp32"``; :func:`itemsize` reads its width), and codec sizes come
from ``codecs``, the first argument of every function that needs one — the codec registry
:mod:`fastml_strategy.codecs` (``codec_for(cfg).nbytes`` / ``chunk_unit`` / ``part_unit``,
``effective_config``, ``wire_config``). Pass it in; this package does not import it, so the codecs
(which import torch, and whose low-rank codec reaches the runtime) never form an import circle with
the layouts. Example::

    from fastml_strategy import codecs, wire
    from fastml_strategy.config import RECIPES

    w = wire.bucket_wire(codecs, (1 << 20, 1024), (RECIPES["int4"], RECIPES["int4"]), 4)
    w.bytes_sent(rank=0)            # what rank 0's hook sends for that bucket per step, headers included
    [p.split_sizes for p in w.pieces]
"""

from fastml_strategy.wire.bucket import (BucketWire, GroupWire, HierParts, PieceWire, SegmentWire, bucket_groups,
                                         bucket_wire, hier_parts, lowrank_sections, pack_pieces, part_bounds_of,
                                         piece_slices)
from fastml_strategy.wire.fragments import split_fragments
from fastml_strategy.wire.messages import HEADER, PIECE_NUMEL, chunk_bounds, itemsize, layer_key, message_offsets
from fastml_strategy.wire.shard import ShardGroupWire, ShardWire, shard_chunks, shard_wire
from fastml_strategy.wire.all_gather import ALL_GATHER_BLOCK, AllGatherWire, all_gather_config, all_gather_wire
from fastml_strategy.wire import schedule

__all__ = [
    # messages
    "HEADER", "PIECE_NUMEL", "itemsize", "layer_key", "chunk_bounds", "message_offsets",
    # DDP buckets and the hierarchical parts
    "bucket_groups", "lowrank_sections", "piece_slices", "pack_pieces", "part_bounds_of", "GroupWire",
    "SegmentWire", "PieceWire", "BucketWire", "bucket_wire", "HierParts", "hier_parts",
    # FSDP2: reduce-scatter and the quantized all-gather
    "shard_chunks", "ShardGroupWire", "ShardWire", "shard_wire", "ALL_GATHER_BLOCK", "all_gather_config",
    "AllGatherWire", "all_gather_wire",
    # LocalSGD and the schedules
    "split_fragments", "schedule",
]
