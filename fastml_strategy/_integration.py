"""What every framework adapter (``lightning``, ``accelerate``, ``transformers``) shares: the table of
settings an adapter takes, finding the model a framework wrapped, and the metrics dict it logs.

A new adapter reads its settings through :func:`setting`, finds what to compress with
:func:`find_ddp` / :func:`find_fsdp2` / :func:`fsdp2_units` / :func:`is_fsdp1`, and logs :func:`metrics` in one of the
key styles below, instead of assembling each again::

    check_every = setting("check_replicas_every", None, owner="MyAdapter")   # arg, FASTML_*, default
    ddp = find_ddp(model)                  # the DDP wrapper, also inside torch.compile, or None
    logger.log(metrics(state.stats(), TRAINER_KEYS, since=mark))

Settings: each has one keyword, one ``FASTML_*`` variable (the keyword in capitals), one default per
mode and one rule (:func:`~fastml_strategy._validate.env_whole_number`). The plan (``FASTML_PLAN``) is
resolved by :func:`fastml_strategy.config.resolve_plan` and LocalSGD's settings (``FASTML_LOCALSGD_*``)
by :func:`resolve_local_steps`, the one reader of those variables (defaults and checks from
:class:`~fastml_strategy.config.LocalSteps`; :func:`fastml_strategy.localsgd.resolve_settings` is the
public name); both are listed in :data:`SETTINGS` too, so the table names every variable an adapter
reads.

Metrics: the keys users see differ between frameworks (Lightning logs ``fastml/bytes_sent_per_step``
and ``fastml/rel_error/<layer>``, the Hugging Face Trainer ``fastml/bytes_per_step`` and
``fastml/error/<layer>``) and stay as they are; :class:`MetricKeys` holds the difference, and one
function computes the figures for both.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from fastml_strategy._validate import LAYER_STATS_EVERY, LAYER_STATS_EVERY_LOCALSGD, env_whole_number
from fastml_strategy.config import DEFAULT_RECIPE, LOCAL_STEPS_MINIMUM, LocalSteps, Plan, check_local_steps

log = logging.getLogger(__name__)


# -- settings -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setting:
    """One setting an adapter takes: the keyword, its ``FASTML_*`` variable, its defaults, its rule."""

    name: str  # the keyword argument
    variable: str  # the environment variable read when the argument is None
    default: Any  # per-step modes (DDP hook, FSDP)
    localsgd_default: Any  # LocalSGD (it synchronises once per H steps, so it may measure each time)
    minimum: int | None  # whole numbers: the least value (0 turns it off); None: resolved elsewhere
    meaning: str


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("plan", "FASTML_PLAN", DEFAULT_RECIPE, DEFAULT_RECIPE, None,
            "recipe name or plan JSON (resolved by fastml_strategy.config.resolve_plan)"),
    Setting("check_replicas_every", "FASTML_CHECK_REPLICAS_EVERY", 0, 0, 0,
            "compare parameter checksums across ranks every N steps (DDP; 0: off)"),
    Setting("layer_stats_every", "FASTML_LAYER_STATS_EVERY", LAYER_STATS_EVERY, LAYER_STATS_EVERY_LOCALSGD, 0,
            "measure per-layer compression error every N steps (0: off)"),
)}
# LocalSGD's settings (every, fragments, delay, outer, outer_lr, outer_momentum), in LocalSteps' order:
# defaults and least values from LocalSteps (fastml_strategy.config), the one source; resolved with the
# plan's recorded local_steps by resolve_local_steps.
LOCAL_STEPS: tuple[str, ...] = tuple(LocalSteps().kwargs())
SETTINGS.update({name: Setting(name, f"FASTML_LOCALSGD_{name.upper()}", None, default,
                               LOCAL_STEPS_MINIMUM.get(name),
                               "LocalSGD (resolved by fastml_strategy.localsgd.resolve_settings)")
                 for name, default in LocalSteps().kwargs().items()})


def setting(name: str, value: Any, *, owner: str, localsgd: bool = False, default: Any = ...) -> Any:
    """The whole-number setting ``name`` of :data:`SETTINGS`: ``value`` if not None, else its variable
    if set, else its default (LocalSGD's with ``localsgd=True``; ``default`` overrides both), checked
    by one rule whose error names ``owner``."""
    row = SETTINGS[name]
    if row.minimum is None or name in LOCAL_STEPS:
        raise KeyError(f"{name} is not resolved here; {row.meaning}")
    if default is ...:
        default = row.localsgd_default if localsgd else row.default
    return env_whole_number(row.variable, value, default, row.minimum, owner=owner)


def from_environment(name: str, *, owner: str) -> Any:
    """The variable of setting ``name`` (:data:`SETTINGS`) as the setting's type, or None when it is
    unset or blank. Whole numbers go through :func:`~fastml_strategy._validate.env_whole_number` (one
    rule and message for every FASTML_* variable, against the row's least value); a setting whose
    default is a name (``outer``) is the text itself, any other a number (``outer_lr``)."""
    row = SETTINGS[name]
    if row.minimum is not None:
        return env_whole_number(row.variable, None, None, row.minimum, owner=owner)
    raw = os.environ.get(row.variable, "").strip()
    if not raw or isinstance(row.localsgd_default, str):
        return raw or None
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{row.variable}={raw!r} is not a number; set it like "
                         f"{row.variable}={row.localsgd_default}, or unset it") from None


def resolve_local_steps(plan: Any = None, *, owner: str = "LocalSGD", **given: Any) -> tuple[Plan, dict]:
    """The plan and LocalSGD's settings (:data:`LOCAL_STEPS`): each is the argument in ``given``, else
    its ``FASTML_LOCALSGD_<NAME>`` variable, else what the plan records (``Plan.local_steps``, written
    by ``fastml-autotune``), else :class:`~fastml_strategy.config.LocalSteps`' default. ``plan`` None
    reads ``FASTML_PLAN`` (default int4). Checked at once by
    :func:`~fastml_strategy.config.check_local_steps` (errors begin with ``owner``): the same error on
    every process, before any process group exists."""
    from fastml_strategy.config import resolve_plan

    unknown = sorted(set(given) - set(LOCAL_STEPS))
    if unknown:
        raise TypeError(f"LocalSGD settings {unknown} are not known; use {sorted(LOCAL_STEPS)}")
    resolved = resolve_plan(plan)
    recorded = resolved.local_steps.kwargs() if resolved.local_steps is not None else {}
    out = {}
    for name in LOCAL_STEPS:
        value = given.get(name)
        if value is None:
            value = from_environment(name, owner=owner)
        if value is None:
            value = recorded.get(name, SETTINGS[name].localsgd_default)
        out[name] = value
    check_local_steps(**out, owner=owner)
    return resolved, out


def take_local_steps(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Remove LocalSGD's settings (:data:`LOCAL_STEPS`: ``every``, ``fragments``, ``delay``, ``outer``,
    ``outer_lr``, ``outer_momentum``) from an adapter's ``**kwargs`` and return them. The settings are
    declared once, in :class:`~fastml_strategy.config.LocalSteps`; an adapter takes them as keywords
    and hands the rest (DDPStrategy's, ``accelerator.prepare``'s) on."""
    return {name: kwargs.pop(name) for name in LOCAL_STEPS if name in kwargs}


# -- the wrapped model ----------------------------------------------------------------------------------------
def unwrap(model: Any) -> Iterator[Any]:
    """The model and what torch.compile wraps (``OptimizedModule._orig_mod``, private: torch has no
    public accessor), outermost first. tests/test_upstream_internals.py fails if torch renames it."""
    seen = 0
    while model is not None and seen < 4:  # torch.compile(DDP(model)) keeps DDP in _orig_mod
        yield model
        if type(model).__name__ == "OptimizedModule" and not hasattr(model, "_orig_mod"):
            log.warning("FastML: torch.compile's OptimizedModule has no _orig_mod in torch %s (torch "
                        "internals changed): FastML cannot find the DDP/FSDP model inside it and will not "
                        "compress; call fastml_strategy.accelerate.setup before torch.compile", torch.__version__)
        model = getattr(model, "_orig_mod", None)
        seen += 1


def find_ddp(model: Any) -> torch.nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` wrapper of ``model`` (itself, or inside torch.compile), or None."""
    return next((m for m in unwrap(model) if isinstance(m, torch.nn.parallel.DistributedDataParallel)), None)


def is_fsdp2(module: Any) -> bool:
    """Whether ``module`` itself is an FSDP2 unit (an ``FSDPModule``: ``fully_shard`` applied to it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return False
    return isinstance(module, FSDPModule)


def find_fsdp2(model: Any) -> torch.nn.Module | None:
    """The FSDP2 root (an ``FSDPModule``: Accelerate's ``fsdp_version: 2`` or your own ``fully_shard``):
    ``model`` itself or what torch.compile wraps, or None."""
    return next((m for m in unwrap(model) if is_fsdp2(m)), None)


def fsdp2_units(model: Any) -> Iterator[torch.nn.Module]:
    """Every FSDP2 unit anywhere inside ``model`` (itself included), in ``modules()`` order: a model
    whose submodules were sharded with ``fully_shard`` before its root was."""
    if isinstance(model, torch.nn.Module):
        yield from (m for m in model.modules() if is_fsdp2(m))


def is_fsdp1(model: Any) -> bool:
    """Whether ``model`` holds FSDP1 ``FullyShardedDataParallel`` modules (which FastML does not compress)."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # torch built without distributed
        return False
    return isinstance(model, torch.nn.Module) and any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


# -- metrics ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MetricKeys:
    """How one framework names and measures the figures it logs (users' dashboards depend on the names)."""

    bytes_per_step: str  # key of this rank's bytes on the wire per step since the mark
    layer_error: str  # key prefix of a layer's relative compression error
    interval_ratio: bool  # compression ratio over the interval since the mark (else over the whole run)
    idle_bytes: float | None  # bytes_per_step of an interval without steps (None: not logged)
    extras: tuple[str, ...]  # figures of stats() logged as they are, when the state has them


LIGHTNING_KEYS = MetricKeys("bytes_sent_per_step", "rel_error/", interval_ratio=False, idle_bytes=None,
                            extras=("residual_bytes",))  # FSDP's error-feedback memory
TRAINER_KEYS = MetricKeys("bytes_per_step", "error/", interval_ratio=True, idle_bytes=0.0,
                          extras=("ratio_vs_ddp",))  # LocalSGD: bytes against DDP's fp32 all-reduce


def counters(stats: dict) -> tuple[int, int, float, int, float]:
    """``(steps, bytes_sent, bytes_uncompressed, sent, uncompressed)`` of a state's ``stats()``
    (LocalSGD: inner steps): the mark that :func:`metrics` measures an interval from. The last two are
    what ``compression_ratio`` divides: the bytes across machines on the hierarchical path
    (``bytes_uncompressed_inter / bytes_sent_inter``), else the first two again."""
    steps = stats.get("steps", stats.get("inner_steps", 0))
    sent, unc = int(stats["bytes_sent"]), float(stats["bytes_uncompressed"])
    if stats.get("bytes_uncompressed_inter") is not None:
        return int(steps), sent, unc, int(stats["bytes_sent_inter"]), float(stats["bytes_uncompressed_inter"])
    return int(steps), sent, unc, sent, unc


def layer_errors(stats: dict, key: str) -> dict[str, float]:
    """Each layer's relative compression error under ``key + name``; layers sent as fp32 are exact, and
    NaN means not measured yet: neither is logged."""
    out = {}
    for name, row in stats.get("layers", {}).items():
        err = row.get("rel_error", float("nan"))
        err = float(err) if isinstance(err, (int, float)) else float("nan")
        if row.get("codec") != "fp32" and math.isfinite(err):
            out[f"{key}{name}"] = err
    return out


def metrics(stats: dict, keys: MetricKeys, *, since: tuple = (0, 0, 0.0), layers: bool = True,
            prefix: str = "fastml/") -> dict[str, float]:
    """The scalars a logger receives from a state's ``stats()``: the compression ratio, bytes per step
    since ``since`` (:func:`counters` at the mark), the ``keys.extras`` the state has and, with
    ``layers``, each lossy layer's relative error; named as ``keys`` says."""
    steps, sent, _, r_sent, r_unc = counters(stats)
    d_steps, d_sent = steps - since[0], sent - since[1]
    # the ratio's own figures (a mark of three: the totals, which the flat path's ratio divides)
    d_r_sent = r_sent - (since[3] if len(since) > 4 else since[1])
    d_r_unc = r_unc - (since[4] if len(since) > 4 else since[2] if len(since) > 2 else 0.0)
    if keys.interval_ratio and d_r_sent > 0:  # (an interval without communication: the run's ratio)
        ratio = d_r_unc / d_r_sent
    else:
        ratio = float(stats["compression_ratio"])
    out = {f"{prefix}compression_ratio": ratio}
    if d_steps > 0:
        out[f"{prefix}{keys.bytes_per_step}"] = d_sent / d_steps
    elif keys.idle_bytes is not None:
        out[f"{prefix}{keys.bytes_per_step}"] = keys.idle_bytes
    for name in keys.extras:
        if name in stats:
            out[f"{prefix}{name}"] = float(stats[name])
    if layers:
        out.update(layer_errors(stats, f"{prefix}{keys.layer_error}"))
    return out
