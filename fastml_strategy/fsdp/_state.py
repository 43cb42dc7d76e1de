"""FastML's state for one FSDP2 model (:class:`FSDPState`): the step counter, the failure path, the
collectives FSDP calls (the compressed reduce-scatter, HSDP's cross-replica all-reduce, FSDP's own
ones waited for through the failure channel), statistics and checkpoints."""

# No `from __future__ import annotations`: torch's ReduceScatter is an ABC with annotated signatures.

import weakref
from typing import Optional

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy._checkpoint import (STATE_FORMAT_VERSION, check_saved_state, check_state_kind,
                                         fitting_residuals, gather_states, own_rank_state)
from fastml_strategy.comm._peers import FailureChannel
from fastml_strategy.comm._reduce_scatter import CompressedReduceScatter
from fastml_strategy.comm.collective import CompressedAllReduce, CompressionError
from fastml_strategy.config import Plan
from fastml_strategy.fsdp._checkpoint import _dcp_decode, _dcp_encode
from fastml_strategy.fsdp._units import _Unit

# The live FSDPState of each registered model: a second register() is refused until close(), since
# two states would both hook the model and closing the older one would remove the newer one's hooks.
_REGISTERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

def _scale_of(op, world_size: int, group) -> float:
    """The factor FSDP asks the reduce-scatter to apply: AVG divides by W, SUM by nothing, and a
    pre-multiplied sum (``set_gradient_divide_factor``) by the unit's divide factor."""
    name = getattr(op, "name", None) or str(op)
    if "AVG" in name:
        return 1.0 / world_size
    if name.endswith("SUM") and "PREMUL" not in name:
        return 1.0
    factor = getattr(group, "gradient_divide_factor", None)
    if factor:
        return 1.0 / float(factor)
    raise CompressionError(f"FastML: FSDP asked for a reduce-scatter with op {op!r}, which FastML does "
                           f"not know; use FSDP's default (AVG) or set_gradient_divide_factor")


class FSDPState:
    """FastML's state for one FSDP2 model on one rank (the same contract as the DDP
    :class:`~fastml_strategy.hook.FastMLState`): ``stats()``, ``state_dict()`` /
    ``load_state_dict()`` (residuals, step, plans), ``close()``, ``failure``:
    :class:`fastml_strategy.engine.Engine`, ``kind == "fsdp"``."""

    kind = "fsdp"

    def __init__(self, model, units: list, plan: Optional[Plan], shard_plan: Optional[Plan],
                 shard_size: int, shard_rank: int, replicate_group, layer_stats_every: int,
                 restore: list) -> None:
        self.model = model
        self.plan = plan  # the plan of the slow hop: the reduce-scatter (FSDP) or cross-replica (HSDP)
        self.shard_plan = shard_plan  # HSDP: the intra-node reduce-scatter's plan (None: FSDP's own)
        self.layer_stats_every = layer_stats_every
        self.shard_size, self.shard_rank = shard_size, shard_rank
        self.replicate_group = replicate_group
        self.replicate_size = dist.get_world_size(replicate_group) if replicate_group is not None else 1
        self.replicate_rank = dist.get_rank(replicate_group) if replicate_group is not None else 0
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self._units = units
        self._restore = restore  # callables that undo what register changed (close)
        rs_plan = shard_plan if replicate_group is not None else plan
        # the reduce-scatter engine: its process group is FSDP's own shard group, passed per call
        self._rs = CompressedReduceScatter(rs_plan, None, shard_rank, shard_size) if rs_plan else None
        self._ar = (CompressedAllReduce(plan, replicate_group, self.replicate_rank, self.replicate_size)
                    if replicate_group is not None else None)
        self._ag = None  # the quantized all-gather's counter (fsdp._all_gather)  # register(all_gather_bits=...)
        # HSDP: ranks meet in shard and replica groups, so a failure is told to all through the store
        self._channel: Optional[FailureChannel] = None
        self._create_residuals()
        self.step = 0
        self.nonfinite_steps = 0
        self._in_step = False
        self._step_finite = True
        self._failure: Optional[BaseException] = None
        self._closed = False
        # HSDP under set_requires_all_reduce(False): each unit's reduced shard summed over the
        # micro-batches that skip the cross-replica all-reduce (FSDP's own partial_reduce_output)
        self._partial: dict[int, torch.Tensor] = {}

    def _create_residuals(self) -> None:
        """Zero residuals for every gradient that will keep one, made now rather than at the first
        step, so that ``state_dict()`` of a fresh state already has every entry (a distributed
        checkpoint loads into them in place) and ``residual_bytes`` is known before training."""
        for unit in self._units:
            for fp, name in zip(unit.params, unit.names):
                if not fp.sharded_param.requires_grad:
                    continue
                chunks, _ = unit.layout_of(fp, self.shard_size)
                numel = sum(chunks)
                for eng, n in ((self._rs, numel), (self._ar, chunks[self.shard_rank])):
                    if eng is None:
                        continue
                    cfg = eng.plan.for_parameter(name, numel)  # (the wire dtype keeps no residual)
                    if eng is self._ar:
                        cfg = codecs.effective_config(cfg, n, eng.world_size)
                    if cfg.uses_residual:
                        eng.reserve_residual(name, n, cfg.residual_torch_dtype, fp.sharded_param.device)

    # -- the step counter: one step per backward that reduces gradients ----------------------------------
    def _begin(self) -> None:
        if self._closed:
            raise RuntimeError("FastML: this FSDP state was closed; call fastml_strategy.fsdp.register "
                               "again to compress this model's gradients")
        if self._failure is not None:
            raise self._failure
        if not self._in_step:
            self._in_step = True
            self._step_finite = True
            # runs once backward (FSDP's own final callback included) is over
            torch.autograd.Variable._execution_engine.queue_callback(self._end_step)

    def _end_step(self) -> None:
        self._in_step = False
        if not self._step_finite:
            self.nonfinite_steps += 1
        self.step += 1

    def _layer_stats_now(self) -> bool:
        every = self.layer_stats_every
        return every > 0 and self.step % every == 0

    def _fail(self, e: BaseException, what: str, unit: _Unit) -> BaseException:
        """The error to raise for ``e`` (FastML's own as it is, with its cause; anything else wrapped
        in a CompressionError whose ``__cause__`` is ``e``); the state stays failed with it. Raise it
        with a plain ``raise`` (``from None`` would drop the cause)."""
        if self._channel is not None:
            self._channel.publish(f"{type(e).__name__}: {e}")
        if isinstance(e, (CompressionError, ValueError)):
            err = e
        else:
            err = CompressionError(
                f"FastML: the {what} of FSDP unit {unit.index} ({unit.names[0]}, ...) at step "
                f"{self.step} failed on rank {self.rank} ({type(e).__name__}: {e}). If another rank "
                f"died or timed out, its log has the cause; restart from the last checkpoint.")
            err.__cause__ = e
        if self._failure is None:
            self._failure = err
        return err

    # -- called by FSDP ------------------------------------------------------------------------------------
    def _reduce_scatter(self, unit: _Unit, out: torch.Tensor, inp: torch.Tensor, group, op) -> None:
        self._begin()
        eng = self._rs
        eng.group = group
        try:
            lay = eng.layout_for(unit.tensors(self.shard_size), inp.device, inp.dtype)
            finite = eng.reduce_scatter(lay, inp.view(-1), out.view(-1), self.step,
                                        scale=_scale_of(op, self.shard_size, unit.group),
                                        layer_stats=self._layer_stats_now())
        except BaseException as e:  # noqa: BLE001
            raise self._fail(e, "compressed reduce-scatter", unit)  # noqa: B904 - the cause is set
        self._step_finite = self._step_finite and finite

    def _plain_reduce_scatter(self, unit: _Unit, out: torch.Tensor, inp: torch.Tensor, group, op) -> None:
        """HSDP without ``shard_plan``: FSDP's own intra-node reduce-scatter (the same call as its
        default), waited for through the failure channel, so that a peer's failure elsewhere in the
        mesh, or a dead shard peer, raises :class:`CompressionError` here at once."""
        if self._failure is not None:
            raise self._failure
        try:
            if inp.is_cuda or self._channel is None:
                dist.reduce_scatter_single(output=out, input=inp, group=group, op=op)
            else:
                self._channel.wait(dist.reduce_scatter_single(output=out, input=inp, group=group, op=op,
                                                              async_op=True))
        except BaseException as e:  # noqa: BLE001
            raise self._fail(e, "reduce-scatter (FSDP's own)", unit)  # noqa: B904 - the cause is set

    def _plain_all_gather(self, unit: _Unit, out: torch.Tensor, inp: torch.Tensor, group, async_op: bool):
        """FSDP's own parameter all-gather (the same call as its default). On CPU HSDP it is waited
        for here, through the failure channel (FSDP's default on CPU waits anyway: its prefetches
        are synchronous unless ``unshard_async_op``), and a failure raises :class:`CompressionError`."""
        if self._failure is not None:
            raise self._failure
        try:
            if inp.is_cuda or self._channel is None:
                return dist.all_gather_single(out, inp, group=group, async_op=async_op)
            self._channel.wait(dist.all_gather_single(out, inp, group=group, async_op=True))
        except BaseException as e:  # noqa: BLE001
            raise self._fail(e, "parameter all-gather (FSDP's own)", unit)  # noqa: B904 - the cause is set
        return None

    def _all_reduce(self, unit: _Unit, reduce_output: torch.Tensor) -> None:
        g = unit.group
        buf = reduce_output.view(-1)
        if not g.all_reduce_grads:
            # set_requires_all_reduce(False) (gradient accumulation that reduce-scatters every
            # micro-batch but all-reduces across replicas once): keep the reduced shard and add it to
            # the next one that is all-reduced, as FSDP's own HSDP does. FSDP adds what this hook
            # leaves in reduce_output to the sharded gradient: zeros, so the gradient is the same.
            if self._failure is not None:
                raise self._failure
            partial = self._partial.get(unit.index)
            if partial is None:
                self._partial[unit.index] = buf.clone()
            else:
                partial += buf
            buf.zero_()
            return
        partial = self._partial.pop(unit.index, None)
        if partial is not None:
            buf += partial
        self._begin()
        eng = self._ar
        # With set_gradient_divide_factor(f) FSDP's reduce-scatter has divided by f already (FastML
        # shows FSDP a 1-D shard mesh): the replicas' shards are summed, so the gradient is
        # sum / f, as FSDP's own HSDP gives. Otherwise the mean over the replicas completes FSDP's
        # mean over the shard.
        divisor = 1.0 if getattr(g, "gradient_divide_factor", None) else None
        try:
            names, offsets, numels, full, pos = [], [], [], [], 0
            for t in unit.tensors(self.shard_size):
                names.append(t.name)
                offsets.append(pos)
                numels.append(t.chunk_numels[self.shard_rank])
                full.append(t.numel)
                pos += t.padded
            if pos != buf.numel():
                raise CompressionError(
                    f"FastML: the reduced shard of FSDP unit {unit.index} has {buf.numel()} elements, "
                    f"its parameters {pos}")
            lay = eng.layout_for(names, offsets, numels, buf.device, buf.dtype, double_buffer=False,
                                 persistent=False, plan_numels=full)
            finite = eng.run(lay, buf, self.step, layer_stats=self._layer_stats_now(), commit=True,
                             baseline_elem_size=buf.element_size(), divisor=divisor)
        except BaseException as e:  # noqa: BLE001
            raise self._fail(e, "compressed cross-replica all-reduce", unit)  # noqa: B904 - the cause is set
        self._step_finite = self._step_finite and finite

    # -- public ---------------------------------------------------------------------------------------------
    @property
    def failure(self) -> Optional[BaseException]:
        """The first error of a compressed collective, which every later one raises (None: none)."""
        return self._failure

    def stats(self) -> dict:
        """Cumulative figures of this rank: bytes FastML sent against what FSDP's own collectives
        would have sent for the same tensors (in their reduce or parameter dtype), per hop
        (``reduce_scatter``, ``all_reduce``, ``all_gather``) and in total, and the error-feedback
        memory (``residual_bytes``)."""
        parts = {}
        for key, eng in (("reduce_scatter", self._rs), ("all_reduce", self._ar)):
            if eng is None:
                continue
            unc = int(round(eng.bytes_uncompressed))
            parts[key] = {"bytes_sent": int(eng.bytes_sent), "bytes_uncompressed": unc,
                          "compression_ratio": unc / eng.bytes_sent if eng.bytes_sent else 1.0,
                          "layers": eng.layer_stats()}
        if self._ag is not None:
            ag = self._ag
            unc = int(round(ag.bytes_uncompressed))
            parts["all_gather"] = {"bytes_sent": int(ag.bytes_sent), "bytes_uncompressed": unc,
                                   "compression_ratio": unc / ag.bytes_sent if ag.bytes_sent else 1.0,
                                   "codec": ag.cfg.describe()}
        sent = sum(p["bytes_sent"] for p in parts.values())
        unc = sum(p["bytes_uncompressed"] for p in parts.values())
        layers: dict = {}
        for p in parts.values():
            for name, row in p.get("layers", {}).items():
                if name in layers:  # HSDP with a compressed reduce-scatter too: both hops
                    prev = layers[name]
                    row = dict(prev, bytes=prev["bytes"] + row["bytes"],
                               codec=f"{prev['codec']} + {row['codec']}",
                               rel_error=max(prev["rel_error"], row["rel_error"]))
                layers[name] = row
        return {
            "engine": self.kind,
            "steps": self.step,
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "replicate_size": self.replicate_size,
            "plan": self.plan.name if self.plan is not None else None,
            "shard_plan": self.shard_plan.name if self.shard_plan is not None else None,
            "bytes_sent": sent,
            "bytes_uncompressed": unc,
            "compression_ratio": unc / sent if sent else 1.0,
            "residual_bytes": sum(e.residual_nbytes() for e in (self._rs, self._ar) if e is not None),
            "nonfinite_steps": self.nonfinite_steps,
            "layers": layers,
            **parts,
        }

    def state_dict(self, all_ranks: bool = False) -> dict:
        """This rank's state (residuals of both hops, step, plans, counters); with ``all_ranks=True``
        (a collective on every rank, between steps) every rank's, as ``{"per_rank": [...]}``.

        For a distributed checkpoint (``torch.distributed.checkpoint``), save
        ``{"fastml": state.distributed_state_dict()}``: every rank writes its own entry."""
        own = {
            "format_version": STATE_FORMAT_VERSION,
            "kind": "fsdp",
            "plan": self.plan.to_dict() if self.plan is not None else None,
            "shard_plan": self.shard_plan.to_dict() if self.shard_plan is not None else None,
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "counters": {k: [e.bytes_sent, e.bytes_uncompressed] if e is not None else None
                         for k, e in (("reduce_scatter", self._rs), ("all_reduce", self._ar),
                                      ("all_gather", self._ag))},
            "residuals": {k: ({n: v.detach().cpu().clone() for n, v in e.residuals().items()}
                              if e is not None else {})
                          for k, e in (("reduce_scatter", self._rs), ("all_reduce", self._ar))},
        }
        if not all_ranks:
            return own
        return gather_states(own, None, self.world_size)

    def distributed_state_dict(self) -> dict:
        """This rank's state in the form ``torch.distributed.checkpoint`` keeps intact:
        ``{"rank<R>": {"state": <JSON of everything but tensors>, "tensors": {path: residual}}}``. The
        key exists on rank R only, so every rank writes (and reads back) its own residuals; the JSON
        string keeps what DCP would otherwise flatten or drop (the plan, empty dicts). A fresh state's
        dict is the template to load into (its residuals exist from registration on)."""
        return {f"rank{self.rank}": _dcp_encode(self.state_dict())}

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Load what :meth:`state_dict` (one rank, or ``all_ranks=True``),
        :meth:`distributed_state_dict` or :func:`load_distributed` returned; call before the first
        step of the resumed run. The state must be this rank's, from the same world size and shard
        size and, with ``strict``, the same plans, with residuals that fit the model: otherwise
        ValueError names the mismatch before anything is loaded (``strict=False``: see
        :meth:`fastml_strategy.FastMLState.load_state_dict`)."""
        if isinstance(sd, dict) and f"rank{self.rank}" in sd and "format_version" not in sd:
            sd = sd[f"rank{self.rank}"]
            if isinstance(sd, dict) and set(sd) == {"state", "tensors"}:
                sd = _dcp_decode(sd["state"], sd["tensors"])
        sd = own_rank_state(sd, self.rank, self.world_size, STATE_FORMAT_VERSION, "FSDPState")
        check_state_kind(sd, "fsdp", "FSDPState")
        if sd.get("shard_size") != self.shard_size:
            raise ValueError(
                f"FSDPState.load_state_dict: the state was saved with shards of {sd.get('shard_size')} "
                f"ranks, this run shards over {self.shard_size}: residuals are per rank and per shard, so "
                f"resume with the same mesh, or drop the FastML entry to restart error feedback from zero")
        check_saved_state(sd, self.rank, self.world_size, self.plan, strict, "FSDPState")
        check_saved_state(sd, self.rank, self.world_size, self.shard_plan, strict, "FSDPState",
                          plan_key="shard_plan")
        hops = (("reduce_scatter", self._rs), ("all_reduce", self._ar))
        saved = sd.get("residuals") or {}
        fitting = {key: fitting_residuals(saved.get(key, {}), self._residual_sizes(key), strict, "FSDPState")
                   for key, eng in hops if eng is not None}
        self.step = int(sd["step"])
        for key, eng in (("reduce_scatter", self._rs), ("all_reduce", self._ar), ("all_gather", self._ag)):
            if eng is None:
                continue
            counters = (sd.get("counters") or {}).get(key) or [0, 0.0]
            eng.bytes_sent, eng.bytes_uncompressed = int(counters[0]), float(counters[1])
            if key in fitting:
                eng.load_residuals(fitting[key])

    def _residual_sizes(self, hop: str) -> dict:
        """Elements of each parameter's residual on this rank: the whole gradient for the
        reduce-scatter, this rank's shard of it for the cross-replica all-reduce."""
        sizes = {}
        for unit in self._units:
            for fp, name in zip(unit.params, unit.names):
                chunks, _ = unit.layout_of(fp, self.shard_size)
                sizes[name] = sum(chunks) if hop == "reduce_scatter" else chunks[self.shard_rank]
        return sizes

    def close(self) -> None:
        """Give the model back to FSDP's own collectives (FastML's residuals are dropped)."""
        if not self._closed:
            for undo in reversed(self._restore):
                undo()
            self._closed = True
            if _REGISTERED.get(self.model) is self:
                del _REGISTERED[self.model]

    def __getstate__(self) -> dict:
        raise TypeError("FSDPState holds process groups and hooks on a live model and cannot be "
                        "pickled; save state.state_dict() (or distributed_state_dict()) instead")


def _make_comm(ReduceScatter, state: FSDPState, unit: _Unit, compressed: bool = True):
    class _FastMLReduceScatter(ReduceScatter):
        """FSDP's reduce-scatter of one unit, compressed (see :mod:`fastml_strategy.fsdp`), or (HSDP
        without ``shard_plan``) FSDP's own, waited for through the failure channel."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if compressed:
                state._reduce_scatter(unit, output_tensor, input_tensor, group, op)
            else:
                state._plain_reduce_scatter(unit, output_tensor, input_tensor, group, op)
            return None

    return _FastMLReduceScatter()


