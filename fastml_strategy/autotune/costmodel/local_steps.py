"""Local steps (:func:`local_step_time`, :func:`evaluate_local`; :class:`~fastml_strategy.LocalSGD`):
no per-step all-reduce; every H inner steps the pseudo-gradient of the whole model is all-reduced with
the same compressed scatter-reduce-allgather, in F fragments synchronised at staggered steps, each
fragment's outer update applied ``d`` inner steps after its all-reduce started (``delay``).

- Per inner step, compute ``c`` is the profile's forward + backward + optimizer time, scaled as in 1.
- Fragments are LocalSGD's own (:func:`fastml_strategy.wire.split_fragments`: consecutive
  parameters of about equal size). One synchronisation of fragment f:
  ``wire_f = (2 P_f + 1)(N-1) a + bytes_f / B``, where ``bytes_f`` and the pieces ``P_f`` are those
  of the fragment's compressed all-reduce, priced as one DDP bucket
  (:func:`fastml_strategy.wire.bucket_wire`: the runtime's pieces and headers); rounds: each
  piece's all_to_all and all_gather, then the status exchange. Codec time ``T_codec / F``.
- It runs on LocalSGD's communication thread while the next ``d`` inner steps compute; the step that
  applies it waits for what is left: ``max(0, wire_f - d c)``. Fragments are ``H / F`` steps apart and
  ``d < H / F``, so one fragment's wait never overlaps another's.
- Over a period of H inner steps: ``H c + T_codec + sum_f max(0, wire_f - d c)``; the step time is that
  over H. Whole-model sync (``F = 1, d = 0``): ``c + (wire + T_codec) / H``; streaming with a
  delay long enough to hide each fragment: ``c + T_codec / H`` (``max(H c, wire) / H`` when
  ``d = H / F``: the wire hidden behind H inner steps). Bytes per inner step: ``bytes / H``.
- Steps to the target: ``S_ref x s(H) x g(e(p)) / g(e_cal) x H / (H - d)``. ``s(H)`` is the stretch
  the calibration measured for H (local steps with the calibrated outer plan against per-step
  synchronisation at the same world size, >= 1); ``g(e(p)) / g(e_cal)`` charges a plan lossier than
  the calibrated one (uniform int4) as per-step compression would be charged; ``H / (H - d)``:
  with ``mix=1`` a fragment's local progress during its delay is dropped (a model, not measured).
  The delay is not searched: for each (plan, H, F) the ``d`` in ``[0, H // F)`` with the lowest
  time to accuracy is taken.
"""

from __future__ import annotations

import math
from typing import Mapping

from fastml_strategy.autotune.catalog import HardwareOption
from fastml_strategy.autotune.costmodel.base import (Convergence, LocalCalibration, Profile, StepBreakdown,
                                                     plan_error)
from fastml_strategy.autotune.costmodel.ddp import _layer_cost, bucket_wire_of
from fastml_strategy.autotune.costmodel.evaluate import Trial
from fastml_strategy.wire import split_fragments


def local_step_time(profile: Profile, choice: Mapping[str, str], option: HardwareOption, every: int,
                    fragments: int = 1, delay: int = 0, nodes: int | None = None) -> StepBreakdown:
    """Predicted time per inner step of LocalSGD (``every`` = H, ``fragments`` = F, ``delay`` = d) with
    the plan ``choice`` compressing the pseudo-gradients; the model is in the module docstring.
    ``wire_s`` and ``codec_s`` are per inner step (a sync's over H); ``exposed_s`` is the wire time
    not hidden under the delay, per inner step; ``bytes_per_rank`` per inner step."""
    n = option.nodes if nodes is None else nodes
    ranks = n * option.accelerators_per_node
    f = option.compute_speed
    c = profile.compute_s * profile.world_size / (ranks * f)
    layers = sorted(profile.layers, key=lambda lp: lp.index)
    codec = sum(_layer_cost(profile, lp, choice, n, f)[1] for lp in layers)
    link = option.link
    F = max(1, fragments)
    nbytes, wires = 0, []
    for run in split_fragments([lp.numel for lp in layers], F):
        if n <= 1:
            wires.append(0.0)
            continue
        wire = bucket_wire_of([layers[i] for i in run], choice, n)
        b = wire.bytes_sent()
        nbytes += b
        # the all_to_all and all_gather of each piece, then the status exchange
        rounds = (1 if wire.uncompressed else 2 * len(wire.pieces)) + 1
        wires.append(rounds * (n - 1) * link.latency_s + b / link.bandwidth_Bps)
    waited = sum(max(0.0, w - delay * c) for w in wires)
    period = every * c + codec + waited
    return StepBreakdown(c, codec / every, sum(wires) / every, waited / every, period / every,
                         int(round(nbytes / every)))


def evaluate_local(profile: Profile, choice: Mapping[str, str], option: HardwareOption,
                   conv: Convergence, local: LocalCalibration, target_steps: float, every: int,
                   fragments: int = 1) -> Trial:
    """The numbers of one (plan, H, F, option) with local steps, as :func:`evaluate` gives them for
    per-step compression, plus ``every``, ``fragments``, the chosen ``delay``, ``stretch`` and the
    bytes of one whole-model synchronisation. The delay is the one in ``[0, H // F)`` with the lowest
    time to accuracy (``H / (H - d)`` more steps against less waiting). Infeasible when the
    calibration of H lost more accuracy than allowed, when H was not calibrated, or when the plan's
    error is above both the per-step limit and the calibrated outer plan's."""
    e = plan_error(profile, choice)
    stretch = local.stretch.get(every, math.inf)
    g_rel = conv.g(e) / conv.g(local.e_cal) if conv.g(local.e_cal) > 0 else 1.0
    best: tuple[float, int, StepBreakdown] | None = None
    for d in range(max(1, every // fragments) if fragments > 0 else 1):
        br = local_step_time(profile, choice, option, every, fragments, d)
        steps = target_steps * stretch * g_rel * every / (every - d)
        tta = steps * br.step_s
        if best is None or tta < best[0] - 1e-15:
            best = (tta, d, br)
        if br.exposed_s == 0.0:  # the wait is hidden: a longer delay only drops more progress
            break
    tta, d, br = best
    steps = target_steps * stretch * g_rel * every / (every - d)
    feasible = (local.feasible(every) and fragments <= len(profile.layers)
                and e <= max(conv.e_max, local.e_cal) + 1e-12)
    return Trial.predicted(error=e, feasible=feasible, g=steps / target_steps if target_steps > 0 else math.nan,
                           steps=steps, br=br, tta_s=tta, option=option, every=every, fragments=fragments,
                           delay=d, stretch=stretch, sync_bytes=br.bytes_per_rank * every)
