"""FastML under sharded training: per-layer compressed gradients for FSDP2 (``fully_shard``) and HSDP.

What it replaces
----------------
FSDP2 reduces each unit's gradients (one ``fully_shard`` module's parameters) with one reduce-scatter;
HSDP (shard inside a node, replicate across nodes) then all-reduces every shard across the replicas,
over the slow link. :func:`register` swaps in FastML's collectives:

- **FSDP** (1-D mesh): the unit's reduce-scatter becomes FastML's compressed reduce-scatter
  (:class:`fastml_strategy._reduce_scatter.CompressedReduceScatter`): each rank encodes the W
  chunks of every gradient with the layer's codec and error feedback, one all_to_all, and each rank
  decodes and sums its own chunk. Bytes per rank: (W-1)/W of the compressed size.
- **HSDP**: the cross-replica all-reduce of each reduced shard becomes FastML's scatter-reduce-
  allgather over the replicas (the DDP path's collective: replicas stay bit-identical), with error
  feedback on the shard (1/S of the model per rank). The intra-node reduce-scatter stays FSDP's own
  (fast link) unless ``shard_plan`` compresses it too.

HSDP comes in two forms, both supported: ``fully_shard(m, mesh=mesh_2d)`` on a
``("replicate", "shard")`` mesh (FastML takes the cross-replica all-reduce over from FSDP), or
``fully_shard(m, mesh=mesh_2d["shard"])`` plus ``register(..., replicate_group=mesh_2d["replicate"]
.get_group())``.

Memory
------
A reduce-scatter's error feedback keeps, on every rank, a residual for every chunk it sends: as large
as the unsharded gradient (4 bytes per parameter in fp32). ``stats()["residual_bytes"]`` says what this
rank holds; ``CodecConfig(residual_dtype="bf16")`` halves it and ``error_feedback=False`` removes it
(docs/fsdp.md has the table and the accuracy each choice costs). Residuals are updated in place (one
buffer, not DDP's two); a block that is not finite keeps its residual, and message buffers exist only
during the call.

Usage::

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    state = fastml_strategy.fsdp.register(model, plan="int4")
    ...train as usual (set_requires_gradient_sync(False) micro-batches are not compressed)...
    state.stats()["compression_ratio"], state.stats()["residual_bytes"]

The plan is keyed by the parameter names of ``model.named_parameters()`` (FSDP2 keeps them), so one
plan file serves DDP and FSDP alike. Relies on FSDP2 extension points (``set_custom_reduce_scatter``,
``set_all_reduce_hook``, ``set_reduce_scatter_unused_params``) and some FSDP2 internals (the unit's
parameter list and mesh); :func:`register` checks they exist and names the torch version otherwise.
"""

# No `from __future__ import annotations`: torch's ReduceScatter is an ABC with annotated signatures.

import json
import logging
import math
import weakref
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy._peers import FailureChannel
from fastml_strategy._validate import LAYER_STATS_EVERY, whole_number
from fastml_strategy._layouts import ShardedTensor
from fastml_strategy._reduce_scatter import CompressedReduceScatter
from fastml_strategy.collective import CompressedAllReduce, CompressionError
from fastml_strategy.config import Plan
from fastml_strategy._advice import advise, little_compressed
from fastml_strategy._checkpoint import (STATE_FORMAT_VERSION, check_saved_state, check_state_kind,
                                         fitting_residuals, gather_states, own_rank_state)
from fastml_strategy._distributed import agreed_plan, checked_plan, model_names
from fastml_strategy._lowrank import refuse_lowrank

__all__ = ["register", "FSDPState", "shard_chunks", "save_distributed", "load_distributed", "TESTED_TORCH"]

log = logging.getLogger(__name__)

TESTED_TORCH = "2.13"
_NEEDED = ("set_custom_reduce_scatter", "set_all_reduce_hook", "set_reduce_scatter_unused_params")


# -- FSDP2's sharding rule, in one place ----------------------------------------------------------------
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


# -- checks of the torch we run on ---------------------------------------------------------------------------
def _fsdp_api():
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
        from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
    except ImportError as e:
        raise RuntimeError(
            f"FastML's FSDP support needs FSDP2 (torch.distributed.fsdp.fully_shard with custom "
            f"reduce-scatter hooks: torch 2.9 or newer; tested with {TESTED_TORCH}); this is torch "
            f"{torch.__version__} ({e}). Upgrade torch, or train with DDP and register_hook."
        ) from None
    missing = [m for m in _NEEDED if not hasattr(FSDPModule, m)]
    if missing:
        raise RuntimeError(
            f"FastML's FSDP support needs FSDPModule.{', '.join(missing)} (torch 2.9 or newer; tested "
            f"with {TESTED_TORCH}); this is torch {torch.__version__}. Upgrade torch, or train with "
            f"DDP and register_hook.")
    return FSDPModule, ReduceScatter, FSDPMeshInfo, HSDPMeshInfo


# -- one FSDP unit ---------------------------------------------------------------------------------------
class _Unit:
    """One FSDP parameter group (a ``fully_shard`` module's own parameters) and its names."""

    def __init__(self, index: int, module, group, names: dict) -> None:
        self.index = index
        self.module = module
        self.group = group  # FSDPParamGroup (private)
        self.params = list(group.fsdp_params)
        self.names = [names[id(fp.sharded_param)] for fp in self.params]

    def layout_of(self, fp, world_size: int) -> tuple[tuple[int, ...], int]:
        return shard_chunks(fp._orig_size, world_size, fp.fsdp_placement.dim)

    def tensors(self, world_size: int) -> list[ShardedTensor]:
        """The gradients in this step's reduce-scatter input, in FSDP's order. FastML turns on
        ``set_reduce_scatter_unused_params``, so these are every parameter that requires a gradient
        (a parameter no rank used travels as zeros, as FSDP does it) and not the frozen ones."""
        out = []
        for fp, name in zip(self.params, self.names):
            # FSDPParam's private unsharded parameter (set by the first all-gather; no public query
            # whether a parameter takes a gradient). tests/test_upstream_internals.py fails if torch
            # renames it; here a logged warning says why the layout will not match.
            if not hasattr(fp, "_unsharded_param"):
                log.warning("FastML: FSDP's FSDPParam has no _unsharded_param in torch %s (tested with %s): "
                            "%s is treated as frozen, and the reduce-scatter layout will not match FSDP's",
                            torch.__version__, TESTED_TORCH, name)
            up = getattr(fp, "_unsharded_param", None)
            if up is None or not up.requires_grad:
                continue
            chunks, padded = self.layout_of(fp, world_size)
            out.append(ShardedTensor(name, chunks, padded))
        return out


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
        self._ag: Optional[_AllGatherCounter] = None  # register(all_gather_bits=...)
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


class _AllGatherCounter:
    """Statistics of the quantized parameter all-gather (the third hop FastML can take over)."""

    def __init__(self, cfg, world_size: int) -> None:
        self.cfg = cfg
        self.world_size = world_size
        self.bytes_sent = 0
        self.bytes_uncompressed = 0.0

    def residual_nbytes(self) -> int:
        return 0


def _quantized_all_gather(state: FSDPState, unit: _Unit, output: torch.Tensor, inp: torch.Tensor,
                          group) -> None:
    """ZeRO++ "qwZ": every rank quantizes its parameter shard (per parameter, max-min blocks, round
    to nearest), one all_gather of the bytes, and every rank (the owner too) decodes all W shards, so
    every rank computes with the same unsharded parameters. The sharded parameters the optimizer
    updates stay exact; only the copies used in forward and backward are quantized."""
    ag = state._ag
    cfg, W = ag.cfg, group.size()
    n = inp.numel()
    segs = [fp.padded_sharded_param_size.numel() for fp in unit.params]
    if sum(segs) != n:
        segs = [n]
    sizes = [codecs.chunk_nbytes(k, cfg) for k in segs]
    total = sum(sizes)
    send = torch.empty(total, dtype=torch.uint8, device=inp.device)
    pos = off = 0
    for k, nb in zip(segs, sizes):
        codecs.encode_chunk(inp[off: off + k], cfg, send[pos: pos + nb])
        pos, off = pos + nb, off + k
    recv = torch.empty(W * total, dtype=torch.uint8, device=inp.device)
    work = dist.all_gather(list(recv.view(W, total).unbind(0)), send, group=group, async_op=True)
    state._channel.wait(work) if state._channel is not None and not inp.is_cuda else work.wait()
    out = output.view(W, n)
    tmp = None if output.dtype == torch.float32 else torch.empty(n, dtype=torch.float32, device=inp.device)
    for j in range(W):
        dst = out[j] if tmp is None else tmp
        pos = off = 0
        for k, nb in zip(segs, sizes):
            codecs.decode_chunk(recv[j * total + pos: j * total + pos + nb], k, cfg, dst[off: off + k])
            pos, off = pos + nb, off + k
        if tmp is not None:
            out[j].copy_(tmp)
    ag.bytes_sent += (W - 1) * total
    ag.bytes_uncompressed += (W - 1) * n * inp.element_size()


def _make_all_gather(AllGather, state: FSDPState, unit: _Unit, quantized: bool = True):
    class _FastMLAllGather(AllGather):
        """FSDP's parameter all-gather of one unit, quantized (opt-in: register(all_gather_bits=8)),
        or (HSDP) FSDP's own, waited for through the failure channel."""

        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            if not quantized or not input_tensor.is_floating_point():
                # FSDP's own all-gather (parameters of mixed dtypes travel as bytes)
                return state._plain_all_gather(unit, output_tensor, input_tensor, group, async_op)
            try:
                _quantized_all_gather(state, unit, output_tensor, input_tensor, group)
            except BaseException as e:  # noqa: BLE001
                raise state._fail(e, "quantized parameter all-gather", unit)  # noqa: B904 - the cause is set
            return None

    return _FastMLAllGather()


# -- distributed checkpoints ------------------------------------------------------------------------------
_TENSOR_KEY = "__fastml_tensor__"  # how a tensor is referenced inside the JSON skeleton


def _dcp_encode(own: dict) -> dict:
    """One rank's state as DCP keeps it: every tensor under ``tensors/<path>``, the rest one JSON
    string (DCP would drop empty dicts and split the plan into one entry per field)."""
    tensors: dict = {}

    def enc(x: Any, path: tuple) -> Any:
        if isinstance(x, torch.Tensor):
            key = "/".join(path)
            tensors[key] = x
            return {_TENSOR_KEY: key}
        if isinstance(x, dict):
            return {str(k): enc(v, path + (str(k),)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [enc(v, path + (str(i),)) for i, v in enumerate(x)]
        return x

    return {"state": json.dumps(enc(own, ())), "tensors": tensors}


def _dcp_decode(state: str, tensors: dict) -> dict:
    def dec(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {_TENSOR_KEY}:
                return tensors[x[_TENSOR_KEY]]
            return {k: dec(v) for k, v in x.items()}
        if isinstance(x, list):
            return [dec(v) for v in x]
        return x

    return dec(json.loads(state))


CHECKPOINT_KEY = "fastml"

# The live FSDPState of each registered model: a second register() is refused until close(), since
# two states would both hook the model and closing the older one would remove the newer one's hooks.
_REGISTERED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def save_distributed(state: FSDPState, checkpoint_id) -> None:
    """Write every rank's FastML state into the distributed checkpoint folder ``checkpoint_id`` (a
    collective: call on every rank)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({CHECKPOINT_KEY: state.distributed_state_dict()}, checkpoint_id=checkpoint_id)


def load_distributed(checkpoint_id) -> Optional[dict]:
    """This rank's FastML state from a folder written by :func:`save_distributed` (a collective), as
    :meth:`FSDPState.load_state_dict` takes it, or None if the folder holds no checkpoint. Needs no
    live state (the template comes from the checkpoint's own metadata), and raises ValueError naming
    the fix if the checkpoint holds another number of ranks."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not os.path.isfile(os.path.join(str(checkpoint_id), ".metadata")):
        return None
    rank, world_size = dist.get_rank(), dist.get_world_size()
    meta = FileSystemReader(str(checkpoint_id)).read_metadata()
    paths = {fqn: tuple(p) for fqn, p in (meta.planner_data or {}).items() if p and p[0] == CHECKPOINT_KEY}
    ranks = {p[1] for p in paths.values()}
    mine = f"rank{rank}"
    if len(ranks) != world_size or mine not in ranks:
        raise ValueError(
            f"the checkpoint {checkpoint_id} holds the FastML state of {len(ranks)} ranks, this run has "
            f"{world_size}: error-feedback residuals belong to one rank's shard. Resume with the same "
            f"number of processes and mesh, or delete {checkpoint_id} to start the residuals from zero")
    template: dict = {}
    for fqn, p in paths.items():
        if p[1] == mine:
            item = meta.state_dict_metadata[fqn]
            template[fqn] = (torch.empty(item.size, dtype=item.properties.dtype)
                             if isinstance(item, TensorStorageMetadata) else None)
    dcp.load(template, checkpoint_id=checkpoint_id)
    state, tensors = None, {}
    for fqn, p in paths.items():
        if p[1] == mine and p[2] == "state":
            state = template[fqn]
        elif p[1] == mine and p[2] == "tensors":
            tensors["/".join(p[3:])] = template[fqn]
    if state is None:
        raise ValueError(f"the checkpoint {checkpoint_id} has no FastML state for {mine}; it was not "
                         f"written by fastml_strategy.fsdp.save_distributed")
    return _dcp_decode(state, tensors)


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


_OWNER = "fastml_strategy.fsdp.register"


def _check_arguments(model, all_gather_bits, layer_stats_every) -> None:
    """:func:`register`'s arguments that need no model inspection."""
    if all_gather_bits is not None and (not isinstance(all_gather_bits, int) or isinstance(
            all_gather_bits, bool) or not 2 <= all_gather_bits <= 8):
        raise ValueError(f"{_OWNER}: all_gather_bits={all_gather_bits!r}; use 2-8 (8 is ZeRO++'s choice; "
                         f"parameters lose more precision with fewer bits) or None for FSDP's own all-gather")
    whole_number("layer_stats_every", layer_stats_every, 0, owner=_OWNER, note=" (0 turns it off)")
    live = _REGISTERED.get(model)
    if live is not None and not live._closed:
        raise ValueError(f"{_OWNER}: this model is registered already; keep the FSDPState the first register() "
                         f"returned, or call its close() first")


def _fsdp_units(model) -> tuple[list, bool]:
    """The FSDP units of an FSDP2 model (one per ``fully_shard`` module), checked against FastML's
    layout rule, and whether they sit on a 2-D HSDP mesh; raises naming the fix for a model FastML
    cannot take (FSDP1, not sharded, several parameter groups or meshes, an SPMD mesh)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    FSDPModule, _, _, HSDPMeshInfo = _fsdp_api()
    if isinstance(model, FullyShardedDataParallel) or any(
            isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError(f"{_OWNER}: this model is wrapped in FSDP1 (FullyShardedDataParallel), which FastML "
                        f"does not compress; shard it with FSDP2 (torch.distributed.fsdp.fully_shard) "
                        f"instead, or in Lightning use strategy='fastml_fsdp'")
    if not isinstance(model, FSDPModule):
        raise TypeError(f"{_OWNER}: the model ({type(model).__name__}) is not an FSDP2 module; apply "
                        f"fully_shard first (each block, then the root: fully_shard(model)) and register "
                        f"afterwards, on every rank")
    names = {id(p): n for n, p in model.named_parameters()}
    units, mesh_infos = [], set()
    for mod in model.modules():
        if not isinstance(mod, FSDPModule):
            continue
        groups = mod._get_fsdp_state()._fsdp_param_groups
        if len(groups) > 1:
            raise ValueError(
                f"{_OWNER}: module {type(mod).__name__} has {len(groups)} FSDP parameter groups "
                f"(shard_placement_fn with per-parameter meshes); FSDP's custom reduce-scatter takes one "
                f"group per module: shard those parameters on one mesh")
        for g in groups:
            unit = _Unit(len(units), mod, g, names)
            for fp, name in zip(unit.params, unit.names):
                chunks, padded = unit.layout_of(fp, g.mesh_info.shard_mesh_size)
                if padded != fp.padded_sharded_param_size.numel():
                    raise RuntimeError(
                        f"FastML's FSDP2 layout rule gives {padded} padded elements per shard for "
                        f"{name} {list(fp._orig_size)}, FSDP {fp.padded_sharded_param_size.numel()}; "
                        f"this torch ({torch.__version__}) shards differently from {TESTED_TORCH}")
            units.append(unit)
            mi = g.mesh_info
            if getattr(mi, "is_spmd_mesh", False):
                raise ValueError(f"{_OWNER}: FSDP on an SPMD mesh with dp_mesh_dims (tensor parallel) is not "
                                 f"supported yet")
            mesh_infos.add((type(mi).__name__, mi.shard_mesh_size, isinstance(mi, HSDPMeshInfo)))
    if not units:
        raise ValueError(f"{_OWNER}: the model has no FSDP-managed parameters; apply fully_shard to the "
                         f"modules that hold them")
    if len(mesh_infos) > 1:
        raise ValueError(f"{_OWNER}: FSDP units use different meshes ({sorted(mesh_infos)}); shard every "
                         f"unit on the same mesh")
    return units, next(iter(mesh_infos))[2]


def _inspect(model, replicate_group, shard_plan, all_gather_bits, layer_stats_every, found: dict,
             settings: dict) -> None:
    """Everything :func:`register` checks locally before the ranks agree (``agreed_plan``'s check):
    fills ``found`` (the model's names, aliases and frozen parameters, its units, the mesh, the
    replicate group, the shard plan) and adds the mesh to the ``settings`` ranks must share."""
    _check_arguments(model, all_gather_bits, layer_stats_every)
    units, native_hsdp = _fsdp_units(model)
    trainable, al, fr = model_names(model)
    found["names"].extend(trainable)
    found["aliases"].update(al)
    found["frozen"].extend(fr)
    if native_hsdp and replicate_group is not None:
        raise ValueError(f"{_OWNER}: the model is sharded on a 2-D (replicate, shard) mesh, which already "
                         f"names the replicas; drop replicate_group (or shard on the 1-D shard mesh and keep it)")
    if replicate_group is not None and not isinstance(replicate_group, dist.ProcessGroup):
        raise TypeError(f"{_OWNER}: replicate_group is a {type(replicate_group).__name__}; pass a "
                        f"torch.distributed ProcessGroup (e.g. mesh['replicate'].get_group()) or None")
    shard_size = units[0].group.mesh_info.shard_mesh_size
    rep = (units[0].group.mesh_info.replicate_process_group if native_hsdp else replicate_group)
    rep_size = dist.get_world_size(rep) if rep is not None else 1
    if shard_size * rep_size != dist.get_world_size():
        raise ValueError(
            f"{_OWNER}: shards of {shard_size} ranks x {rep_size} replicas is not the world size "
            f"{dist.get_world_size()}; the replicate group must hold one rank of every shard group "
            f"(mesh['replicate'].get_group() of an (R, S) mesh)")
    if shard_plan is not None and rep is None:
        raise ValueError(f"{_OWNER}: shard_plan is for HSDP (the intra-node reduce-scatter); with plain FSDP, "
                         f"give the plan as plan=")
    if shard_plan is not None:
        found["shard_plan"] = checked_plan(shard_plan, model)  # the check every adapter makes
    found.update(units=units, native_hsdp=native_hsdp, shard_size=shard_size, rep=rep)
    settings.update(shard_size=shard_size, replicate_size=rep_size)


def _install(state: "FSDPState", units: list, native_hsdp: bool, rep, all_gather_bits, restore: list) -> None:
    """Swap FastML's collectives into every unit (recording in ``restore`` how to undo it)."""
    _, ReduceScatter, FSDPMeshInfo, _ = _fsdp_api()
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    for unit in units:
        g, mod = unit.group, unit.module
        # Every parameter that requires a gradient takes part in every reduce-scatter (zeros when no
        # rank used it): the layout then depends only on requires_grad, the same on every rank.
        was_unused = g.reduce_scatter_unused_params
        g.reduce_scatter_unused_params = True
        restore.append(lambda g=g, v=was_unused: setattr(g, "reduce_scatter_unused_params", v))
        if native_hsdp:
            # FastML takes the cross-replica all-reduce over: FSDP sees a 1-D shard mesh (its own
            # reduce-scatter then averages over the shard only, and calls the all-reduce hook).
            hsdp_info = g.mesh_info
            one_d = FSDPMeshInfo(mesh=hsdp_info.mesh, shard_mesh_dim=hsdp_info.shard_mesh_dim)
            one_d.reduce_scatter_process_group = hsdp_info.reduce_scatter_process_group
            post = g.post_forward_mesh_info
            g.mesh_info = one_d
            if post is hsdp_info:  # reshard_after_forward=True: after forward, back to the same mesh
                g.post_forward_mesh_info = one_d
            restore.append(lambda g=g, m=hsdp_info, pf=post: (setattr(g, "mesh_info", m),
                                                              setattr(g, "post_forward_mesh_info", pf)))
        if state._rs is not None or rep is not None:
            old = g._reduce_scatter_comm
            mod.set_custom_reduce_scatter(_make_comm(ReduceScatter, state, unit, state._rs is not None))
            restore.append(lambda g=g, c=old: setattr(g, "_reduce_scatter_comm", c))
        if all_gather_bits is not None or rep is not None:
            old_ag = g._all_gather_comm
            mod.set_custom_all_gather(_make_all_gather(AllGather, state, unit, all_gather_bits is not None))
            restore.append(lambda g=g, c=old_ag: setattr(g, "_all_gather_comm", c))
        if rep is not None:
            old_hook = g._all_reduce_hook
            mod.set_all_reduce_hook(lambda out, unit=unit: state._all_reduce(unit, out))
            restore.append(lambda g=g, h=old_hook: setattr(g, "_all_reduce_hook", h))


def register(
    model: torch.nn.Module,
    plan: Any = None,
    *,
    replicate_group: Any = None,
    shard_plan: Any = None,
    all_gather_bits: Optional[int] = None,
    layer_stats_every: int = LAYER_STATS_EVERY,
) -> FSDPState:
    """Compress an FSDP2 model's gradient reduction with FastML; returns its :class:`FSDPState`.

    Call on every rank after ``fully_shard`` has been applied (submodules first, the root last) and
    before the first backward. ``plan``: a :class:`~fastml_strategy.Plan`, a recipe name, a plan
    JSON path, a dict, or None (``FASTML_PLAN``, else ``int4``), keyed by the names of
    ``model.named_parameters()``; it compresses the reduce-scatter (FSDP) or, with HSDP, the
    cross-replica all-reduce. ``replicate_group``: HSDP with a 1-D shard mesh, the process group of
    this rank's replicas (omit it for a 2-D ``("replicate", "shard")`` mesh: FastML reads it there).
    ``shard_plan``: HSDP only, a plan for the intra-node reduce-scatter too (default None: FSDP's own,
    uncompressed, for the fast link inside a node). ``all_gather_bits``: opt-in, quantize FSDP's
    parameter all-gathers (forward, and backward when resharded) to this many bits (8: ZeRO++ "qwZ";
    blocks of 256, round to nearest): forward and backward then compute with quantized copies of the
    parameters, while the optimizer updates the exact shards. Default None: FSDP's own all-gather.
    ``layer_stats_every``: measure per-layer error every N steps (0: never).

    Every rank raises the same error before any step if the model, the plans or the groups are wrong
    on any of them.
    """
    _fsdp_api()  # FSDP2 and the extension points FastML needs, or an error naming the torch version
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{_OWNER}: torch.distributed is not initialised; call dist.init_process_group "
                           f"(torchrun sets the environment) before fully_shard")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_OWNER}: model is a {type(model).__name__}; pass the root module that fully_shard "
                        f"was applied to")
    world, world_size = dist.group.WORLD, dist.get_world_size()
    # Everything that can be wrong is checked locally first (_inspect), then agreed across ranks (no
    # rank hangs): a bad argument on one rank raises the same error on every rank, and so do settings
    # that differ: what ranks must share beside the plan (they change the collectives; _inspect adds
    # the mesh).
    settings: dict = {"all_gather_bits": all_gather_bits, "shard_plan": shard_plan is not None}
    found: dict = {"names": [], "aliases": {}, "frozen": []}  # filled by _inspect
    names, aliases, frozen = found["names"], found["aliases"], found["frozen"]
    plan_obj = agreed_plan(plan, names, world, world_size, aliases=aliases, frozen=frozen, settings=settings,
                           owner=_OWNER, check=lambda: _inspect(model, replicate_group, shard_plan, all_gather_bits,
                                                                layer_stats_every, found, settings))
    shard_plan_obj = found.get("shard_plan")
    if shard_plan_obj is not None:  # the same on every rank too
        shard_plan_obj = agreed_plan(shard_plan_obj, names, world, world_size, aliases=aliases, frozen=frozen)
    for p in (plan_obj, shard_plan_obj):  # agreed: every rank raises alike
        if p is not None:
            refuse_lowrank(p, _OWNER, "FSDP2's reduce-scatter and HSDP's cross-replica all-reduce carry flat "
                           "shards of each parameter, not its matrix")
    units, native_hsdp, shard_size, rep = (found["units"], found["native_hsdp"], found["shard_size"],
                                           found["rep"])
    if dist.get_rank() == 0 and plan_obj is not None:  # the DDP hook's advice (min_numel holding back a lossy plan)
        little = little_compressed(plan_obj, model.named_parameters(), world_size, owner="FastML FSDP")
        if little is not None:
            advise("min_numel", little, stacklevel=2)
    restore: list = []
    state = FSDPState(model, units, plan_obj, shard_plan_obj, shard_size, units[0].group.mesh_info.shard_mesh_rank,
                      rep, layer_stats_every, restore)
    _REGISTERED[model] = state
    if rep is not None:
        state._channel = FailureChannel(world, dist.get_rank())
        if units[0].params[0].sharded_param.device.type == "cpu":  # (NCCL's wait does not block)
            for eng in (state._ar, state._rs):
                if eng is not None:
                    eng.wait = state._channel.wait
    if all_gather_bits is not None:
        from fastml_strategy.config import Codec, CodecConfig

        state._ag = _AllGatherCounter(CodecConfig(codec=Codec.QUANTIZE, bits=all_gather_bits,
                                                  block_size=256), shard_size)
    _install(state, units, native_hsdp, rep, all_gather_bits, restore)
    return state
