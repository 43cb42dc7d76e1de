"""The hierarchical compressed all-reduce of a DDP bucket, for N machines of R ranks each (N, R > 1).

Why: the flat scatter-reduce-allgather (:mod:`fastml_strategy.collective`) runs over all W = N x R
ranks, so each rank sends its share of every chunk to ranks on other machines, and a machine's network
link carries about 2 R (N-1)/N x S_c per step (S_c: the compressed gradient; measured 1.76 x S_c at
R = 2 and 2.89 x at R = 4 on two emulated machines, README). Reducing inside the machine first
leaves 2 (N-1)/N x S_c per machine, what a ring all-reduce of S_c between N machines costs.

Algorithm (per bucket, on every rank; this rank is local rank ``l`` of machine ``n``)
----------------------------------------------------------------------------------
1. Cut every parameter of the bucket into R parts on quantization-block boundaries
   (:class:`HierLayout`); row ``j`` is part ``j`` of every parameter, in bucket order. A part depends
   only on the parameter (its size, its codec, R), not on the bucket, so its error-feedback residual
   survives DDP's bucket rebuild, keyed by the parameter's name as in the flat path.
2. Reduce-scatter inside the machine, uncompressed: one ``all_to_all_single`` on the machine's group,
   in the gradients' own dtype, sends row ``j`` to local rank ``j``; local rank ``l`` sums the R copies
   of row ``l`` in rank order in fp32 (fp64 for an fp64 model), divides by R, and rounds the mean once
   into its row, which is in the gradients' dtype too.
3. Across machines, local rank ``l`` runs the existing compressed all-reduce
   (:class:`~fastml_strategy.collective.CompressedAllReduce`: scatter-reduce-allgather for dense
   codecs, all_gather for top-k) of its row with local rank ``l`` of every other machine: R groups of
   N ranks, in parallel. The row is a bucket of parameter parts, so every plan setting applies per
   layer as before (a tensor's size for ``min_numel`` is the whole parameter's); error feedback lives
   here, on the part (1/R of the flat path's residual memory). Top-k layers are gathered across
   machines only: each machine sends the top-k of its reduced part (k from the part's size).
4. All-gather inside the machine (the gradients' dtype), on a second group of the machine's ranks, and
   copy every row back into the bucket.

Replicas stay bit-identical: after step 3 every rank with local rank ``l`` holds the same decoded
bytes of row ``l`` (collective.py's rule), and step 4 hands exactly those to the machine.

Ordering (gloo matches collectives by order of issue: :mod:`fastml_strategy.hook`): all collectives
of a bucket run on the hook's communication thread. Step 2 and 3 are issued in bucket order. Step 4 is the bucket's
*tail*, which the thread runs once the next bucket's first cross-machine message is on the wire, so
that the slow link does not idle while one bucket is decoded and all-gathered; it runs on a group of
its own, where only tails issue collectives, always in bucket order. A tail always waits for the next
bucket (``_CommRunner.hold_tails``): run early, it would block on its all-gather while a machine peer
blocks on the next bucket's all_to_all with this rank.

End of step (:meth:`HierarchicalAllReduce.finish`): each cross-machine group resolves its own checks
(one host read), then every rank of the world exchanges 72 bytes (an error header and a finiteness
flag): an error on any rank raises the same :class:`CompressionError` on every rank, and a NaN/inf
anywhere (it reaches the parts of one local rank through step 3 and every rank through step 4) skips
the step's residual commit on every rank alike.

The hop inside the machine (steps 2 and 4) is exact by default. ``Plan.intra_node`` = fp16 or bf16
sends both steps in that dtype (half the bytes, for GPUs that share PCIe without NVLink): step 2's
copies are summed in fp32, and step 4 all-gathers the 16-bit rounding of each reduced row, which every
rank of the machine, the row's owner included, copies into its bucket (so replicas stay identical).
That rounding comes after error feedback (step 3) and is not corrected by it, which is why the hop
takes no lossier code (:func:`fastml_strategy.config.intra_node_codecs`).

Sparse gradients (their own bucket) take the exact flat sparse all-reduce.

Dtypes, and what ``none`` equals
--------------------------------
Every hop carries the gradients' own dtype unless the plan says otherwise (a lossy codec across
machines, ``intra_node`` inside): a bf16 or fp16 model's gradients are never widened to fp32 on the
wire, an fp64 model's never narrowed. Only the sums are wider (fp32 for 16-bit gradients). With a
plan that compresses nothing (``none``) step 3 is DDP's own all-reduce of the row (divide by N, one
gloo/NCCL all-reduce in the gradients' dtype), so the bytes are exactly those of the gradients'
dtype: the same bytes across machines per machine as a ring all-reduce of the model between N
machines, and (R-1)/R of the bucket inside, each way. The result is not DDP's bit for bit (no schedule
that sums the ranks of a machine first can be: DDP sums all W ranks in the backend's ring order), so
the contract is the mean within the rounding of this schedule, and as accurate as DDP's. DDP rounds
after each of its W - 1 additions; this path rounds the machine's mean (summed in fp32 for 16-bit
gradients, exactly for R = 2) once, then after each of the N - 1 additions across machines: every
element lies within (N - 1 + 1) roundings of the dtype of the exact mean (N = 2: 2 u x 2 x mean|g|,
u the dtype's unit roundoff). Measured in tests/test_hierarchical_dist.py (2 x 2 ranks, the test MLP,
against the exact fp64 mean): at most 0.43 of that bound (DDP's elements: up to 0.50-0.61 of it), and
an error norm 1.00x DDP's in bf16, 0.96x in fp16, 1.03x in fp32, 0.95x in fp64: both sit near the floor
of the one final rounding into the dtype, which no schedule avoids.

Statistics (:meth:`HierarchicalAllReduce.counters`): the bytes sent across machines and inside, each
beside what the same schedule would send uncompressed in the gradients' dtype. The headline
``compression_ratio`` of ``FastMLState.stats()`` is the cross-machine one (the link compression is
for); the hop inside the machine is exact unless ``intra_node`` halves it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy.comm._status import HEADER, CompressionError, StepChecks
from fastml_strategy.comm._status import host as _host
from fastml_strategy.comm.collective import CompressedAllReduce
from fastml_strategy.config import Plan
from fastml_strategy.comm.topology import Topology
from fastml_strategy.wire.bucket import hier_parts, part_bounds_of

__all__ = ["HierLayout", "HierarchicalAllReduce", "part_bounds"]


def part_bounds(plan: Plan, name: str, numel: int, ranks_per_node: int) -> list[int]:
    """The R + 1 boundaries of parameter ``name``'s parts (part j: local rank j's), on the codec's
    :meth:`~fastml_strategy.codecs.WireCodec.part_unit`."""
    return part_bounds_of(codecs, plan.for_parameter(name, numel), numel, ranks_per_node)


class HierLayout:
    """One bucket's parts (:func:`part_bounds`), rows and buffers; the cross-machine
    :class:`~fastml_strategy.collective.BucketLayout` of this rank's row (``shard``, None when this
    rank's row is empty: every machine's local rank ``l`` then skips step 3 alike)."""

    def __init__(self, names, offsets, numels, plan: Plan, topo: Topology, cross: CompressedAllReduce,
                 device: torch.device, dtype: torch.dtype) -> None:
        R, l = topo.ranks_per_node, topo.local_rank
        self.names = tuple(names)
        self.full_numels = [int(n) for n in numels]
        self.total_numel = int(sum(numels))
        self.dtype = dtype  # the bucket's: the row and (by default) both hops inside the machine
        self.sum_dtype = torch.promote_types(dtype, torch.float32)  # fp16/bf16 copies are summed in fp32
        # the parts and rows (fastml_strategy.wire.hier_parts; the cost model prices the same)
        parts = hier_parts(codecs, [plan.for_parameter(name, int(n)) for name, n in zip(names, numels)],
                           [int(n) for n in numels], R)
        # (row, row offset, bucket offset, elements)
        offsets = [int(off) for off in offsets]
        self.copies = [(j, roff, offsets[i] + poff, m) for j, roff, i, poff, m in parts.copies]
        mine: tuple[list, list, list, list] = ([], [], [], [])  # names, row offsets, parts, full sizes
        for i, roff, m in parts.row(l):
            for lst, v in zip(mine, (self.names[i], roff, m, self.full_numels[i])):
                lst.append(v)
        self.row_len = list(parts.row_len)
        self.P = parts.row_numel  # rows padded to one length (all_to_all, all_gather of equal rows)
        # step 3 takes the row as a bucket of the model's dtype, so its uncompressed layers travel in
        # that dtype (a 16-bit model's are not widened) and a `none` row is DDP's all-reduce of it
        self.shard = (cross.layout_for(mine[0], mine[1], mine[2], device, dtype, plan_numels=mine[3])
                      if mine[0] else None)
        self.uncompressed = self.shard is None or self.shard.uncompressed
        # steps 2 and 4 travel in the plan's intra_node dtype (fp16/bf16), else in the bucket's
        self.wire = plan.intra_node_dtype or dtype
        self.stage = torch.zeros(R, self.P, dtype=self.wire, device=device)  # rows to send (step 2)
        self.recv = torch.zeros(R, self.P, dtype=self.wire, device=device)  # the R copies of my row
        self.row = torch.zeros(self.P, dtype=dtype, device=device)  # my reduced row
        # where the R copies are summed: the row itself when it is fp32/fp64, else an fp32 buffer
        self.acc = self.row if self.sum_dtype == dtype else torch.zeros(self.P, dtype=self.sum_dtype,
                                                                         device=device)
        # my row as it travels in step 4 (a 16-bit intra_node: its rounding, which every rank of the
        # machine, this one included, takes from the gathered rows)
        self.row_wire = self.row if self.wire == self.dtype else torch.zeros(self.P, dtype=self.wire,
                                                                             device=device)
        # every row (step 4): recv's memory, free again once step 2's copies are summed into ``row``
        self.gathered = self.recv

    def residual_views(self) -> dict[str, torch.Tensor]:
        return self.shard.residual_views() if self.shard is not None else {}

    def residual_nbytes(self) -> int:
        return self.shard.residual_nbytes() if self.shard is not None else 0


class HierarchicalAllReduce:
    """The engine of the DDP hook on N machines of R ranks (what :class:`CompressedAllReduce` is for
    the flat path, with the same methods the hook calls): ``layout_for``, ``start``, ``finish``,
    ``commit``, residuals and statistics. ``group``: all W ranks (sparse buckets, the end-of-step
    agreement); ``intra`` and ``intra_gather``: two groups of this machine's ranks (steps 2 and 4);
    ``cross``: this local rank's group across machines (step 3)."""

    def __init__(self, plan: Plan, group, rank: int, world_size: int, topo: Topology,
                 intra, intra_gather, cross) -> None:
        self.plan, self.topo = plan, topo
        self.group, self.rank, self.world_size = group, rank, world_size
        self.intra, self.intra_gather = intra, intra_gather
        # step 3: the flat engine, over the N ranks of this local rank; headers name world ranks
        self.cross = CompressedAllReduce(plan, cross, topo.node_rank, topo.nodes)
        self.cross.report_rank = rank
        self.world = CompressedAllReduce(plan, group, rank, world_size)  # sparse buckets, agreement
        # How every collective of the bucket is waited for: ``work.wait()``, or (:meth:`use_channel`)
        # through a failure channel, so that a rank failing in a group this rank is not in stops this
        # rank's wait at once instead of at the process-group timeout.
        self.wait = CompressedAllReduce.wait
        self.hier_layouts: dict[tuple, HierLayout] = {}
        # statistics (what crosses machines is the cross engine's and the world engine's own counters)
        self.bytes_sent_intra = 0  # steps 2 and 4 (the machine's own link)
        self.bytes_uncompressed_intra = 0  # steps 2 and 4 in the gradients' dtype (intra_node uncompressed)
        # DDP's flat ring all-reduce of the gradients over all W ranks, in their dtype (the flat path's
        # baseline; FastMLState.stats() puts it beside the bytes this rank sent in all)
        self.bytes_uncompressed = 0.0

    def use_channel(self, channel) -> None:
        """Wait for every collective (inside the machine, across machines, the end-of-step
        agreement) through ``channel`` (:class:`fastml_strategy.comm._peers.FailureChannel`). Ranks here
        meet in three kinds of groups that do not all hold one another: when rank 2 of two machines
        of two dies, rank 0 (its cross-machine peer) and rank 3 (its machine peer) see the closed
        connection, but rank 1 next meets rank 0 in an intra-machine collective that rank 0, having
        raised, never issues; without the channel rank 1 waits for the whole process-group timeout.
        CPU tensors only: NCCL's ``wait()`` does not block the host."""
        self.wait = self.cross.wait = self.world.wait = channel.wait

    # -- what the hook reads -------------------------------------------------------------------------
    def schedule_counts(self) -> dict[str, dict[str, int]]:
        """The schedules of the cross-machine stage (:meth:`CompressedAllReduce.schedule_counts`)."""
        return self.cross.schedule_counts()

    @property
    def bytes_sent_inter(self) -> int:
        """Bytes this rank sent to other machines (step 3; sparse buckets count whole)."""
        return self.cross.bytes_sent + self.world.bytes_sent

    @property
    def bytes_sent(self) -> int:
        return self.bytes_sent_inter + self.bytes_sent_intra

    @property
    def bytes_uncompressed_inter(self) -> float:
        """What this rank would send to other machines with nothing compressed: step 3 as an
        uncompressed all-reduce of its row in the gradients' dtype (sparse buckets count whole)."""
        return self.cross.bytes_uncompressed + self.world.bytes_uncompressed

    def counters(self) -> dict:
        """The statistics a checkpoint keeps (:meth:`load_counters` takes them back)."""
        return {"bytes_sent": self.bytes_sent, "bytes_uncompressed": self.bytes_uncompressed,
                "bytes_sent_inter": self.bytes_sent_inter, "bytes_sent_intra": self.bytes_sent_intra,
                "bytes_uncompressed_inter": self.bytes_uncompressed_inter,
                "bytes_uncompressed_intra": self.bytes_uncompressed_intra}

    @property
    def layouts(self) -> dict:
        """The cross-machine layouts (of this rank's rows): where the residuals live."""
        return self.cross.layouts

    def residuals(self) -> dict[str, torch.Tensor]:
        return self.cross.residuals()

    def residual_nbytes(self) -> int:
        return self.cross.residual_nbytes()

    def load_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        self.cross.load_residuals(residuals)

    def lowrank_state(self) -> dict[str, torch.Tensor]:
        """The low-rank warm starts (none: the hierarchy refuses the low-rank codec), as the flat engine's."""
        return self.cross.lowrank_state()

    def load_lowrank_state(self, qs: dict[str, torch.Tensor]) -> None:
        self.cross.load_lowrank_state(qs)

    def load_counters(self, counters: dict) -> None:
        """Take the statistics a checkpoint saved (:meth:`counters`): ``bytes_sent_intra``,
        ``bytes_sent_inter`` (a state saved by the flat path: its ``bytes_sent``, all counted across
        machines), ``bytes_uncompressed``, and the uncompressed bytes across and inside machines (a
        state saved before FastML counted them: the share of ``bytes_uncompressed`` the same schedule
        sends, (N-1)/(W-1) across and (R-1)W/(R(W-1)) inside); absent: 0."""
        N, R, W = self.topo.nodes, self.topo.ranks_per_node, self.world_size
        self.bytes_sent_intra = int(counters.get("bytes_sent_intra", 0))
        self.cross.bytes_sent = int(counters.get("bytes_sent_inter", counters.get("bytes_sent", 0)))
        self.world.bytes_sent = 0
        self.bytes_uncompressed = unc = float(counters.get("bytes_uncompressed", 0.0))
        self.cross.bytes_uncompressed = float(counters.get("bytes_uncompressed_inter",
                                                           unc * (N - 1) / max(1, W - 1)))
        self.world.bytes_uncompressed = 0.0
        self.bytes_uncompressed_intra = int(round(counters.get("bytes_uncompressed_intra",
                                                               unc * (R - 1) * W / (R * max(1, W - 1)))))

    def part_sizes(self, sizes: dict[str, int]) -> dict[str, int]:
        """name -> elements of this rank's part of each parameter (the size of its saved residual)."""
        R, l = self.topo.ranks_per_node, self.topo.local_rank
        out = {}
        for name, n in sizes.items():
            b = part_bounds(self.plan, name, n, R)
            out[name] = b[l + 1] - b[l]
        return out

    def layer_stats(self) -> dict[str, dict]:
        """Per layer, as the flat path: ``numel`` the whole parameter, ``bytes`` what this rank sends
        across machines for its part of it."""
        rows = self.cross.layer_stats()
        full = {n: numel for lay in self.hier_layouts.values() for n, numel in zip(lay.names, lay.full_numels)}
        for name, row in rows.items():
            row["numel"] = full.get(name, row["numel"])
        for name in full.keys() - rows.keys():  # a layer too small to give this rank a part
            rows[name] = {"codec": self.plan.for_parameter(name, full[name]).describe(), "numel": full[name],
                          "bytes": 0, "rel_error": float("nan")}
        return rows

    # -- one bucket ----------------------------------------------------------------------------------
    def layout_for(self, names, offsets, numels, device, dtype=torch.float32) -> HierLayout:
        key = (tuple(names), tuple(offsets), tuple(numels), dtype)
        lay = self.hier_layouts.get(key)
        if lay is None:
            lay = HierLayout(names, offsets, numels, self.plan, self.topo, self.cross, device, dtype)
            stale = [k for k, v in self.hier_layouts.items() if set(v.names) & set(lay.names)]
            for k in stale:  # DDP rebuilt its buckets: the residuals moved to the new cross layout
                del self.hier_layouts[k]
            self.hier_layouts[key] = lay
        return lay

    def sparse_all_reduce(self, buf: torch.Tensor, checks: StepChecks | None = None):
        return self.world.sparse_all_reduce(buf, checks=checks)

    @torch.no_grad()
    def start(self, lay: HierLayout, buf: torch.Tensor, step: int, layer_stats: bool,
              checks: StepChecks, baseline_elem_size: int = 4, before=None):
        """Steps 1-3 of the bucket; returns its tail (the cross-machine decode, then step 4), which
        :class:`fastml_strategy.hook._CommRunner` may hold until the next bucket is on the wire.
        ``before`` (the previous bucket's tail) runs once this bucket's first cross-machine message
        is on the wire, so that the slow link does not idle while the previous bucket is decoded
        and all-gathered (measured: 819 ms against 505 ms of wire at 20 Mbit/s, R = 4, when it ran
        before this bucket's cross-machine stage; benchmarks/RESULTS.md)."""
        R, W = self.topo.ranks_per_node, self.world_size
        stage, recv, row, acc = lay.stage, lay.recv, lay.row, lay.acc
        for j, roff, boff, m in lay.copies:
            stage[j, roff: roff + m].copy_(buf[boff: boff + m])
        self.wait(dist.all_to_all_single(recv.view(-1), stage.view(-1), group=self.intra, async_op=True))
        self.bytes_sent_intra += (R - 1) * lay.P * stage.element_size()
        self.bytes_uncompressed_intra += 2 * (R - 1) * lay.P * baseline_elem_size  # steps 2 and 4
        acc.copy_(recv[0])
        for j in range(1, R):  # in rank order, in fp32: the same sum on every machine's local rank l
            acc.add_(recv[j])
        acc.div_(R)
        if acc is not row:
            row.copy_(acc)  # the one rounding of the machine's mean into the gradients' dtype
        n_row = lay.row_len[self.topo.local_rank]
        cross_tail = None
        if lay.shard is not None:
            cross_tail = self.cross.start(lay.shard, row[:n_row], step, layer_stats, checks,
                                          baseline_elem_size, before=before)
        elif before is not None:
            before()
        self.bytes_uncompressed += 2.0 * (W - 1) / W * baseline_elem_size * lay.total_numel

        @torch.no_grad()
        def tail() -> None:
            if cross_tail is not None:
                cross_tail()
            outs = list(lay.gathered.unbind(0))
            if lay.row_wire is not row:
                lay.row_wire.copy_(row)
            self.wait(dist.all_gather(outs, lay.row_wire, group=self.intra_gather, async_op=True))
            self.bytes_sent_intra += (R - 1) * lay.P * lay.row_wire.element_size()
            g = lay.gathered
            for j, roff, boff, m in lay.copies:
                buf[boff: boff + m].copy_(g[j, roff: roff + m])

        return tail

    def commit(self, lay: HierLayout) -> None:
        if lay.shard is not None:
            self.cross.commit(lay.shard)

    # -- shards already split by machine (an FSDP2 island) -------------------------------------------
    @torch.no_grad()
    def reduce_shards(self, names, offsets, numels, full_numels, buf: torch.Tensor, step: int,
                      layer_stats: bool = False, baseline_elem_size: int = 4) -> bool:
        """Replace ``buf``, this rank's shards of parameters ``names`` (``numels`` elements at
        ``offsets``; ``full_numels``: the whole parameters', which choose each codec as on the flat
        path), by their compressed mean with local rank ``l`` of every other machine, which holds the
        same shards: step 3 alone, since the machine already split the parameters (an FSDP2 island:
        nothing to reduce-scatter or gather inside it). Then every rank of the world agrees (as
        :meth:`finish` with ``exchange``): an error anywhere raises the same :class:`CompressionError`
        everywhere. Returns whether every rank's result was finite; the residuals (on the shards) are
        committed only then. A collective of every rank: a rank whose shards are all empty still
        takes part in the agreement. ``bytes_uncompressed`` counts a flat fp32 all-reduce of the
        whole parameters over all W ranks, as :meth:`start` does."""
        keep = [i for i, k in enumerate(numels) if k > 0]
        checks = StepChecks()
        lay = None
        if keep:
            lay = self.cross.layout_for([names[i] for i in keep], [offsets[i] for i in keep],
                                        [numels[i] for i in keep], buf.device, buf.dtype,
                                        plan_numels=[full_numels[i] for i in keep])
            tail = self.cross.start(lay, buf, step, layer_stats, checks)
            if tail is not None:
                tail()
        finite = self.finish(checks, buf.device, exchange=True)
        if finite and lay is not None:
            self.cross.commit(lay)
        W = self.world_size
        self.bytes_uncompressed += 2.0 * (W - 1) / W * baseline_elem_size * sum(full_numels)
        return finite

    # -- end of step ---------------------------------------------------------------------------------
    @torch.no_grad()
    def finish(self, checks: StepChecks, device: torch.device | None = None, exchange: bool = False,
               stage: str = "decoding", plain: bool = True) -> bool:
        """Resolve the step's checks in this rank's cross-machine group, then (``exchange``: a step
        that decoded anything) agree over every rank: the same :class:`CompressionError` everywhere
        if any rank failed, and whether every rank's result was finite."""
        error: CompressionError | None = None
        finite = True
        try:
            finite = self.cross.finish(checks, device, exchange=False, stage=stage, plain=plain)
        except CompressionError as e:  # (DecodeError included) resolved with every rank below
            error = e
        if not exchange or self.world_size == 1:
            if error is not None:
                raise error
            return finite
        return self._agree(error, finite, device)

    def _agree(self, error: CompressionError | None, finite: bool, device) -> bool:
        W = self.world_size
        dev = device if device is not None and device.type == "cuda" else torch.device("cpu")
        mine = torch.zeros(HEADER + 8, dtype=torch.uint8, device=dev)
        self.world._write_header(mine, error)
        mine[HEADER] = 1 if finite else 0
        out = torch.zeros(W * (HEADER + 8), dtype=torch.uint8, device=dev)
        self.wait(dist.all_gather(list(out.view(W, HEADER + 8).unbind(0)), mine, group=self.group,
                                  async_op=True))
        got = _host(out.view(W, HEADER + 8))
        status = got[:, :4].contiguous().view(torch.int32)[:, 0].tolist()
        failed = [r for r, s in enumerate(status) if s != 0]
        if failed:
            texts: list = [None] * W  # the rare path: the full messages (every rank takes it)
            dist.all_gather_object(texts, str(error) if error is not None else None, group=self.group)
            text = texts[failed[0]]
            if error is not None and str(error) == text:
                raise error
            err = CompressionError(text)
            err.__cause__ = error
            raise err
        return bool(got[:, HEADER].all())
