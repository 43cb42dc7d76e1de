"""The low-rank codec's all-reduce (PowerSGD, Vogels et al. 2019): each gradient matrix travels as two
thin factors, all low-rank layers of a bucket in one round per factor.

Algorithm (per DDP bucket, on every rank; W ranks; the bucket's low-rank layers, each viewed as an
m x n matrix as torch's PowerSGD hook views it: m = shape[0], n = the product of the rest)
----------------------------------------------------------------------------------------------------
0. Warm-up: at the first ``start`` steps (``LowRankConfig.start``, 2 by default, torch's
   ``start_powerSGD_iter``) the section's gradients travel whole, as int8 through the compressed
   all-reduce without error feedback, and steps 1-6 do not run: Adam-type optimisers start their
   second-moment estimate from the first gradients, and from a rank-r one training stalls.
1. Error feedback: ``M = grad + residual`` (fp32).
2. ``P = M orth(Q)`` (m x r), with ``Q`` (n x r) warm-started: last step's all-reduced ``Q`` of this
   layer, or, at its first step, standard normal numbers from a generator seeded by the plan's seed
   and the layer's name, identical on every rank and independent of the bucket the layer is in.
   Orthonormalising ``Q`` first (as torch's hook does) keeps ``P`` at the gradient's scale, so that
   fp16 factors do not overflow.
3. All-reduce every layer's ``P`` in one collective (the sum; its scale does not matter, step 4
   normalises it).
4. Orthogonalise each ``P`` (Gram-Schmidt in fp32, two passes, :func:`orthogonalise_`). Every rank computes on
   the same summed bytes with the same operations, so every rank gets the same bits.
5. ``Q = M^T P`` (n x r); all-reduce every layer's ``Q`` in one collective and divide by W (or the
   caller's divisor): the mean of ``M^T P`` over ranks.
6. ``M_hat = P Q^T`` replaces the gradient on every rank (the same bytes everywhere), and the new
   residual is ``M - M_hat``; it and the new warm start ``Q`` are committed only when the step is
   finite (:meth:`LowRankSection.commit`), so a step that GradScaler skips leaves both untouched.

So a layer sends ``(m + n) r`` numbers instead of ``m n`` (each all-reduce costs a ring's
2(W-1)/W of it), in two latency rounds per bucket rather than two per layer, as torch's hook batches
them. ``Plan`` layer settings: ``{"codec": "lowrank", "rank": 4}``; ``"factors"`` (``fp32`` default,
``fp16``, ``bf16``, ``int8``) sends the factors through FastML's compressed all-reduce
(:class:`~fastml_strategy.collective.CompressedAllReduce`, one all_to_all and one all_gather per
round) instead of a plain fp32 all-reduce; their rounding lands in ``M_hat``, which error feedback
corrects. A layer that would not gain (a 1-D tensor, ``(m + n) r >= m n``, or under ``min_numel``)
travels uncompressed with the bucket's other small tensors
(:meth:`fastml_strategy.codecs.LowRankCodec.effective`).

How it differs from torch's hook: the factors of a bucket are all-reduced on FastML's communication
thread in bucket order (torch's issues them from future callbacks and aborts on gloo with two
buckets); every layer's state (``Q``, residual) is keyed by its name, not by the bucket index, so it
survives DDP's bucket rebuild and checkpoints (``FastMLState.state_dict()``); a NaN/inf step commits
nothing; Gram-Schmidt is used at every rank (torch switches to QR above rank 2: the same
orthonormal basis up to signs, which cancel in ``P Q^T``).

Faults: a rank whose compute raises still issues every collective (with whatever its buffers hold)
and records the error in the step's checks (:class:`~fastml_strategy.comm._status.StepChecks`); the
bucket's message headers, which follow, carry it to every rank, and every rank raises the same
:class:`~fastml_strategy.collective.CompressionError` at the end of the step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fastml_strategy.comm._status import all_finite
from fastml_strategy.codecs import codec_for
from fastml_strategy.codecs.lowrank import initial_q, low_rank_roundtrip, matrix_shape, orthogonalise_
from fastml_strategy.config import CodecConfig, Plan

__all__ = ["matrix_shape", "orthogonalise_", "initial_q", "LowRankSection", "low_rank_roundtrip", "refuse_lowrank"]


def refuse_lowrank(plan: Plan, where: str, why: str) -> None:
    """Raise ValueError, naming the plan's low-rank settings, where the low-rank codec does not run
    (``where``: the caller, ``why``: the reason). Called after the ranks agreed on the plan, so every
    rank raises it alike, before any step."""
    keys = [k for k, cfg in (("default", plan.default), *plan.layers) if cfg.wire.lowrank]
    if keys:
        raise ValueError(
            f"{where}: plan {plan.name!r} names the low-rank codec (PowerSGD) for {keys}, which runs in the "
            f"DDP hook only ({why}); give these layers another codec (e.g. 'int4'), or train with "
            f"DDP and fastml_strategy.register_hook(model, plan) (one rank per machine, or "
            f"ranks_per_node=1)")


@dataclass
class _LowRankParam:
    """One low-rank layer of a bucket: where it lies in the bucket buffer and in the factor vectors,
    and its error-feedback residual (two buffers: the new one is committed with the step)."""

    name: str
    boff: int
    numel: int
    m: int
    n: int
    rank: int
    cfg: CodecConfig
    poff: int = 0
    qoff: int = 0
    res_cur: torch.Tensor | None = None
    res_next: torch.Tensor | None = None

    @property
    def ef(self) -> bool:
        return self.cfg.uses_residual


@dataclass
class LowRankSection:
    """The low-rank layers of one bucket that share a factor codec: one P round and one Q round.

    ``factor_cfg``: None for a plain fp32 all-reduce, else the codec the factors travel in through
    the compressed all-reduce (a layout of one tensor, built here, with no error feedback).
    ``layout_type``: the class of that layout (the bucket layout that holds this section gives its
    own, :class:`fastml_strategy.comm._layouts.BucketLayout`, so this module need not import it)."""

    params: list[_LowRankParam]
    factor_cfg: CodecConfig | None
    device: torch.device
    world_size: int
    rank: int
    layout_type: type | None = None
    start: int = 0  # the steps before the approximation starts (LowRankConfig.start): int8 until then
    p_numel: int = 0
    q_numel: int = 0
    p_flat: torch.Tensor | None = None
    q_flat: torch.Tensor | None = None
    mats: dict = field(default_factory=dict)  # name -> fp32 M (staging, when the buffer is not fp32)
    pending_q: dict = field(default_factory=dict)  # name -> the Q to commit with the step
    _sub: dict = field(default_factory=dict)  # "P"/"Q" -> the factor layout (compressed factors)

    def __post_init__(self) -> None:
        for p in self.params:
            p.poff, p.qoff = self.p_numel, self.q_numel
            self.p_numel += p.m * p.rank
            self.q_numel += p.n * p.rank
            if p.ef:
                dt = p.cfg.residual_torch_dtype
                p.res_cur = torch.zeros(p.numel, dtype=dt, device=self.device)
                p.res_next = torch.zeros(p.numel, dtype=dt, device=self.device)
        self.p_flat = torch.zeros(self.p_numel, dtype=torch.float32, device=self.device)
        self.q_flat = torch.zeros(self.q_numel, dtype=torch.float32, device=self.device)

    # -- the wire ---------------------------------------------------------------------------------------
    def factor_layout(self, which: str):
        """The layout of the P or Q vector through the compressed all-reduce (compressed factors)."""
        return self._flat_layout(which, self.p_numel if which == "P" else self.q_numel, self.factor_cfg)

    def _flat_layout(self, which: str, numel: int, cfg: CodecConfig):
        """The layout of one flat vector of ``numel`` elements in ``cfg`` through the compressed
        all-reduce: a factor (``"P"``, ``"Q"``) or the warm-up's gradients (``"start"``)."""
        lay = self._sub.get(which)
        if lay is None:
            plan = Plan(default=cfg, min_numel=0, name=f"lowrank-{which}")
            lay = self._sub[which] = self.layout_type((f"lowrank.{which}",), (0,), (numel,), plan, self.world_size,
                                                      self.rank, self.device, double_buffer=False)
        return lay

    def _all_reduce(self, eng, flat: torch.Tensor, which: str, step: int, checks, divisor: float, before):
        """One factor round: the sum over ranks divided by ``divisor``, the same bytes on every rank."""
        if self.factor_cfg is None:
            work = dist.all_reduce(flat, group=eng.group, async_op=True)
            eng.bytes_sent += int(round(2.0 * (eng.world_size - 1) / eng.world_size * flat.numel() * 4))
            if before is not None:
                before()
            eng.wait(work)
            if divisor != 1:
                flat.div_(divisor)
            return
        # through the compressed all-reduce: its headers carry this rank's error (checks.error)
        lay = self.factor_layout(which)
        baseline = eng.bytes_uncompressed
        tail = eng.start(lay, flat, step, False, checks, before=before, divisor=divisor)
        if tail is not None:
            tail()
        eng.bytes_uncompressed = baseline  # the bucket's baseline counts the gradient, not its factors

    # -- the work ------------------------------------------------------------------------------------------
    def _matrix(self, p: _LowRankParam, buf: torch.Tensor) -> torch.Tensor:
        """M = grad + residual (fp32, m x n): in the bucket buffer itself when that is fp32."""
        g = buf[p.boff: p.boff + p.numel]
        if buf.dtype == torch.float32:
            M = g
        else:
            M = self.mats.get(p.name)
            if M is None:
                M = self.mats[p.name] = torch.empty(p.numel, dtype=torch.float32, device=buf.device)
            M.copy_(g)
        if p.ef:
            M.add_(p.res_cur)
        return M.view(p.m, p.n)

    def run(self, eng, buf: torch.Tensor, step: int, checks, q_store: dict, seed: int,
            divisor: float | None = None, before=None, layer_stats: bool = False) -> None:
        """The two rounds of this section on ``buf`` (the bucket): afterwards every low-rank layer of
        ``buf`` holds ``P Q^T``, the same bytes on every rank. Nothing is read on the host; an error of
        this rank goes to ``checks.error`` and every collective is still issued."""
        W = self.world_size
        div = W if divisor is None else divisor
        mats: dict[str, torch.Tensor] = {}
        self.pending_q = {}
        if step < self.start:
            self._warm_up(eng, buf, step, checks, div, before)  # no layer error: no approximation yet
            return
        self._sub.pop("start", None)  # the warm-up's layout is not needed again
        if checks.error is None:
            try:
                for p in self.params:
                    q = q_store.get(p.name)
                    if q is None or q.numel() != p.n * p.rank:
                        q = q_store[p.name] = initial_q(p.name, p.n, p.rank, seed, buf.device)
                    elif q.device != buf.device:  # loaded from a checkpoint
                        q = q_store[p.name] = q.to(buf.device)
                    M = mats[p.name] = self._matrix(p, buf)
                    q = orthogonalise_(q.view(p.n, p.rank).clone())
                    torch.mm(M, q, out=self.p_flat[p.poff: p.poff + p.m * p.rank].view(p.m, p.rank))
            except Exception as e:  # noqa: BLE001 - carried by the headers that follow
                checks.error = e
        self._all_reduce(eng, self.p_flat, "P", step, checks, 1, before)
        if checks.error is None:
            try:
                for p in self.params:
                    P = orthogonalise_(self.p_flat[p.poff: p.poff + p.m * p.rank].view(p.m, p.rank))
                    torch.mm(mats[p.name].t(), P, out=self.q_flat[p.qoff: p.qoff + p.n * p.rank].view(p.n, p.rank))
            except Exception as e:  # noqa: BLE001
                checks.error = e
        self._all_reduce(eng, self.q_flat, "Q", step, checks, div, None)
        checks.add_finite(all_finite(self.p_flat) & all_finite(self.q_flat))
        if checks.error is None:
            try:
                self._decode(eng, buf, mats, layer_stats)
            except Exception as e:  # noqa: BLE001
                checks.error = e

    def _warm_up(self, eng, buf: torch.Tensor, step: int, checks, divisor: float, before) -> None:
        """A step before ``start``: the section's gradients (with any residual, zero unless loaded)
        travel whole as int8 through the compressed all-reduce (:data:`~fastml_strategy.codecs.lowrank.START_CODEC`,
        no error feedback), their mean written back into ``buf``, the same bytes on every rank; the
        residuals become zero and no warm start ``Q`` is drawn yet. Every collective is issued whatever
        this rank's error."""
        total = sum(p.numel for p in self.params)
        flat = torch.zeros(total, dtype=torch.float32, device=self.device)
        cfg = codec_for(self.params[0].cfg).start_cfg
        if checks.error is None:
            try:
                i = 0
                for p in self.params:
                    flat[i: i + p.numel].copy_(self._matrix(p, buf).reshape(-1))
                    i += p.numel
            except Exception as e:  # noqa: BLE001 - carried by the headers that follow
                checks.error = e
        lay = self._flat_layout("start", total, cfg)
        baseline = eng.bytes_uncompressed
        tail = eng.start(lay, flat, step, False, checks, before=before, divisor=divisor)
        if tail is not None:
            tail()
        eng.bytes_uncompressed = baseline  # the bucket's baseline counts these gradients already
        checks.add_finite(all_finite(flat))
        if checks.error is not None:
            return
        try:
            i = 0
            for p in self.params:
                buf[p.boff: p.boff + p.numel].copy_(flat[i: i + p.numel])
                if p.ef:
                    p.res_next.zero_()
                i += p.numel
        except Exception as e:  # noqa: BLE001
            checks.error = e

    def _decode(self, eng, buf: torch.Tensor, mats: dict, layer_stats: bool) -> None:
        """M_hat = P Q^T into the bucket, the new residual M - M_hat, the new warm start Q (pending)."""
        for p in self.params:
            P = self.p_flat[p.poff: p.poff + p.m * p.rank].view(p.m, p.rank)
            Q = self.q_flat[p.qoff: p.qoff + p.n * p.rank].view(p.n, p.rank)
            M = mats[p.name].reshape(-1)
            out = buf[p.boff: p.boff + p.numel]
            if layer_stats:
                nrm = M.norm()
            # fp32 bucket and residual: M_hat straight into the bucket, the residual M - M_hat from a
            # copy of M taken first (M is the bucket itself); else through a product of its own
            direct = buf.dtype == torch.float32 and (not p.ef or p.res_next.dtype == torch.float32)
            if direct and p.ef and not layer_stats:
                p.res_next.copy_(M)
                torch.mm(P, Q.t(), out=out.view(p.m, p.n))
                p.res_next.sub_(out)
            else:
                hat = (P @ Q.t()).reshape(-1)  # the same bytes on every rank: what the bucket gets
                rest = M - hat
                if layer_stats:
                    eng.layer_error[p.name] = torch.where(nrm > 0, rest.norm() / nrm, torch.zeros_like(nrm))
                if p.ef:
                    p.res_next.copy_(rest)
                out.copy_(hat)
            self.pending_q[p.name] = Q.reshape(-1).clone()

    def commit(self, q_store: dict) -> None:
        """The step was finite: the new residuals and warm starts become the current ones."""
        for p in self.params:
            if p.ef:
                p.res_cur, p.res_next = p.res_next, p.res_cur
        for name, q in self.pending_q.items():
            q_store[name] = q
        self.pending_q = {}

    def residual_views(self) -> dict[str, torch.Tensor]:
        return {p.name: p.res_cur for p in self.params if p.ef}

    def residual_nbytes(self) -> int:
        return sum(2 * p.res_cur.numel() * p.res_cur.element_size() for p in self.params if p.ef)
