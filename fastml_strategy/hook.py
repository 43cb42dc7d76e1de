"""The DDP communication hook: FastML's compressed all-reduce inside DDP's backward pass.

How it runs
-----------
DDP calls the hook once per bucket, in bucket order, from the autograd thread, as soon as the bucket's
gradients are ready. The hook only enqueues the bucket and returns a fresh ``torch.futures.Future``; a
single communication thread per process takes buckets in that order, encodes, runs the bucket's two
collectives (:mod:`fastml_strategy.collective`) and completes the future. So

- backward keeps computing the next buckets' gradients while earlier buckets are on the wire
  (communication overlaps backward, as with DDP's own all-reduce);
- every rank issues every collective in one fixed order. gloo matches collectives by order of issue,
  and torch's PowerSGD hook, which issues follow-up collectives from future callbacks, aborts on gloo
  as soon as a model has two buckets ("Received data size doesn't match expected size");
- the thread uses a process group of its own, so collectives that DDP or the user issue on the main
  thread (unused-parameter maps, buffer broadcasts, metric syncs) cannot interleave with ours;
- inside a bucket the work is pipelined (:data:`fastml_strategy.collective.PIECE_NUMEL`): the bucket
  is cut into pieces of about 4M elements, each with its own pair of collectives, so that piece k+1
  is encoded while piece k is on the wire and piece k-1 is decoded; and across buckets, a bucket's
  last piece is decoded once the next bucket's first piece is on the wire (:class:`_CommRunner`).

A plan that compresses no parameter (every layer ``none``) is DDP's own all-reduce and runs as torch's
``allreduce_hook`` does: the hook divides the bucket and issues one asynchronous all-reduce itself, in
bucket order (one thread issues every collective of the group, so the order argument above holds); the
communication thread stays idle (:meth:`FastMLState._direct_all_reduce`).

Overlap with backward needs several buckets. The hook is called once per bucket, when all of the
bucket's gradients are ready; a model that DDP packs into one or two buckets (its default
``bucket_cap_mb=25`` holds a 6M-parameter model in one) communicates only after backward. Give DDP a
smaller cap, ``DDP(model, bucket_cap_mb=suggest_bucket_cap_mb(model))`` (about four buckets); FastML
gives this advice after the first steps of a model with fewer than three buckets.

Advice (:mod:`fastml_strategy._advice`): what a user should change is a ``fastml_strategy.FastMLAdvice``
warning,
shown once per job on rank 0 (the bucket cap above; ``gradient_as_bucket_view=True``; a lossy plan
that compresses under 5% of the gradient bytes because its tensors fall under ``min_numel``). The plan
summary (how many tensors and elements each codec takes) needs no action and is ``logging`` INFO of
``fastml_strategy.hook``, hidden unless the user turns INFO on.

Usage::

    model = DDP(model)
    state = fastml_strategy.register_hook(model, plan="int4")   # or a Plan, a JSON path, a dict
    ...train as usual...
    state.stats()["compression_ratio"]
"""

# DDP's register_comm_hook compares the hook's ``bucket`` and return annotations with GradBucket and
# Future[Tensor]; under postponed annotations they would be strings and fail that check, so
# ``_fastml_hook`` carries none (the rest of the module may use them, as every other module does).
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from fastml_strategy._advice import advise, little_compressed
from fastml_strategy._checkpoint import (STATE_FORMAT_VERSION, check_saved_state, check_state_kind,
                                         fitting_residuals, gather_states, own_rank_state)
from fastml_strategy.comm._distributed import agreed_machines, agreed_plan, default_group_timeout, model_names
from fastml_strategy.comm._peers import FailureChannel
from fastml_strategy.comm._halving import may_halve
from fastml_strategy._validate import LAYER_STATS_EVERY, whole_number
from fastml_strategy.comm.collective import CompressedAllReduce, CompressionError, StepChecks
from fastml_strategy.config import Plan
from fastml_strategy.comm.topology import Topology

__all__ = ["FastMLState", "register_hook", "suggest_bucket_cap_mb", "ReplicaDriftError", "CompressionError"]

log = logging.getLogger(__name__)


class ReplicaDriftError(RuntimeError):
    """Raised on every rank when the periodic replica check finds parameters that differ."""


@dataclass
class _Job:
    index: int
    is_last: bool
    buffer: torch.Tensor
    names: tuple
    offsets: tuple
    numels: tuple
    future: torch.futures.Future
    event: Optional[Any] = None
    sparse: bool = False  # a sparse gradient (nn.Embedding(sparse=True)): its own bucket, exact
    done: threading.Event = field(default_factory=threading.Event)  # set once the future is complete


def _checksum(params) -> int:
    """An exact integer checksum of parameters' bits (any bit flip changes it)."""
    total = 0
    for p in params:
        t = p.detach().reshape(-1)
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        total = (total * 1000003 + int(t.view(ints).sum(dtype=torch.int64))) & 0x7FFFFFFFFFFFFFFF
    return total


class _Held:
    """A bucket whose tail (its last piece's decode) waits for the next bucket's first send."""

    def __init__(self, job: _Job, tail) -> None:
        self.job, self.tail, self.done = job, tail, False


class _CommRunner:
    """The communication thread of one :class:`FastMLState`: buckets are queued in the order DDP hands
    them over, and one thread runs ``work(job, before)`` for each (on a CUDA stream of its own for CUDA
    buffers) and completes the job's future. The first error is sticky: the process group may be
    unusable, so no further collective is issued and every later job fails with that error (a restart
    from a checkpoint is the fix).

    Pipelining across buckets: ``work`` may return the bucket's tail (the decode of its last piece,
    which issues no collective) instead of running it. When the next bucket is already queued, the
    tail is held and runs as that bucket's ``before``, once its first message is on the wire; the
    bucket's future completes then. Otherwise it runs at once. The tails never move a collective, so
    ranks that decide this differently (it depends on timing) still issue the same collectives in
    the same order."""

    def __init__(self, rank: int, work, explain) -> None:
        self._work = work  # (job, before) -> tail or None: the compressed all-reduce of one bucket
        self._explain = explain  # (exception, bucket index) -> the exception the user sees
        self._queue: "queue.Queue[Optional[_Job]]" = queue.Queue()
        # True (the hierarchical path): a held tail always waits for the next bucket, never runs on
        # its own when the queue is empty. Its tail blocks on an all-gather with the machine's other
        # ranks; one of them may meanwhile block on the next bucket's intra-machine all_to_all with
        # this rank, so a tail run early could deadlock (seen on 4 ranks). A held bucket is never the
        # step's last, so the next one always comes.
        self.hold_tails = False
        self._stream = None  # CUDA stream of the thread, made on the first CUDA bucket
        self.failure: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._loop, name=f"fastml-comm-r{rank}", daemon=True)
        self._thread.start()

    def submit(self, job: _Job) -> None:
        if not self._thread.is_alive():
            raise RuntimeError("FastML: the communication thread has stopped (state.close() was "
                               "called); register the hook on a new DDP model to train again")
        self._queue.put(job)

    def close(self, timeout: float = 30) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=timeout)

    def _on_stream(self, job: _Job):
        if not job.buffer.is_cuda:
            return contextlib.nullcontext()
        if self._stream is None:
            # The current device is per thread: NCCL must see this rank's GPU here too.
            torch.cuda.set_device(job.buffer.device)
            self._stream = torch.cuda.Stream(device=job.buffer.device)
        return torch.cuda.stream(self._stream)

    def _fail(self, job: _Job, e: BaseException) -> BaseException:
        err = self._explain(e, job.index)
        if self.failure is None:
            self.failure = err
        job.future.set_exception(err)
        job.done.set()
        return err

    def _complete(self, held: _Held, reraise: bool) -> None:
        """Run a held bucket's tail and complete its future (once)."""
        if held.done:
            return
        held.done = True
        try:
            with self._on_stream(held.job):
                if held.tail is not None:
                    held.tail()
                held.job.future.set_result(held.job.buffer)
            held.job.done.set()
        except BaseException as e:  # noqa: BLE001 - raised in backward by the hook
            err = self._fail(held.job, e)
            if reraise:  # inside the next bucket: it fails too (the group may be unusable)
                raise err from e

    def _loop(self) -> None:
        held: Optional[_Held] = None
        while True:
            if held is not None and self._queue.empty() and not self.hold_tails:
                self._complete(held, reraise=False)  # nothing queued to overlap it with
                held = None
            job = self._queue.get()
            if job is None:
                if held is not None:
                    self._complete(held, reraise=False)
                return
            prev, held = held, None
            try:
                if self.failure is not None:
                    raise self.failure
                with self._on_stream(job):
                    if job.event is not None:
                        self._stream.wait_event(job.event)
                    tail = self._work(job, (lambda: self._complete(prev, reraise=True)) if prev else None)
                    if prev is not None:
                        self._complete(prev, reraise=True)  # the job sent nothing (or was plain)
                    if tail is not None and not job.is_last:
                        held = _Held(job, tail)
                    else:
                        if tail is not None:
                            tail()
                        job.future.set_result(job.buffer)
                        job.done.set()
            except BaseException as e:  # noqa: BLE001 - raised in backward by the hook
                if prev is not None:
                    self._complete(prev, reraise=False)
                self._fail(job, e)


class StepCommit:
    """The per-step commit policy of the hook: when error-feedback residuals move on, and when a step
    fails.

    Every bucket of a step runs with its checks kept on the device (:class:`StepChecks`: the
    status of every message header received, the finiteness of every result, this rank's own
    errors), and its layout waits uncommitted. At the step's last bucket, :meth:`end_step` resolves
    them with one host read (:meth:`CompressedAllReduce.finish`; after a 64-byte all_gather of each
    rank's decoding status when the step decoded anything): an error on any rank raises the same
    :class:`CompressionError` on every rank; a step with a NaN/inf anywhere (the step GradScaler
    skips) leaves every residual untouched and counts in ``nonfinite_steps``; otherwise every
    bucket's residuals are committed together. A step of plain all-reduces only (a ``none`` plan)
    has no residual to hold back and checks nothing, as DDP's own hook: one pass over the gradients
    less (13 ms a step for the 25.2M README MLP on one core of a 2-core AMD EPYC, family 25 model 1,
    AVX2)."""

    def __init__(self, engine: Optional[CompressedAllReduce]) -> None:
        self.engine = engine
        self.nonfinite_steps = 0  # steps whose result held NaN/inf (residuals left unchanged)
        self._new_step()

    def _new_step(self) -> None:
        self.layouts: list = []  # buckets of this step waiting for their residuals to be committed
        self.checks = StepChecks()
        # whether a bucket of this step ran the compressed path (the plan and the bucket decide it, so
        # every rank agrees): a step of plain all-reduces only (a `none` plan) exchanges no status,
        # DDP's one collective per bucket and no more
        self.decodes = False

    def run_bucket(self, job: "_Job", step: int, layer_stats: bool, before=None):
        """Start the bucket's all-reduce; returns its tail (:meth:`CompressedAllReduce.start`) or
        None. ``before`` runs once the bucket's first message is on the wire."""
        eng = self.engine
        if job.sparse:
            if before is not None:
                before()
            eng.sparse_all_reduce(job.buffer, checks=self.checks)
            return None
        lay = eng.layout_for(job.names, job.offsets, job.numels, job.buffer.device, job.buffer.dtype)
        self.decodes = self.decodes or not lay.uncompressed
        self.layouts.append(lay)
        # the statistics' baseline: DDP's all-reduce of these gradients, in their own dtype
        return eng.start(lay, job.buffer, step, layer_stats, self.checks,
                         baseline_elem_size=job.buffer.element_size(), before=before)

    def end_step(self, device: torch.device) -> bool:
        """Resolve the step (raises its error on every rank alike), commit or skip; returns whether
        the step was finite."""
        checks, layouts, decodes = self.checks, self.layouts, self.decodes
        self._new_step()
        finite = self.engine.finish(checks, device, exchange=decodes, plain=decodes)
        if finite:
            for lay in layouts:
                self.engine.commit(lay)
        else:
            self.nonfinite_steps += 1
        return finite


class FastMLState:
    """State of the FastML comm hook of one DDP model on one rank.

    Pass it around like torch's ``PowerSGDState``: ``stats()`` for the figures, ``state_dict()`` /
    ``load_state_dict()`` for checkpoints (residuals, step counter, counters, plan). The communication
    itself (thread, queue, CUDA stream) is a :class:`_CommRunner` the state owns, and when a step's
    residuals move on (its one host read, the commit or the skip of a non-finite step) a
    :class:`StepCommit`.

    Pickling keeps what a checkpoint keeps (the settings, the plan, ``state_dict()``), not the process
    group, the thread or the parameters, as ``PowerSGDState`` drops its process group. An unpickled
    state is *detached*: ``stats()`` and ``state_dict()`` answer from what was saved, and a hook that
    runs on it raises, saying to register the hook on the model again and load this state into it.

    One of FastML's engines (:class:`fastml_strategy.engine.Engine`, ``kind == "ddp"``).
    """

    kind = "ddp"

    def __init__(self, plan: Plan, process_group, rank: int, world_size: int, names: dict,
                 params: list, check_replicas_every: int = 0, layer_stats_every: int = LAYER_STATS_EVERY,
                 topology: Optional[Topology] = None, node_groups: Optional[tuple] = None) -> None:
        # -- tuned by the user --------------------------------------------------------------------
        self.plan = plan  # per-layer codecs; equal on every rank (checked at registration)
        self.check_replicas_every = check_replicas_every  # 0: never; N: checksum params every N steps
        self.layer_stats_every = layer_stats_every  # per-layer error costs a pass; measured every N steps
        # -- internal state -------------------------------------------------------------------------
        self.process_group = process_group  # our own group: nothing else issues collectives on it
        self._own_group = False  # register_hook made the group: close() destroys it
        self.rank = rank
        self.world_size = world_size
        self._names = names  # id(param) -> name (as in model.module.named_parameters())
        self._params = params  # every parameter (the replica check covers frozen ones too)
        self._param_names = [names.get(id(p), "") for p in params]
        # Which ranks share a machine (None: unknown, flat). With N > 1 machines of R > 1 ranks and
        # ``node_groups`` (intra, intra_gather, cross) the buckets take the hierarchical all-reduce.
        self.topology = topology
        self._node_groups = node_groups or ()
        self._own_node_groups = False  # register_hook made them: close() destroys them
        # the hierarchical path on CPU: a rank's failure reaches ranks of other groups through the
        # job's store (:meth:`use_channel`); None: a dead peer is noticed by the group it shares
        self._channel = None
        if node_groups:
            from fastml_strategy.comm.hierarchical import HierarchicalAllReduce

            self._engine = HierarchicalAllReduce(plan, process_group, rank, world_size, topology,
                                                 *node_groups)
        else:
            self._engine = CompressedAllReduce(plan, process_group, rank, world_size)
        # the shapes the low-rank codec views each layer by (the engine's buckets are flat)
        self._engine.shapes = {names[id(p)]: tuple(p.shape) for p in params if id(p) in names}
        self._commit = StepCommit(self._engine)
        self._runner: Optional[_CommRunner] = _CommRunner(rank, self._process, self._explain)
        self._runner.hold_tails = bool(node_groups)
        # A plan that compresses no parameter (every layer `none`) is DDP's own all-reduce: the hook
        # issues it itself, as torch's allreduce_hook does (no thread hand-off, no step checks), and
        # the communication thread stays idle. Every parameter counts, frozen ones too: one unfrozen
        # later must not bring a compressed bucket to this path.
        # The hierarchical path takes every plan, `none` too: it keeps the machines' link for 1/R of it.
        self._direct = not node_groups and plan.schedule != "halving" and all(
            not plan.for_parameter(names.get(id(p), ""), p.numel()).lossy for p in params)
        self._pending: list = []  # (bucket index, future) of this step's direct all-reduces
        self._saved: Optional[dict] = None  # an unpickled (detached) state: its state_dict()
        # -- statistics -----------------------------------------------------------------------------
        self.step = 0  # completed steps (counted at the last bucket; no_sync micro-batches call no hook)
        # Buckets and elements of the current step: few buckets mean little overlap with backward
        # (logged once, at the end of step 1, after DDP's bucket rebuild).
        self._step_buckets = 0
        self._step_numel = 0

    def use_channel(self, channel) -> None:
        """Publish this rank's failure in ``channel`` (:class:`fastml_strategy.comm._peers.FailureChannel`)
        and wait for the hierarchical path's collectives through it (see
        :meth:`~fastml_strategy.hierarchical.HierarchicalAllReduce.use_channel`)."""
        self._channel = channel
        self._engine.use_channel(channel)

    @property
    def hierarchical(self) -> bool:
        """Whether buckets take the hierarchical all-reduce (:mod:`fastml_strategy.hierarchical`)."""
        if self._engine is None:  # detached (unpickled): as saved
            return getattr(self, "_detached_R", 1) > 1
        return bool(self._node_groups)

    @property
    def ranks_per_node(self) -> int:
        """Ranks per machine this state runs with (1: flat, every rank its own machine)."""
        if self._engine is None:
            return getattr(self, "_detached_R", 1)
        return self.topology.ranks_per_node if self.topology is not None and self.hierarchical else 1

    def _split_bytes(self, sent: int, counters: Optional[dict] = None) -> tuple:
        """(bytes sent to other machines, bytes sent inside this machine); None where the flat path
        cannot tell (several machines of several ranks, flat on request: gloo picks the peers)."""
        if counters is not None and "bytes_sent_inter" in counters:
            return counters["bytes_sent_inter"], counters["bytes_sent_intra"]
        if self._engine is not None and self.hierarchical:
            return self._engine.bytes_sent_inter, self._engine.bytes_sent_intra
        topo = self.topology
        if topo is None or topo.ranks_per_node == 1:
            return sent, 0
        if topo.nodes == 1:
            return 0, sent
        return None, None

    @property
    def nonfinite_steps(self) -> int:
        """Steps whose result held NaN/inf (residuals left unchanged): see :class:`StepCommit`."""
        return self._commit.nonfinite_steps

    @nonfinite_steps.setter
    def nonfinite_steps(self, value: int) -> None:
        self._commit.nonfinite_steps = value

    @property
    def _failure(self) -> Optional[BaseException]:
        """The error every further bucket fails with: the runner's first error, or for a detached
        (unpickled) state the reason it cannot run."""
        if self._runner is None:
            return RuntimeError(
                "FastML: this FastMLState was unpickled, so it has no process group or communication "
                "thread (pickling keeps only the plan, the settings and state_dict()); register the hook "
                "again (new = fastml_strategy.register_hook(ddp_model, plan=state.plan)) and "
                "new.load_state_dict(state.state_dict())")
        return self._runner.failure

    @property
    def failure(self) -> Optional[BaseException]:
        """The first error of the communication thread, which every later bucket raises (None: none;
        a detached state has none either: it never ran)."""
        return None if self._runner is None else self._runner.failure

    def _submit(self, job: _Job) -> None:
        if self._runner is None:
            raise self._failure
        self._runner.submit(job)

    # -- the work of one bucket (on the runner's thread) ----------------------------------------------
    def _explain(self, e: BaseException, index: int) -> BaseException:
        if self._channel is not None:  # ranks of other groups stop waiting for this one
            self._channel.publish(f"{type(e).__name__}: {e}")
        if isinstance(e, (CompressionError, ReplicaDriftError, ValueError)):
            return e
        err = CompressionError(
            f"FastML: the {'' if self._direct else 'compressed '}all-reduce of bucket {index} at step "
            f"{self.step} failed on rank {self.rank} ({type(e).__name__}: {e}). If another rank died or "
            f"timed out, its log "
            f"has the cause; restart from the last checkpoint (torchrun --max-restarts does this)."
        )
        err.__cause__ = e
        return err

    def _process(self, job: _Job, before=None):
        every = self.layer_stats_every
        tail = self._commit.run_bucket(job, self.step, layer_stats=every > 0 and self.step % every == 0,
                                       before=before)
        self._count_bucket(job.buffer, job.sparse)
        if not job.is_last:
            return tail  # the runner runs it once the next bucket is on the wire
        if tail is not None:
            tail()
        # the step's one host read; an error of any rank in any bucket raises here, on every rank
        self._commit.end_step(job.buffer.device)
        self._end_step(job.buffer)
        return None

    def _count_bucket(self, buf: torch.Tensor, sparse: bool) -> None:
        self._step_buckets += 1
        self._step_numel += buf.numel() if not sparse else 0

    def _end_step(self, buf: torch.Tensor) -> None:
        if self.step == 1:
            self._advise_buckets(self._step_buckets, self._step_numel, buf.element_size())
        self._step_buckets = self._step_numel = 0
        self.step += 1
        n = self.check_replicas_every
        if n and self.step % n == 0:
            self._check_replicas()

    def _direct_all_reduce(self, job: _Job) -> torch.futures.Future:
        """The bucket of a plan with nothing to compress: what torch's ``allreduce_hook`` does (divide,
        then one asynchronous all-reduce, issued here in the autograd thread in bucket order), so a
        ``none`` plan costs what DDP's own all-reduce costs. At the step's last bucket the hook waits
        for the step's all-reduces (DDP waits for them right after anyway) so that a failure raises
        :class:`CompressionError` on this rank, with the advice, rather than DDP's cast error."""
        buf, W = job.buffer, self.world_size
        if not job.sparse:  # the layout only names the bucket's layers for stats(); it holds no buffer
            lay = self._engine.layout_for(job.names, job.offsets, job.numels, buf.device, buf.dtype)
            self._engine.count_plain(lay.total_numel, buf, buf.element_size())
        else:
            self._engine.count_sparse(buf)
        self._count_bucket(buf, job.sparse)
        if W > 1:
            buf.div_(W)
            work = dist.all_reduce(buf, group=self.process_group, async_op=True).get_future()
            fut = work.then(lambda f: f.value()[0])
        else:
            work = fut = torch.futures.Future(devices=[buf.device] if buf.is_cuda else None)
            fut.set_result(buf)
        # the all-reduce's own future: waited on, it raises gloo's or NCCL's error itself (the
        # continuation would wrap it in "Got the following error when running the callback")
        self._pending.append((job.index, work))
        if job.is_last:
            pending, self._pending = self._pending, []
            for index, f in pending:
                try:
                    f.wait()
                except Exception as e:  # noqa: BLE001 - the peer died, the group timed out
                    err = self._explain(e, index)
                    if self._runner is not None and self._runner.failure is None:
                        self._runner.failure = err
                    raise err from e
            self._end_step(buf)
        return fut

    def _advise_buckets(self, buckets: int, numel: int, elem_size: int) -> None:
        nbytes = numel * elem_size
        if self.rank != 0 or buckets >= 3 or nbytes < _ADVISE_BUCKETS_BYTES:
            return
        cap = _cap_mb(nbytes, _SUGGESTED_BUCKETS)
        advise("bucket_cap_mb",
               f"FastML: DDP hands this model's {nbytes / 1e6:.1f} MB of gradients over in "
               f"{buckets} bucket{'' if buckets == 1 else 's'}, so communication starts only when backward "
               f"is (nearly) done; DDP(model, bucket_cap_mb={cap:.2f}) gives about {_SUGGESTED_BUCKETS} "
               f"buckets whose all-reduce overlaps the rest of backward (HF Trainer: "
               f"TrainingArguments(ddp_bucket_cap_mb={cap:.2f}); Lightning: FastMLStrategy(bucket_cap_mb="
               f"{cap:.2f}); fastml_strategy.hook.suggest_bucket_cap_mb(model) computes it)")

    def _check_replicas(self) -> None:
        mine = torch.tensor([_checksum(self._params)], dtype=torch.int64)
        if self.world_size == 1:
            return
        dev = torch.device("cuda", torch.cuda.current_device()) if \
            dist.get_backend(self.process_group) == "nccl" else torch.device("cpu")
        out = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(self.world_size)]
        # waited for as the engine waits (the hierarchical path on CPU: through the failure channel,
        # so a rank that failed in another group stops this wait too)
        self._engine.wait(dist.all_gather(out, mine.to(dev), group=self.process_group, async_op=True))
        sums = [int(t.item()) for t in out]
        if len(set(sums)) > 1:
            raise ReplicaDriftError(
                f"FastML: model replicas differ at step {self.step} (parameter checksums by rank: "
                f"{sums}). Something outside the all-reduce changed parameters on some ranks "
                f"(different seeds or data in the optimizer, a rank-local update, a non-deterministic "
                f"op); restore from the last checkpoint and make the update identical on every rank."
            )

    # -- public -----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Cumulative figures of this rank (a detached state: the saved counters, no per-layer rows).

        ``bytes_uncompressed`` is the baseline: DDP's ring all-reduce of the same gradients over all
        W ranks, in the gradients' own dtype (an fp64 model's in fp64, a bf16 model's in bf16), so a
        ``none`` plan reports ``compression_ratio`` 1.0 for every dtype. ``bytes_sent_inter`` counts
        what this rank sent to other machines, ``bytes_sent_intra`` what it sent inside its own (their
        sum is ``bytes_sent``). The per-layer table keeps one row per layer (on the hierarchical path
        its ``bytes`` are what this rank sends across machines for its part of the layer).

        On the hierarchical path the headline ``compression_ratio`` is the cross-machine one,
        ``bytes_uncompressed_inter / bytes_sent_inter`` (``bytes_uncompressed_inter``: what this rank
        would send across machines with nothing compressed), since the slow link is what compression
        is for; the hop inside the machine has its own ``bytes_uncompressed_intra`` and
        ``compression_ratio_intra`` (1.0 unless ``Plan.intra_node`` halves it). ``bytes_uncompressed /
        bytes_sent`` then compares this rank's bytes in all with flat DDP's."""
        if self._saved is not None:
            counters = self._saved["counters"]
            sent, unc, layers = counters["bytes_sent"], int(round(counters["bytes_uncompressed"])), {}
        else:
            sent, unc = self._engine.bytes_sent, int(round(self._engine.bytes_uncompressed))
            layers = self._engine.layer_stats()
            counters = self._engine.counters() if self.hierarchical else None
        inter, intra = self._split_bytes(sent, counters)
        hier = self._hier_stats(counters) if self.hierarchical else {}
        return {
            "engine": self.kind,
            "steps": self.step,
            "world_size": self.world_size,
            "plan": self.plan.name,
            "ranks_per_node": self.ranks_per_node,
            "hierarchical": self.hierarchical,
            "bytes_sent": int(sent),
            # to other machines / inside this one (None: flat with several ranks per machine)
            "bytes_sent_inter": None if inter is None else int(inter),
            "bytes_sent_intra": None if intra is None else int(intra),
            "bytes_uncompressed": unc,
            "compression_ratio": (unc / sent) if sent > 0 else 1.0,
            **hier,  # the hierarchical path: the cross-machine ratio as the headline, the intra figures
            "nonfinite_steps": self.nonfinite_steps,
            # buckets and pieces each schedule ran ("plain", "ring", "halving"; Plan.schedule)
            "schedules": {} if self._saved is not None else self._engine.schedule_counts(),
            "layers": layers,
        }

    @staticmethod
    def _hier_stats(counters: Optional[dict]) -> dict:
        """The hierarchical path's figures from its counters (:meth:`HierarchicalAllReduce.counters`;
        a state saved before they were counted has none: the headline is then unc / sent)."""
        if not counters or "bytes_uncompressed_inter" not in counters:
            return {}
        inter, intra = counters["bytes_sent_inter"], counters["bytes_sent_intra"]
        unc_inter = int(round(counters["bytes_uncompressed_inter"]))
        unc_intra = int(round(counters["bytes_uncompressed_intra"]))
        return {"bytes_uncompressed_inter": unc_inter, "bytes_uncompressed_intra": unc_intra,
                "compression_ratio": unc_inter / inter if inter > 0 else 1.0,
                "compression_ratio_intra": unc_intra / intra if intra > 0 else 1.0}

    def state_dict(self, all_ranks: bool = False) -> dict:
        """This rank's state; with ``all_ranks=True`` (a collective: call on every rank between steps)
        every rank's, as ``{"per_rank": [...]}``, for checkpoints that only rank 0 writes."""
        if self._saved is not None:
            if all_ranks:
                raise self._failure
            return {**self._saved, "residuals": {k: v.clone() for k, v in self._saved["residuals"].items()}}
        own = {
            "format_version": STATE_FORMAT_VERSION,
            "plan": self.plan.to_dict(),
            "step": self.step,
            "rank": self.rank,
            "world_size": self.world_size,
            "ranks_per_node": self.ranks_per_node,  # residuals are parts of parameters when > 1
            "counters": (self._engine.counters() if self.hierarchical else
                         {"bytes_sent": self._engine.bytes_sent,
                          "bytes_uncompressed": self._engine.bytes_uncompressed}),
            "residuals": {k: v.detach().cpu().clone() for k, v in self._engine.residuals().items()},
        }
        q = self._engine.lowrank_state()
        if q:  # only with a low-rank layer: other plans' states are what they were
            own["lowrank_q"] = {k: v.detach().cpu().clone() for k, v in q.items()}
        if not all_ranks:
            return own
        return gather_states(own, self.process_group, self.world_size)

    def load_state_dict(self, sd: dict, strict: bool = True) -> None:
        """Load what :meth:`state_dict` returned (this rank's, or every rank's with ``all_ranks=True``).

        The saved state must come from the same rank of the same world size and, with ``strict``
        (the default), the same plan, and its residuals must fit this model's parameters; otherwise
        ValueError names the mismatch before anything is loaded. ``strict=False`` loads under another
        plan: residuals are taken for the layers both plans give one of the same size, the rest start
        from zero (with a warning naming them)."""
        if self._saved is not None:
            raise self._failure
        sd = own_rank_state(sd, self.rank, self.world_size, STATE_FORMAT_VERSION, "FastMLState")
        check_state_kind(sd, None, "FastMLState")
        check_saved_state(sd, self.rank, self.world_size, self.plan, strict, "FastMLState")
        sizes = {n: p.numel() for n, p in zip(self._param_names, self._params)}
        saved_R, R = int(sd.get("ranks_per_node", 1)), self.ranks_per_node
        saved_residuals = sd.get("residuals", {})
        if saved_R != R:
            # A residual is the part of a parameter this rank reduced across machines: other ranks per
            # machine cut other parts (and add other machines' errors), so it cannot be re-sharded.
            what = (f"the state was saved with {saved_R} rank(s) per machine "
                    f"({'hierarchical' if saved_R > 1 else 'flat'} all-reduce), this run has {R}")
            if strict and any(t.numel() for t in saved_residuals.values()):
                raise ValueError(
                    f"FastMLState.load_state_dict: {what}; error-feedback residuals are per part of "
                    f"each parameter and do not carry over. Resume with ranks_per_node={saved_R} "
                    f"(register_hook(..., ranks_per_node={saved_R}) or FASTML_RANKS_PER_NODE={saved_R}), "
                    f"or load_state_dict(..., strict=False) to start the residuals from zero")
            warnings.warn(f"FastML: {what}; the residuals start from zero", stacklevel=2)
            saved_residuals = {}
        if self.hierarchical:
            sizes = self._engine.part_sizes(sizes)
        residuals = fitting_residuals(saved_residuals, sizes, strict, "FastMLState")
        self.step = int(sd["step"])
        self._engine.load_counters(sd.get("counters", {}))
        self._engine.load_residuals(residuals)
        self._engine.load_lowrank_state(sd.get("lowrank_q", {}))

    def close(self) -> None:
        """Stop the communication thread and destroy FastML's own process group (not one the caller
        passed); the hook then fails any further bucket. Call on every rank."""
        if self._runner is not None:
            self._runner.close()
        if self._own_node_groups:
            for g in self._node_groups:
                try:
                    dist.destroy_process_group(g)
                except Exception as e:  # noqa: BLE001 - already gone with the default group
                    log.debug("FastML: destroying a machine group: %s", e)
            self._own_node_groups = False
        if self._own_group and self.process_group is not None:
            try:
                dist.destroy_process_group(self.process_group)
            except Exception as e:  # noqa: BLE001 - already gone with the default group
                log.debug("FastML: destroying the communication group: %s", e)
            self.process_group = None
            self._own_group = False

    def __getstate__(self) -> dict:
        # Like PowerSGDState: everything but what belongs to this process (the process group, the
        # communication thread, the engine's buffers, the parameters): see the class docstring.
        return {
            "plan": self.plan,
            "check_replicas_every": self.check_replicas_every,
            "layer_stats_every": self.layer_stats_every,
            "rank": self.rank,
            "world_size": self.world_size,
            "topology": self.topology,
            "ranks_per_node": self.ranks_per_node,
            "nonfinite_steps": self.nonfinite_steps,
            "param_names": self._param_names,
            "state_dict": self.state_dict(),
        }

    def __setstate__(self, d: dict) -> None:
        self.plan = d["plan"]
        self.check_replicas_every = d["check_replicas_every"]
        self.layer_stats_every = d["layer_stats_every"]
        self.process_group, self._own_group = None, False
        self.rank, self.world_size = d["rank"], d["world_size"]
        self.topology = d.get("topology")
        self._node_groups, self._own_node_groups = (), False
        self._detached_R = d.get("ranks_per_node", 1)
        self._names, self._params, self._param_names = {}, [], d["param_names"]
        self._engine, self._runner, self._channel = None, None, None
        self._commit = StepCommit(None)
        self._direct, self._pending = False, []
        self._saved = d["state_dict"]
        self.step = int(self._saved["step"])
        self.nonfinite_steps = d["nonfinite_steps"]
        self._step_buckets, self._step_numel = 0, 0


# Below this many bytes of gradient per step a model's communication is short anyway: no bucket advice.
_ADVISE_BUCKETS_BYTES = 8 << 20
# Four buckets: the first three overlap the rest of backward, the last one's communication is exposed.
_SUGGESTED_BUCKETS = 4


def _cap_mb(nbytes: int, buckets: int) -> float:
    # DDP's bucket_cap_mb counts MiB (bucket_bytes_cap = bucket_cap_mb * 1024 * 1024)
    return max(0.01, round(nbytes / buckets / (1 << 20), 2))


def suggest_bucket_cap_mb(module: torch.nn.Module, buckets: int = _SUGGESTED_BUCKETS) -> float:
    """A ``bucket_cap_mb`` for ``DDP(module, bucket_cap_mb=...)`` that cuts the module's trainable
    gradients into about ``buckets`` buckets, so that the communication of all but the last overlaps
    the rest of backward (DDP's default of 25 MB packs a model of up to about 6M fp32 parameters into
    one bucket, which then starts only when backward ends). A parameter larger than the cap still
    makes one bucket of its own; FastML pipelines inside every bucket anyway."""
    whole_number("buckets", buckets, 1, owner="suggest_bucket_cap_mb")
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        module = module.module
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)
    return _cap_mb(nbytes, buckets)


def _fastml_hook(state, bucket):
    # Errors are raised from the hook itself, in the autograd thread: that way loss.backward() raises
    # FastML's own exception type (CompressionError, ReplicaDriftError). A future completed with an
    # exception would reach the user only as DDP's "RuntimeError: Unable to cast ... to Tensor".
    if state._failure is not None:
        raise state._failure
    buf = bucket.buffer()
    params = bucket.parameters()
    if buf.is_sparse:  # DDP hands a sparse gradient over in a bucket of its own, with no dense views
        offsets, numels = (0,), (params[0].numel(),)
    else:
        grads = bucket.gradients()
        base = buf.storage_offset()
        offsets = tuple(g.storage_offset() - base for g in grads)
        numels = tuple(g.numel() for g in grads)
    job = _Job(
        index=bucket.index(),
        is_last=bucket.is_last(),
        buffer=buf,
        names=tuple(state._names[id(p)] for p in params),
        offsets=offsets,
        numels=numels,
        future=torch.futures.Future(devices=[buf.device] if buf.is_cuda else None),
        sparse=buf.is_sparse,
    )
    if state._direct:
        return state._direct_all_reduce(job)
    if buf.is_cuda:
        job.event = torch.cuda.Event()
        job.event.record(torch.cuda.current_stream(buf.device))
    state._submit(job)
    if job.is_last:
        # All the step's gradients are ready and DDP is about to wait for every future anyway; wait
        # here instead, so that an error of any bucket of this step is raised with its own type.
        job.done.wait()
        if state._failure is not None:
            raise state._failure
    return job.future


def _has_comm_hook(model: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether a comm hook is registered on this DDP model (DDP's private ``_comm_hooks`` list; torch
    has no public query). On a torch without it: False, with a logged warning (registering twice then
    fails inside DDP instead). tests/test_upstream_internals.py fails if torch renames it."""
    hooks = getattr(model, "_comm_hooks", None)
    if not isinstance(hooks, list):
        log.warning("FastML: DistributedDataParallel has no _comm_hooks list in torch %s (torch internals "
                    "changed): FastML cannot check that no other comm hook is registered", torch.__version__)
        return False
    return bool(hooks)


def plan_summary(plan: Plan, params: dict, world_size: int) -> str:
    """One line: the plan, how many tensors and elements each codec takes, and any top-k layer that
    falls back to its dense codec at this world size."""
    from fastml_strategy.codecs import effective_config

    counts: dict = {}
    fallbacks = []
    for name, p in params.items():
        if not p.requires_grad:
            continue
        planned = plan.for_parameter(name, p.numel())
        cfg = effective_config(planned, p.numel(), world_size, tuple(p.shape))
        if cfg is not planned and cfg != planned:
            fallbacks.append(f"{name} ({planned.describe()} -> {cfg.describe()})")
        k = cfg.describe()
        n, e = counts.get(k, (0, 0))
        counts[k] = (n + 1, e + p.numel())
    parts = ", ".join(f"{k}: {n} tensor{'' if n == 1 else 's'} / {e:,} element{'' if e == 1 else 's'}"
                      for k, (n, e) in sorted(counts.items()))
    text = f"plan {plan.name!r} on {world_size} ranks: {parts}"
    if fallbacks:
        text += f"; falls back (top-k to dense at this world size, low-rank to fp32 where it does not gain) for " \
                f"{', '.join(fallbacks)}"
    return text


def _check_register_arguments(model: Any, process_group: Any, check_replicas_every: Any,
                              layer_stats_every: Any) -> None:
    """register_hook's checks of what it was given (the same on every rank, so raised locally)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"register_hook: model is a {type(model).__name__}, not a DistributedDataParallel; wrap it "
            f"first (model = torch.nn.parallel.DistributedDataParallel(model)) and pass the wrapper"
        )
    if _has_comm_hook(model):
        raise ValueError(
            "register_hook: this DistributedDataParallel model already has a comm hook (register_hook "
            "was called on it before, or another hook was registered); register FastML once per DDP "
            "model and keep the state it returned"
        )
    for argname, val in (("check_replicas_every", check_replicas_every),
                         ("layer_stats_every", layer_stats_every)):
        whole_number(argname, val, 0, owner="register_hook", note=" (0 turns it off)")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("register_hook: torch.distributed is not initialised; call "
                           "dist.init_process_group (torchrun sets the environment) before DDP")
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"register_hook: process_group is a {type(process_group).__name__}; pass a "
                        f"torch.distributed ProcessGroup (from dist.new_group) or None for all ranks")


def _warn_sparse(module: torch.nn.Module, plan: Plan) -> None:
    """Warn (in the caller's name) when the plan compresses a sparse embedding's gradient: it travels
    uncompressed."""
    sparse = [f"{prefix}{'.' if prefix else ''}weight" for prefix, m in module.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    lossy = [n for n in sparse if plan.for_parameter(n).lossy]
    if lossy:
        warnings.warn(f"FastML: {lossy} produce sparse gradients, which travel uncompressed (an exact sparse "
                      f"all-reduce, as DDP does it), whatever the plan says; use sparse=False to compress "
                      f"them", stacklevel=3)


def register_hook(
    model: torch.nn.parallel.DistributedDataParallel,
    plan: Any = None,
    *,
    process_group: Any = None,
    check_replicas_every: int = 0,
    layer_stats_every: int = LAYER_STATS_EVERY,
    ranks_per_node: Optional[int] = None,
) -> FastMLState:
    """Register FastML's compressed all-reduce on a DDP model and return its state.

    Call on every rank, after wrapping in DDP and before the first backward. ``plan`` is a
    :class:`Plan`, a recipe name (``"int4"``...), the path of a plan JSON, a dict, or None (the
    environment variable ``FASTML_PLAN``, else ``int4``). The plan is checked against the model's
    parameter names and across ranks before any step: every rank raises the same ValueError if it is
    invalid on any of them or if ranks hold different plans.

    ``process_group``: the group to all-reduce over; default a new group of all ranks (collective:
    every process must call ``register_hook``). ``check_replicas_every``: compare a checksum of the
    parameters across ranks every N steps (0: never). ``layer_stats_every``: measure per-layer
    compression error every N steps (0: never).

    ``ranks_per_node``: how many ranks share a machine. None detects it (``FASTML_RANKS_PER_NODE``,
    then torchrun's ``LOCAL_WORLD_SIZE``, Open MPI's, Slurm's: :mod:`fastml_strategy.topology`); with
    more than one machine of more than one rank, buckets take the hierarchical all-reduce
    (:mod:`fastml_strategy.hierarchical`: reduce-scatter inside the machine, compressed all-reduce of
    each 1/R shard across machines, all-gather inside). 1 keeps the flat all-reduce. Every rank raises
    the same ValueError, before any step, if ranks disagree or R does not divide the world size.

    Communication overlaps backward bucket by bucket: wrap small models with a smaller cap,
    ``DDP(model, bucket_cap_mb=suggest_bucket_cap_mb(model))``, so that they have several buckets.
    """
    _check_register_arguments(model, process_group, check_replicas_every, layer_stats_every)
    own_group = process_group is None
    if own_group:
        # A dedicated group (a collective call on every rank): nothing else issues collectives on it.
        # It keeps the default group's timeout: dist.new_group would otherwise give it torch's default
        # (30 minutes), and a dead peer would stall the others that long whatever the user set.
        timeout = default_group_timeout()
        process_group = dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout)
        log.info("FastML: communication group of %d ranks, timeout %s", dist.get_world_size(),
                 timeout if timeout is not None else "torch's default")
    rank = dist.get_rank(process_group)
    world_size = dist.get_world_size(process_group)

    module = model.module
    trainable, aliases, frozen = model_names(module)
    names = {id(p): n for n, p in module.named_parameters()}

    plan_obj = agreed_plan(plan, trainable, process_group, world_size, aliases=aliases, frozen=frozen)
    topo, groups = agreed_machines(process_group, rank, world_size, ranks_per_node)
    if groups:  # agreed: every rank raises alike
        from fastml_strategy.comm._lowrank import refuse_lowrank

        refuse_lowrank(plan_obj, "register_hook", "the hierarchical all-reduce of several machines of several "
                       "ranks carries flat parts of each parameter across machines, not its matrix")
    _warn_sparse(module, plan_obj)
    state = FastMLState(plan_obj, process_group, rank, world_size, names, list(module.parameters()),
                        check_replicas_every=check_replicas_every, layer_stats_every=layer_stats_every,
                        topology=topo, node_groups=groups)
    state._own_group = own_group
    state._own_node_groups = bool(groups)
    # CPU (gloo) only: NCCL's wait does not block the host. (A collective: rank 0 draws the key.)
    # Also on the flat path when the plan may run recursive halving (point-to-point rounds: a dead
    # rank's partners notice, the others hear of it here; fastml_strategy.comm._halving).
    if (groups or may_halve(plan_obj, world_size)) and not any(p.is_cuda for p in module.parameters()):
        state.use_channel(FailureChannel(process_group, rank))
    if rank == 0:
        _summarise(model, plan_obj, world_size)
    model.register_comm_hook(state, _fastml_hook)
    return state


def _summarise(model: torch.nn.parallel.DistributedDataParallel, plan: Plan, world_size: int) -> None:
    """Rank 0 at registration: the plan summary (INFO) and the advice (:func:`advise`)."""
    params = dict(model.module.named_parameters())
    log.info("FastML: %s", plan_summary(plan, params, world_size))
    little = little_compressed(plan, params.items(), world_size, owner="FastML")
    if little is not None:
        advise("min_numel", little, stacklevel=3)
    if not getattr(model, "gradient_as_bucket_view", True):
        advise("gradient_as_bucket_view",
               "FastML: DDP(model, gradient_as_bucket_view=True) saves DDP's two copies of every gradient "
               "per step (into its bucket during backward, back into .grad after the all-reduce); "
               "measured 8% off an int4 step of the README MLP on CPU (benchmarks/RESULTS.md)", stacklevel=3)
