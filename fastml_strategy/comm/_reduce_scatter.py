"""FastML's compressed reduce-scatter of one FSDP unit: the first half of scatter-reduce-allgather alone.

The input holds W rows, row j the part of every gradient that rank j owns (FSDP2's layout,
:class:`~fastml_strategy.comm._layouts.ShardLayout`). Each rank encodes row j for rank j (per parameter,
with its codec and error feedback; top-k too, since nothing is re-encoded: each rank sends the top-k
of the chunk it sends), one all_to_all, and rank j decodes and sums the W copies of row j, in rank
order, into its output. No re-encoding, so no second collective, and no replicas to keep identical
(each rank owns its shard). Per-rank traffic: (W-1)/W of the compressed size. The error-feedback
residual of a rank covers every row it sends, i.e. the unsharded gradient; it is updated in place.

A rank whose encoder raises still sends (error headers, :mod:`fastml_strategy.comm._status`), so every rank
raises the same :class:`~fastml_strategy.comm._status.CompressionError` right after the all_to_all. An
error while decoding the received chunks is this rank's alone (there is no second collective to carry
it): the others fail at their next collective with this rank.
"""

from __future__ import annotations

from typing import Sequence

import torch

from fastml_strategy import codecs
from fastml_strategy.comm._exchange import ChunkExchange, mix
from fastml_strategy.comm._layouts import ShardedTensor, ShardLayout
from fastml_strategy.comm._status import CompressionError, check_headers, host

__all__ = ["CompressedReduceScatter"]


class CompressedReduceScatter(ChunkExchange):
    """The compressed reduce-scatter of FSDP units on one process group (FSDP passes the group per
    call: set :attr:`group` before :meth:`reduce_scatter`)."""

    def layout_for(self, tensors: Sequence[ShardedTensor], device, dtype) -> ShardLayout:
        """The layout of a unit's reduce-scatter input (built once per unit shape; adopts residuals)."""
        key = ("rs", tuple(tensors), dtype)
        lay = self.store.get(key)
        if lay is not None:
            return lay
        return self.store.adopt(key, ShardLayout(tensors, self.plan, self.world_size, self.rank, device, dtype))

    @torch.no_grad()
    def reduce_scatter(self, lay: ShardLayout, inp: torch.Tensor, out: torch.Tensor, step: int,
                       scale: float = 1.0, layer_stats: bool = False) -> bool:
        """Write ``scale`` x the sum over ranks of row ``rank`` of ``inp`` (compressed as the plan
        says, with error feedback) into ``out``. Returns whether this rank's result is finite."""
        if inp.numel() != lay.input_numel or out.numel() != lay.row_numel:
            raise CompressionError(
                f"FastML: reduce-scatter of {inp.numel()} -> {out.numel()} elements does not match "
                f"the layout of {', '.join(lay.names[:4])}{', ...' if len(lay.names) > 4 else ''} "
                f"({lay.input_numel} -> {lay.row_numel})")
        transient = lay.acquire()
        try:
            return self._reduce_scatter(lay, inp, out, step, scale, layer_stats)
        finally:
            if transient:
                lay.release()

    def _reduce_scatter(self, lay: ShardLayout, inp: torch.Tensor, out: torch.Tensor, step: int,
                        scale: float, layer_stats: bool) -> bool:
        base = mix(self.plan.seed, step, self.rank)
        self._exchange_chunks(lay, inp, base, layer_stats)
        self._sum_own_chunks(lay)
        checks: list[torch.Tensor] = []
        for g in lay.dense:
            if scale != 1.0:
                g.acc.mul_(scale)
            # the sum itself: a NaN/inf of any rank's chunk reaches it (and so does an overflow)
            checks.append(torch.isfinite(g.acc).all())
            for ooff, aoff, n in g.out_pieces:
                out[ooff: ooff + n].copy_(g.acc[aoff: aoff + n])
        for off, n in lay.padding:
            out[off: off + n].zero_()
        self.bytes_uncompressed += lay.baseline_bytes
        return bool(host(torch.stack(checks).all())) if checks else True

    def _exchange_chunks(self, lay: ShardLayout, buf: torch.Tensor, base: int, layer_stats: bool) -> None:
        """Encode the dense groups' chunks of ``buf`` and exchange them: afterwards ``lay.recv`` holds
        every rank's encoding of this rank's chunks (the reduce-scatter's one collective)."""
        W = self.world_size
        local_error: BaseException | None = None
        try:
            for g in lay.dense:
                self._record_error(g, *self._encode_group(lay, g, buf, base, layer_stats), layer_stats)
        except Exception as e:  # noqa: BLE001 - forwarded to every rank below
            local_error = e
        for j in range(W):
            start = sum(lay.split_sizes[:j])
            self._write_header(lay.send[start:], local_error)
        self.wait(self._all_to_all(lay, async_op=True))
        headers = [lay.recv[j * lay.my_chunk:] for j in range(W)]
        check_headers(headers, "encoding", local_error)

    def _sum_own_chunks(self, lay: ShardLayout) -> None:
        """Decode the W received copies of this rank's chunk of each group and sum them into ``acc``
        (in rank order: every rank adds in the same order)."""
        r = self.rank
        for g in lay.dense:
            n_me = g.bounds[r + 1] - g.bounds[r]
            for src, chunk in enumerate(self._own_chunks(lay, g)):
                codecs.decode_chunk(chunk, n_me, g.cfg, g.acc, accumulate=src > 0)
