"""What FastML's two compressed collectives share: the first half of scatter-reduce-allgather.

Both the all-reduce of a DDP bucket (:class:`fastml_strategy.collective.CompressedAllReduce`) and the
reduce-scatter of an FSDP unit (:class:`fastml_strategy.comm._reduce_scatter.CompressedReduceScatter`) start
the same way: each rank encodes chunk j of every dense group of a layout for rank j (with the group's
codec and error feedback), one ``all_to_all_single`` delivers to each rank every rank's encoding of its
own chunks, and each rank decodes those W copies in rank order. :class:`ChunkExchange` holds what that
needs on one process group: the plan, the layouts and residuals (:class:`~fastml_strategy.comm._residuals.
ResidualStore`), the seeds of stochastic rounding, the message headers' writer and the statistics.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy.comm._layouts import _DenseGroup, _Messages
from fastml_strategy.comm._residuals import ResidualStore
from fastml_strategy._seeds import mix  # noqa: F401  (re-exported: the collectives import it from here)
from fastml_strategy.comm._status import host, write_header
from fastml_strategy.config import Plan

__all__ = ["ChunkExchange", "mix"]


class ChunkExchange:
    """The state and the first stage shared by FastML's compressed collectives on one process group
    (call from one thread only)."""

    def __init__(self, plan: Plan, group, rank: int, world_size: int) -> None:
        # -- the group --------------------------------------------------------------------------------
        self.plan = plan
        self.group = group
        self.rank = rank
        self.world_size = world_size
        # the rank error headers name: ``rank`` itself, or (the hierarchical path, whose group is one
        # local rank's machines) the rank in the whole world, so every rank's error names the same one
        self.report_rank = rank
        # -- internal state ---------------------------------------------------------------------------
        self.store = ResidualStore()  # the layouts, by shape, and the residuals they own
        # parameter name -> shape (the low-rank codec views a layer as a matrix; the hook fills it in)
        self.shapes: dict[str, tuple[int, ...]] = {}
        # the low-rank codec's warm starts Q, by parameter name (they outlive bucket rebuilds)
        self.lowrank_q: dict[str, torch.Tensor] = {}
        # -- statistics ---------------------------------------------------------------------------------
        self.bytes_sent = 0  # this rank's bytes on the wire, headers included
        self.bytes_uncompressed = 0.0  # what the uncompressed collective would have sent
        self.layer_error: dict[str, float] = {}  # relative error of each layer's last measured encoding

    def load_counters(self, counters: dict) -> None:
        """Take the statistics a checkpoint saved (``bytes_sent``, ``bytes_uncompressed``; absent: 0)."""
        self.bytes_sent = int(counters.get("bytes_sent", 0))
        self.bytes_uncompressed = float(counters.get("bytes_uncompressed", 0.0))

    @staticmethod
    def wait(work) -> None:
        """Wait for one of the asynchronous collectives. A caller whose ranks meet in several groups
        (HSDP, the hierarchical all-reduce) replaces it by
        :meth:`fastml_strategy.comm._peers.FailureChannel.wait`, which also raises as soon as a rank of
        another group has failed."""
        work.wait()

    # -- layouts and residuals (the store's) -----------------------------------------------------------
    @property
    def layouts(self) -> dict:
        return self.store.layouts

    def residuals(self) -> dict[str, torch.Tensor]:
        return self.store.residuals()

    def residual_nbytes(self) -> int:
        """Bytes of error-feedback memory this rank holds."""
        return self.store.nbytes()

    def load_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        self.store.load(residuals)

    def lowrank_state(self) -> dict[str, torch.Tensor]:
        """The low-rank codec's warm starts Q (flat, n x r), by parameter name (checkpointed)."""
        return dict(self.lowrank_q)

    def load_lowrank_state(self, qs: dict[str, torch.Tensor]) -> None:
        """Take saved warm starts (a layer whose Q has another size, another rank, starts afresh)."""
        for name, q in qs.items():
            self.lowrank_q[name] = q.detach().reshape(-1).to(torch.float32).clone()

    def reserve_residual(self, name: str, numel: int, dtype: torch.dtype, device) -> None:
        """A zero residual for ``name`` before its first step (it then exists in ``state_dict()``)."""
        self.store.reserve(name, numel, dtype, device)

    def commit(self, lay) -> None:
        """Make the residuals computed by the last run of ``lay`` the current ones."""
        self.store.commit(lay)

    # -- messages ---------------------------------------------------------------------------------------
    def _write_header(self, buf: torch.Tensor, error: BaseException | None) -> None:
        write_header(buf, error, self.report_rank)

    def _all_to_all(self, lay: _Messages, async_op: bool = False):
        work = dist.all_to_all_single(lay.recv, lay.send, output_split_sizes=[lay.my_chunk] * self.world_size,
                                      input_split_sizes=lay.split_sizes, group=self.group,
                                      async_op=async_op)
        self.bytes_sent += sum(lay.split_sizes) - lay.split_sizes[self.rank]
        return work

    def _own_chunks(self, lay: _Messages, g: _DenseGroup) -> list[torch.Tensor]:
        """The W received encodings of this rank's chunk of ``g``, in rank order."""
        r = self.rank
        return [lay.recv[src * lay.my_chunk + g.recv_off:][: g.nbytes[r]] for src in range(self.world_size)]

    # -- the first stage: encode every chunk of a group ---------------------------------------------------
    @staticmethod
    def _seed(base: int, stage: int, g: _DenseGroup, *more: int) -> int:
        # A slice of a pipelined group mixes in where it starts; a whole group (start 0) keeps the
        # seeds it had before pipelining.
        start = g.bounds[0]
        return mix(base, stage, g.key, *more, start) if start else mix(base, stage, g.key, *more)

    def _encode_group(self, lay: _Messages, g: _DenseGroup, buf: torch.Tensor, base: int,
                      layer_stats: bool):
        """Encode chunk j of ``g`` into ``lay``'s message for rank j (every j), with error feedback;
        returns (squared error, squared norm) of the encoding when ``layer_stats`` (0-d device
        tensors; else zeros)."""
        if not g.direct:
            g.gather(buf)
        owner = g.base
        err2 = nrm2 = 0.0
        for j in range(self.world_size):
            a, b = g.bounds[j], g.bounds[j + 1]
            x = g.chunk(buf, j)
            out = lay.send[g.send_off[j]: g.send_off[j] + g.nbytes[j]]
            res = owner.res_cur[a:b] if g.ef else None
            res_out = owner.res_next[a:b] if g.ef and owner.res_next is not None else None
            v = None
            if layer_stats and b > a:
                v = x.to(torch.float32, copy=True)
                if res is not None:
                    v += res
            codecs.encode_chunk(x, g.cfg, out, res, res_out, seed=self._seed(base, 0, g, j))
            if v is not None:
                # relative error ||decoded - input|| / ||input|| of the first-stage encoding
                # (0-d float64 tensors on the device: read only when layer_stats() asks)
                dec = torch.empty_like(v)
                codecs.decode_chunk(out, b - a, g.cfg, dec)
                err2 = err2 + (dec - v).square().sum(dtype=torch.float64)
                nrm2 = nrm2 + v.square().sum(dtype=torch.float64)
        return err2, nrm2

    def _record_error(self, g: _DenseGroup, err2, nrm2, layer_stats: bool) -> None:
        if layer_stats:
            if isinstance(nrm2, torch.Tensor):
                rel = torch.where(nrm2 > 0, (err2 / nrm2).sqrt(), torch.zeros_like(nrm2))
            else:
                rel = math.sqrt(err2 / nrm2) if nrm2 > 0 else 0.0
            for p in g.params:
                self.layer_error[p.name] = rel

    # -- statistics ---------------------------------------------------------------------------------------
    def layer_stats(self) -> dict[str, dict]:
        """Per layer: its codec, elements, bytes this rank sends per step and relative error."""
        # The per-layer errors stay on the device until asked for: one host read for all of them.
        pending = [(n, v) for n, v in self.layer_error.items() if isinstance(v, torch.Tensor)]
        if pending:
            dev = pending[0][1].device
            vals = host(torch.stack([v.reshape(()).to(dev, torch.float64) for _, v in pending])).tolist()
            for (n, _), v in zip(pending, vals):
                self.layer_error[n] = v
        out = {}
        for lay in self.layouts.values():
            for name, (cfg, numel, nbytes) in lay.layer_rows(self.world_size, self.rank).items():
                out[name] = {
                    "codec": cfg.describe(),
                    "numel": numel,
                    "bytes": nbytes,
                    "rel_error": self.layer_error.get(name, float("nan")),
                }
        return out
