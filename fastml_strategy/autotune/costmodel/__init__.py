"""The cost model: what a per-layer plan costs in step time, steps, hours and dollars on a cluster.

Everything the search optimises is computed here from measured inputs (a :class:`Profile`), with no
training in the loop, so one Optuna trial costs microseconds and the search can afford thousands.

Step time of plan ``p`` on option ``c`` (``N`` nodes, link bandwidth ``B`` and latency ``a`` per node,
compute speed ``f``, ``R`` ranks)::

    T(p, c) = T_fwd' + max(T_bwd' + T_codec(p), end of communication) + T_opt'

Steps to the target: ``S(p) = S_ref * g(e(p))``, where ``e(p)`` is the plan's relative gradient error
(the gradient-energy-weighted root mean square of the per-layer relative errors, measured with error
feedback on real gradients) and ``g(e) = 1 + k e^gamma`` is fitted by the calibration (``g(0) = 1``).

Time to accuracy ``TTA = S(p) * T(p, c)``; cost ``= TTA * N * price_per_node_hour / 3600``.

The model is one package, one module per thing it models:

- :mod:`.base`: the codec candidates, the measured :class:`Profile`, :class:`Convergence` and the
  other records every model reads, and a plan's error.
- :mod:`.ddp`: DDP's buckets and the per-step compressed all-reduce (steps 1-6 above).
- :mod:`.sharded`: FSDP2 and HSDP (units, all-gathers, the reduce-scatter, memory per rank).
- :mod:`.local_steps`: LocalSGD (H inner steps, F fragments, a delay).
- :mod:`.evaluate`: one (plan, option) pair's time, steps and cost; the fits of the link and the
  codec-time scales to measurements; the Pareto front.
- :mod:`.accuracy`: the accuracy rule's statistics and the fit of ``g(e)``.

Every name is imported here too: ``costmodel.X`` is the one way to reach it.
"""

from __future__ import annotations

# every model's names, re-exported: costmodel.X is how the rest of the autotuner reaches them
from fastml_strategy.autotune.costmodel.base import (  # noqa: F401
    BASE_OPTIONS, CANDIDATES, DEFAULT_INTRA_LINK, DEFAULT_LOCAL_EVERY, DEFAULT_LOCAL_FRAGMENTS, DTYPE_BYTES,
    INTRA_NODE_BYTES, INTRA_NODE_ERROR, LOCAL_CALIBRATION_OPTION, intra_node_error, SHARDINGS, _BASE_CANDIDATES, Convergence, LayerProfile, LocalCalibration, Profile,
    Sharding, StepBreakdown, _candidate_name, _cfg, _codec_factor, default_options, family, plan_error)
from fastml_strategy.autotune.costmodel.sharded import (  # noqa: F401
    all_gather_unit_bytes, allreduce_unit_bytes, fit_collective_overhead, fsdp_state_bytes, fsdp_units, reduce_scatter_unit_bytes,
    residual_bytes, sharded_step_time)
from fastml_strategy.autotune.costmodel.ddp import (  # noqa: F401
    BUCKET_BYTES, BUCKET_MB_CHOICES, FIRST_BUCKET_BYTES, HierBucketWire, _layer_cost, bucket_wire_of, ddp_buckets,
    ddp_bytes_per_rank, ddp_node_net_bytes, ddp_topology, hier_bucket_wire, intra_node_choices, step_time)
from fastml_strategy.autotune.costmodel.evaluate import (  # noqa: F401
    TCP_FRAME_OVERHEAD, Trial, cost_usd, evaluate, fit_alpha_beta, fit_codec_scale, objective, pareto_front,
    tcp_payload_link)
from fastml_strategy.autotune.costmodel.local_steps import evaluate_local, local_step_time  # noqa: F401
from fastml_strategy.autotune.costmodel.accuracy import (  # noqa: F401
    BAND_Z, FIT_SE_FLOOR, MEDIAN_SE, NOISE_NEAR, AccuracyRule, accuracy_rule, fit_convergence, json_key)

__all__ = [
    "CANDIDATES",
    "BASE_OPTIONS",
    "default_options",
    "Sharding",
    "SHARDINGS",
    "fsdp_units",
    "reduce_scatter_unit_bytes",
    "all_gather_unit_bytes",
    "allreduce_unit_bytes",
    "residual_bytes",
    "fsdp_state_bytes",
    "sharded_step_time",
    "fit_collective_overhead",
    "LayerProfile",
    "Profile",
    "Convergence",
    "StepBreakdown",
    "ddp_buckets",
    "plan_error",
    "step_time",
    "ddp_topology",
    "ddp_node_net_bytes",
    "ddp_bytes_per_rank",
    "bucket_wire_of",
    "HierBucketWire",
    "hier_bucket_wire",
    # the hop inside a machine (Plan.intra_node)
    "intra_node_choices",
    "intra_node_error",
    "INTRA_NODE_ERROR",
    "INTRA_NODE_BYTES",
    "evaluate",
    "Trial",
    "objective",
    "cost_usd",
    "fit_alpha_beta",
    "tcp_payload_link",
    "fit_codec_scale",
    "family",
    "fit_convergence",
    "pareto_front",
    "LocalCalibration",
    "local_step_time",
    "evaluate_local",
    "DEFAULT_LOCAL_EVERY",
    "DEFAULT_LOCAL_FRAGMENTS",
    # the accuracy rule
    "AccuracyRule",
    "accuracy_rule",
    "json_key",
    "FIT_SE_FLOOR",
    # constants other modules read
    "BUCKET_MB_CHOICES",
    "LOCAL_CALIBRATION_OPTION",
    "DTYPE_BYTES",
]
