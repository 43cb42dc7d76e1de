"""The distributed setup every entry point shares (``register_hook``, ``fsdp.register``, ``LocalSGD``):
what ranks agree on before the first step, and what they need to.

- :func:`agreed_plan`: resolve the plan, check it against the model's parameter names on every rank,
  then agree in one ``all_gather_object``: every rank raises the same ValueError if the plan (or the
  caller's own check) failed on any rank, if ranks hold different plans or other settings that change
  the collectives, or if they run FastML builds of different wire formats
  (:data:`fastml_strategy.codecs.WIRE_FORMAT_VERSION`), instead of one rank waiting for a collective
  the others never issue, or decoding their bytes wrongly;
- :func:`agreed_machines`: which ranks share a machine (:mod:`fastml_strategy.topology`), and the
  process groups of the hierarchical path;
- :func:`default_group_timeout`: the timeout the user gave ``init_process_group``, for the groups
  FastML makes itself;
- :func:`model_names`: a module's parameter names, with tied weights and frozen parameters apart;
- :func:`checked_plan`: the one check of a plan against a model that every entry point and adapter makes
  (tied-weight aliases accepted with a note, frozen parameters kept): agreed on every rank when a
  process group of several ranks is up and asked for, else here.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Optional

import torch
import torch.distributed as dist

from fastml_strategy import codecs
from fastml_strategy.config import CodecConfig, Plan, resolve_plan
from fastml_strategy.comm.topology import agreed_topology, node_groups

__all__ = ["agreed_plan", "agreed_machines", "checked_plan", "default_group_timeout", "model_names"]

log = logging.getLogger(__name__)


def default_group_timeout(pg=None):
    """The timeout the user gave ``init_process_group`` (or group ``pg``), or None (torch's default)
    when it cannot be read; then a logged warning says so, since a dead peer would stall the others
    for torch's default of 30 minutes. Reads torch internals
    (``distributed_c10d._get_default_group()``, ``ProcessGroup._get_backend(device).options._timeout``);
    tests/test_upstream_internals.py fails if torch renames them."""
    try:
        if pg is None:
            pg = dist.distributed_c10d._get_default_group()
    except Exception as e:  # noqa: BLE001
        log.warning("FastML: cannot read the default process group (%s: %s; torch internals changed?): "
                    "FastML's own group uses torch's default timeout (30 minutes), so a dead rank is "
                    "noticed that late", type(e).__name__, e)
        return None
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for this device, or a torch without the field
            continue
    log.warning("FastML: cannot read the timeout of init_process_group (torch %s has no "
                "ProcessGroup._get_backend(device).options._timeout): FastML's own group uses torch's "
                "default (30 minutes), so a dead rank is noticed that late", torch.__version__)
    return None


def _agree(group, world_size: int, payload: Any) -> list:
    """Every rank's ``payload`` (one ``all_gather_object`` on ``group``)."""
    out: list = [None] * world_size
    dist.all_gather_object(out, payload, group=group)
    return out


def model_names(module: torch.nn.Module) -> tuple:
    """``(trainable names, aliases, frozen names)`` of a module's parameters: a parameter reachable under
    several names (tied weights) is known by its first; the others map to it in ``aliases``."""
    first: dict = {}
    aliases: dict = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    named = dict(module.named_parameters())
    return ([n for n, p in named.items() if p.requires_grad], aliases,
            [n for n, p in named.items() if not p.requires_grad])


def checked_plan(plan: Any, module: torch.nn.Module, *, agree: bool = False, check: Any = None,
                 owner: str = "FastML") -> Plan:
    """``plan`` resolved and checked against ``module``'s parameters: the check every adapter makes
    (``accelerate``, ``lightning`` through ``register_hook``, ``transformers``, ``fsdp``), so a plan
    naming a tied weight's other name (``lm_head.weight`` of GPT-2, tied to ``transformer.wte.weight``)
    is accepted with a note everywhere, and a frozen parameter is kept for when it trains.

    With ``agree`` and a process group of several ranks up, the ranks agree (:func:`agreed_plan` on
    the default group, ``check`` and ``plan`` as there): every rank raises the same error, before any
    other collective. Otherwise ``check()`` runs and the plan is checked here. Returns the plan with
    aliases resolved."""
    names, aliases, frozen = model_names(module)
    if agree and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return agreed_plan(plan, names, None, dist.get_world_size(), check=check, aliases=aliases, frozen=frozen,
                           owner=owner)
    if check is not None:
        check()
    plan_obj, notes = resolve_plan(plan() if callable(plan) else plan).resolve_names(names, aliases, frozen)
    for note in notes:
        warnings.warn(f"FastML plan: {note}", stacklevel=3)
    return plan_obj


def agreed_plan(plan: Any, names: list, group: Any, world_size: int, check: Any = None,
                aliases: Optional[dict] = None, frozen: Any = (), local_steps: bool = False,
                settings: Optional[dict] = None, owner: str = "FastML") -> Plan:
    """Resolve ``plan`` and check it against the parameter ``names`` on every rank (``aliases`` and
    ``frozen``: see :meth:`Plan.resolve_names`), then agree: every rank raises the same ValueError if
    the plan (or ``check()``, any further validation) failed on any rank, or if ranks hold different
    plans. ``plan`` may be a function of no argument that returns it, called after ``check()`` (a plan
    that ``check()`` builds). A collective on ``group``. Returns the plan with aliases resolved; notes
    are warned, and so is a plan tuned for local steps (``Plan.local_steps``) given to a per-step user
    (``local_steps`` False: the DDP hook, FSDP).

    ``settings``: the caller's other settings that ranks must share (they change the bytes on the wire
    or the schedule of collectives: ``{"every": 50, ...}``, compared by value); if any differs between
    ranks, every rank raises the same ValueError naming it and each rank's value (``owner`` begins
    the message), instead of one rank waiting for a collective the others never issue."""
    # Validate locally, then agree: a rank whose plan is bad must not leave the others waiting.
    error, digest, plan_obj, failed_check, notes = None, None, None, None, []
    try:
        if check is not None:
            try:
                check()
            except (TypeError, ValueError, RuntimeError) as e:
                failed_check = type(e).__name__
                raise
        plan_obj, notes = resolve_plan(plan() if callable(plan) else plan).resolve_names(names, aliases, frozen)
        digest = plan_obj.digest()
    except Exception as e:  # noqa: BLE001 - any local failure must reach every rank, or they hang
        error = str(e) if isinstance(e, ValueError) or failed_check else f"{type(e).__name__}: {e}"
    reports = _agree(group, world_size, (error, digest, plan_obj.name if plan_obj else None,
                                         failed_check, dict(settings or {}), _build(),
                                         plan_obj.to_dict() if plan_obj else None))
    _check_same_build(reports, owner)
    bad = [(r, rep[0], rep[3]) for r, rep in enumerate(reports) if rep[0] is not None]
    if bad:
        ranks = [r for r, _, _ in bad]
        kind = bad[0][2]
        if kind is not None:  # the caller's own check: its exception type, on every rank
            exc = {"TypeError": TypeError, "ValueError": ValueError}.get(kind, RuntimeError)
            raise exc(f"{bad[0][1]} (found on rank(s) {ranks})")
        raise ValueError(f"FastML plan rejected on rank(s) {ranks}: {bad[0][1]}")
    digests = {rep[1] for rep in reports}
    if len(digests) > 1:
        desc = ", ".join(f"rank {r}: {rep[2]!r} ({rep[1][:12]})" for r, rep in enumerate(reports))
        raise ValueError(
            f"FastML: ranks hold different plans ({desc}){_plan_differences(reports)}; give every rank "
            f"the same plan (the same file, recipe or FASTML_PLAN), or the ranks' messages would not match"
        )
    _check_same_settings(reports, owner)
    for note in notes:
        warnings.warn(f"FastML plan: {note}", stacklevel=3)
    if plan_obj.local_steps is not None and not local_steps:
        warnings.warn(f"FastML plan {plan_obj.name!r} was tuned for local steps "
                      f"({plan_obj.local_steps.describe()}); used here it compresses every step's "
                      f"gradients, which is not what was tuned. Train with "
                      f"fastml_strategy.LocalSGD.from_plan(model, inner_optimizer, plan) instead, or "
                      f"use the per-step plan of the autotuner's report.", stacklevel=3)
    return plan_obj


_ABSENT = object()  # a setting one rank's plan does not have


def _short(v: Any) -> str:
    """A setting's value in a message: a codec's short name (``'int4'``), ``absent``, or its repr."""
    if v is _ABSENT:
        return "absent"
    if isinstance(v, dict) and "codec" in v:
        try:
            return repr(CodecConfig.from_dict(v).describe())
        except ValueError:
            pass
    return repr(v)


def _differing(values: list, path: str, out: list) -> None:
    """Append ``(path, values)`` for each setting that differs between ranks, descending into the
    objects every rank has (``default.bits``, ``layers['2.weight'].codec``)."""
    if len({repr(v) for v in values}) <= 1:
        return
    if all(isinstance(v, dict) for v in values):
        for k in sorted({k for v in values for k in v}, key=str):
            sub = f"{path}[{k!r}]" if path == "layers" else f"{path}.{k}" if path else str(k)
            _differing([v.get(k, _ABSENT) for v in values], sub, out)
        return
    out.append((path, values))


def _plan_differences(reports: list, most: int = 4) -> str:
    """``": they differ in intra_node (rank 0: absent, rank 1: 'bf16')"``: the settings whose values
    differ between the ranks' plans (the seventh field of each agreement report; an older build sends
    none), each with every rank's value."""
    plans = [rep[6] if len(rep) > 6 else None for rep in reports]
    if any(p is None for p in plans):
        return ""
    diffs: list = []
    _differing(plans, "", diffs)
    if not diffs:
        return ""
    text = "; ".join(f"{path} ({', '.join(f'rank {r}: {_short(v)}' for r, v in enumerate(values))})"
                     for path, values in diffs[:most])
    more = f" and {len(diffs) - most} more" if len(diffs) > most else ""
    return f": they differ in {text}{more}"


def _build() -> tuple[int, str]:
    """What this rank's bytes on the wire depend on: the wire-format version and the FastML version."""
    import fastml_strategy

    return codecs.WIRE_FORMAT_VERSION, fastml_strategy.__version__


def _check_same_build(reports: list, owner: str) -> None:
    """Raise the same ValueError on every rank if ranks run FastML builds of different wire formats
    (the sixth field of each rank's agreement report; a build older than the field sends none), naming
    each rank's. Builds of one wire format may differ otherwise: their bytes are the same."""
    builds = [rep[5] if len(rep) > 5 else None for rep in reports]
    if len({b[0] if b else None for b in builds}) <= 1:
        return

    def text(b: Any) -> str:
        return f"wire format {b[0]} (FastML {b[1]})" if b else "no wire-format version (an older FastML)"

    desc = ", ".join(f"rank {r}: {text(b)}" for r, b in enumerate(builds))
    raise ValueError(f"{owner}: ranks run FastML builds whose bytes on the wire differ ({desc}); install "
                     f"the same FastML on every machine, or each would decode the others' messages wrongly")


def _check_same_settings(reports: list, owner: str) -> None:
    """Raise the same ValueError on every rank if the ranks' settings (the fifth field of each
    rank's agreement report) differ, naming the first setting that does and every rank's value."""
    keys = sorted({k for rep in reports for k in (rep[4] or {})})
    for key in keys:
        values = [(rep[4] or {}).get(key) for rep in reports]
        if len({repr(v) for v in values}) > 1:
            desc = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{owner}: ranks hold different {key} ({desc}); give every rank the same "
                             f"{key}, or their collectives would not match and one rank would wait "
                             f"for the others until the timeout")


def agreed_machines(group, rank: int, world_size: int, ranks_per_node: Optional[int]) -> tuple:
    """``(topology, groups)``: the agreed :class:`~fastml_strategy.topology.Topology` (None when the
    group is not the whole world and nothing was asked), and for N > 1 machines of R > 1 ranks the
    groups of the hierarchical path (intra, intra_gather, cross), with ``group``'s timeout; else
    ``()``. Collective on every rank."""
    if world_size != dist.get_world_size():
        if ranks_per_node not in (None, 1):
            raise ValueError(
                f"register_hook: ranks_per_node={ranks_per_node} needs the all-reduce over every rank, "
                f"but process_group holds {world_size} of {dist.get_world_size()}; drop ranks_per_node "
                f"(the flat all-reduce) or all-reduce over all ranks")
        return None, ()
    topo = agreed_topology(group, rank, world_size, ranks_per_node)
    if not topo.hierarchical:
        if topo.ranks_per_node > 1 and rank == 0:
            log.info("FastML: one machine of %d ranks (%s): the flat all-reduce", topo.ranks_per_node,
                     topo.source)
        return topo, ()
    timeout = default_group_timeout(group)
    intra, cross = node_groups(topo, timeout=timeout)
    intra_gather, _ = node_groups(topo, timeout=timeout, cross=False)  # tails issue their all_gather here
    if rank == 0:
        log.info("FastML: %d machines x %d ranks (%s): hierarchical all-reduce (reduce-scatter inside a "
                 "machine, compressed across machines, all-gather inside)", topo.nodes,
                 topo.ranks_per_node, topo.source)
    return topo, (intra, intra_gather, cross)
