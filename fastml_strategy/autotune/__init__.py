"""fastml-autotune: choose per-layer gradient compression by what it costs in time and money.

The question it answers: with this model on this cluster (or that cheaper one), which compression
reaches the target accuracy soonest and for the fewest dollars? The pipeline:

1. **Profile** (``profile``): compute time per step, when each gradient is ready in the backward pass,
   and for every tunable layer and codec option the relative error (with error feedback) and the time
   of an encode/decode round trip, on real gradients over several steps. Launched distributed, the link's
   latency and bandwidth come from timed collectives at several sizes; otherwise from ``--link`` or the
   hardware catalog.
2. **Calibrate** (``calibrate``): short training runs of candidate plans against uncompressed training,
   turning "gradient error e" into "g(e) times as many steps", plus the largest error that stays within
   the accuracy-loss limit. An Optuna study with pruning stops hopeless candidates early.
3. **Search** (``search``): one Optuna study per hardware option over per-layer (or per-group) codec
   choices, minimising the predicted cost ``steps * step time * nodes * price`` (``costmodel``) under the
   error limit; the Pareto front of time against cost across all options.
4. **Measure and report** (``measure``, ``report``): predicted against measured step time, predictions
   for 8 to 1024 nodes, plan.json, report.html/.md and CSV tables, written atomically.

``sharding="fsdp"`` / ``"hsdp"`` (``--sharding``) tunes for :func:`fastml_strategy.fsdp.register`
instead: the cost model (``costmodel.sharded_step_time``) counts FSDP2's parameter all-gathers, the
compressed reduce-scatter or cross-node all-reduce per FSDP unit and the error-feedback memory per
rank, against FSDP's own collectives; the report adds bytes and memory per rank and a what-if grid
of cluster shapes.

Public API: :func:`autotune`, :class:`Workload`, :class:`AutotuneResult`, the catalog helpers
:func:`load_catalog` / :class:`HardwareOption` / :func:`parse_link`, and ``CANDIDATES`` (the codec options
searched). The command is ``fastml-autotune`` (``fastml_strategy.autotune.cli``). Not public: the modules'
other functions. Optuna is imported only when a run starts.
"""

from fastml_strategy.autotune._run import autotune
from fastml_strategy.autotune.result import AutotuneResult
from fastml_strategy.autotune.catalog import HardwareOption, Link, load_catalog, parse_link
from fastml_strategy.autotune.costmodel import CANDIDATES
from fastml_strategy.autotune.workload import Workload

__all__ = [
    # running
    "autotune",
    "AutotuneResult",
    "Workload",
    # hardware
    "HardwareOption",
    "Link",
    "load_catalog",
    "parse_link",
    # search space
    "CANDIDATES",
]
