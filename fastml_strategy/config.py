"""Per-layer compression settings: :class:`CodecConfig` for one tensor, :class:`Plan` for a model.

A plan maps parameter names to codec settings, the way torchao's ``FqnToConfig`` does: an exact name
wins, then the first matching ``re:`` pattern (in the order given), then the plan's default. Tensors
with fewer than ``min_numel`` elements (biases, norms) are never compressed: they travel uncompressed,
batched into one message per bucket, because their metadata would cost more than it saves.

Plans round-trip through JSON with a format version, are written atomically, and carry a digest that
the hook compares across ranks at registration (ranks holding different plans would otherwise issue
collectives of different sizes and hang).

A plan may also say *when* to communicate: ``Plan.local_steps`` (a :class:`LocalSteps`, set by
``fastml-autotune`` when local steps win) asks for :class:`~fastml_strategy.LocalSGD` with H inner
steps between synchronisations, F fragments and its outer optimizer, the codecs then compressing the
pseudo-gradients; ``LocalSGD.from_plan(model, inner, plan)`` uses it. Without it (every plan written
before it existed) the plan compresses every step's gradients. It is written only when set, so the
files and digests of per-step plans are what they were.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from fastml_strategy._io import atomic_write_text
from fastml_strategy._validate import _is_int, type_problem, whole_number
from fastml_strategy.codecs import (DEFAULT_BLOCK_SIZE, RECIPES, RESIDUAL_DTYPES, Codec, CodecConfig, codec_for,
                                    registered_codecs, settings_class)

__all__ = ["Codec", "CodecConfig", "LocalSteps", "Plan", "RECIPES", "DEFAULT_RECIPE", "PLAN_FORMAT_VERSION",
           "resolve_plan", "check_local_steps", "type_problem", "DEFAULT_BLOCK_SIZE", "RESIDUAL_DTYPES",
           "intra_node_codecs"]

PLAN_FORMAT_VERSION = 1

# Below this many elements a tensor travels uncompressed (fp32, batched with the bucket's other small
# tensors): at 4096 elements an int4 block's metadata is still noticeable and the saving is < 15 KB.
DEFAULT_MIN_NUMEL = 4096


def intra_node_codecs() -> list[str]:
    """The codecs the hop inside a machine may take (Plan.intra_node): the registered codecs that say
    so (``WireCodec.intra_node``: exact, or a 16-bit cast)."""
    return sorted(c.value for c, cls in registered_codecs().items() if cls.intra_node)


# The outer optimizers of local steps: DiLoCo's Nesterov SGD, or plain SGD (outer_lr=1, momentum 0:
# parameter averaging).
OUTER_OPTIMIZERS = ("nesterov", "sgd")


# The least value of each whole-number local-step setting: what :func:`check_local_steps` requires,
# and what a FASTML_LOCALSGD_<NAME> variable is checked against (fastml_strategy._integration).
LOCAL_STEPS_MINIMUM: dict[str, int] = {"every": 1, "fragments": 1, "delay": 0}


def check_local_steps(every: Any, fragments: Any, delay: Any, outer: Any, outer_lr: Any, outer_momentum: Any,
                      owner: str = "local_steps") -> None:
    """Raise ValueError, naming the setting and what to use, for local-step settings no model can take:
    the one check of :class:`LocalSteps` (which runs it on itself) and of LocalSGD's arguments
    (:func:`fastml_strategy.localsgd.check_arguments`). ``owner`` begins the message."""
    for name, value in (("every", every), ("fragments", fragments), ("delay", delay)):
        whole_number(name, value, LOCAL_STEPS_MINIMUM[name], owner=owner)
    if outer not in OUTER_OPTIMIZERS:
        raise ValueError(f"{owner}: outer={outer!r}; use one of {list(OUTER_OPTIMIZERS)}")
    for name, v in (("outer_lr", outer_lr), ("outer_momentum", outer_momentum)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{owner}: {name}={v!r}; use a finite number >= 0")
    if outer == "nesterov" and outer_momentum <= 0:
        raise ValueError(f"{owner}: outer='nesterov' needs outer_momentum > 0 (0.9 in DiLoCo); use outer='sgd' "
                         f"for no momentum")
    if delay > 0 and delay >= max(1, every // fragments):
        raise ValueError(f"{owner}: delay={delay} must be shorter than the gap between two fragments' "
                         f"synchronisations (every // fragments = {every // fragments}); lower delay or raise "
                         f"every")


@dataclass(frozen=True)
class LocalSteps:
    """Synchronise every ``every`` inner steps instead of every step (the arguments of
    :class:`~fastml_strategy.LocalSGD` other than the model, the optimizer and the plan). Its defaults
    are LocalSGD's, and the framework adapters' (one place).

    ``every``: H, inner steps between two synchronisations (the bytes per step drop by H; the steps
    to the target grow by what the autotuner's calibration measured). ``fragments``: F, the model
    synchronised in F staggered pieces (Streaming DiLoCo: the same bytes, 1/F of them at a time).
    ``delay``: inner steps a fragment's all-reduce may run under compute before its outer update
    (hides the wire time; that fragment's local progress of those steps is dropped). ``outer``,
    ``outer_lr``, ``outer_momentum``: the outer optimizer (DiLoCo: Nesterov, 0.7, 0.9)."""

    every: int = 50
    fragments: int = 1
    delay: int = 0
    outer: str = "nesterov"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9

    def __post_init__(self) -> None:
        check_local_steps(**self.kwargs())

    def kwargs(self) -> dict[str, Any]:
        """``LocalSGD(model, inner, plan=plan, **plan.local_steps.kwargs())``."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        return (f"H={self.every}" + (f", F={self.fragments}" if self.fragments > 1 else "")
                + (f", delay {self.delay}" if self.delay else "")
                + f", outer {self.outer} lr {self.outer_lr:g}"
                + (f" momentum {self.outer_momentum:g}" if self.outer_momentum else ""))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "local_steps") -> "LocalSteps":
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: expected an object with field 'every', got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known fields are {sorted(known)}")
        try:
            return cls(**d)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {str(e).removeprefix('local_steps: ')}") from None


# Named recipes (``Plan.from_recipe``): ``RECIPES`` is the registry's, each codec module adding its
# own (fastml_strategy.codecs); "none" is fp32's.


# The plan of a user who names none (no argument, no FASTML_PLAN), and the default of a Plan's layers.
DEFAULT_RECIPE = "int4"


# Plan.schedule's values (fastml_strategy.comm._halving: the schedules and the choice between them)
SCHEDULES = ("auto", "ring", "halving")


@dataclass(frozen=True)
class Plan:
    """Per-layer compression of a model's gradients, keyed by parameter name.

    ``layers`` maps an exact parameter name, or ``re:PATTERN`` (``re.fullmatch`` on the name), to a
    :class:`CodecConfig`. Look-up order: exact name, then patterns in order, then ``default``.
    """

    default: CodecConfig = field(default_factory=lambda: RECIPES[DEFAULT_RECIPE])
    layers: tuple[tuple[str, CodecConfig], ...] = ()
    min_numel: int = DEFAULT_MIN_NUMEL
    # Base seed of stochastic rounding; the hook mixes in the rank and the step.
    seed: int = 0
    name: str = "custom"
    # Local steps (LocalSGD: synchronise every H steps) instead of every step; None: every step.
    local_steps: LocalSteps | None = None
    # The hop inside a machine of the hierarchical all-reduce (several machines of several ranks):
    # None or fp32 sends it exact; fp16/bf16 halve its bytes (for GPUs that share PCIe without NVLink)
    # at one rounding of the machine's reduced gradient, which error feedback does not see. A recipe
    # name ("bf16") or a CodecConfig; quantization is refused (see intra_node_codecs()).
    intra_node: CodecConfig | None = None
    # The schedule of each compressed bucket's all-reduce (fastml_strategy.comm._halving): "auto" picks per
    # bucket by alpha-beta terms at the run's world size (N = 2: the ring; a power of two above 2:
    # recursive halving/doubling, 2 log2 N latency rounds for the ring's bytes; other N: halving only
    # where latency dominates), "ring" forces the all_to_all + all_gather (2(N-1) rounds, today's),
    # "halving" forces recursive halving/doubling (also for buckets with nothing to compress, which
    # otherwise take DDP's own all-reduce). Buckets with a top-k layer always take the ring.
    schedule: str = "auto"
    # The link "auto" assumes (one-way latency in microseconds, bandwidth in Gbit/s); None: 50 us and
    # 10 Gbit/s (fastml_strategy.comm._halving.DEFAULT_LATENCY_US / DEFAULT_GBPS). Only the choice reads it.
    link_latency_us: float | None = None
    link_gbps: float | None = None

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, Mapping):
            layers = tuple(layers.items())
        else:
            try:
                layers = tuple(tuple(kv) for kv in layers)
            except TypeError:
                raise ValueError(
                    f"plan.layers is a {type(self.layers).__name__}; give a dict of parameter name (or "
                    f"'re:PATTERN') -> CodecConfig, or a sequence of (name, CodecConfig) pairs") from None
            bad = [kv for kv in layers if len(kv) != 2]
            if bad:
                raise ValueError(f"plan.layers: {bad[0]!r} is not a (name, CodecConfig) pair; give pairs, "
                                 f"or a dict of name -> CodecConfig")
        object.__setattr__(self, "layers", layers)
        if isinstance(self.intra_node, str):
            if self.intra_node not in RECIPES:
                raise ValueError(f"plan.intra_node is {self.intra_node!r}; use one of "
                                 f"{intra_node_codecs()} (or 'none' for fp32)")
            object.__setattr__(self, "intra_node", RECIPES[self.intra_node])
        self.validate()

    # -- constructors ----------------------------------------------------------------------------------
    @classmethod
    def uniform(
        cls,
        bits: int | None = None,
        topk: float | None = None,
        error_feedback: bool = True,
        stochastic: bool = False,
        min_numel: int = DEFAULT_MIN_NUMEL,
        block_size: int = DEFAULT_BLOCK_SIZE,
        codec: str | Codec | None = None,
        residual_dtype: str = "fp32",
    ) -> "Plan":
        """One setting for every layer: ``bits`` alone quantizes, ``topk`` alone sparsifies, both
        give top-k with quantized values; ``codec="fp16"`` (or fp32/bf16) for plain casts.
        ``residual_dtype="bf16"`` halves the error-feedback memory."""
        if codec is None and topk is None and bits is None:
            raise ValueError("Plan.uniform: give bits=1..8, topk=(0, 1], or codec='fp32'/'fp16'/'bf16' (or any "
                             "registered codec's name)")
        if codec is None:
            codec = "topk" if topk is not None else "quantize"
        given = dict(bits=bits, topk=topk, block_size=block_size, stochastic=stochastic,
                     error_feedback=error_feedback, residual_dtype=residual_dtype)
        unset = dict(bits=None, topk=None, block_size=DEFAULT_BLOCK_SIZE, stochastic=False, error_feedback=True,
                     residual_dtype="fp32")
        own = {f.name for f in dataclasses.fields(settings_class(codec))}
        # what the codec reads, and whatever else was set (which it then refuses, naming its settings)
        cfg = CodecConfig(codec=codec, **{k: v for k, v in given.items() if k in own or v != unset[k]})
        return cls(default=cfg, min_numel=min_numel, name=cfg.describe())

    @classmethod
    def from_recipe(cls, name: str, **overrides: Any) -> "Plan":
        """A named recipe of :data:`RECIPES` (each codec module names its own: ``none``, ``fp16``,
        ``int8``, ``int4``, ``topk1``, ``lowrank4``, ``fp8``...)."""
        if not isinstance(name, str) or name not in RECIPES:
            raise ValueError(
                f"unknown recipe {name!r}{_did_you_mean(name)}; use one of {sorted(RECIPES)}, a plan JSON "
                f"path, or a Plan"
            )
        allowed = ("layers", "min_numel", "seed", "intra_node", "schedule", "link_latency_us", "link_gbps")
        unknown = sorted(set(overrides) - set(allowed))
        if unknown:
            raise ValueError(f"Plan.from_recipe: unknown override(s) {unknown}; a recipe's plan takes "
                             f"{list(allowed)} (its codec is the recipe's: use Plan.uniform or Plan(...) "
                             f"to choose another)")
        return cls(default=RECIPES[name], name=name, **overrides)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "plan") -> "Plan":
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: a plan is a JSON object, got {type(d).__name__}")
        version = d.get("format_version")
        if version is None:
            raise ValueError(
                f"{where}: missing 'format_version'; plans written by this FastML have "
                f"format_version {PLAN_FORMAT_VERSION}"
            )
        if not _is_int(version) or version != PLAN_FORMAT_VERSION:
            raise ValueError(
                f"{where}: format_version {version!r} is not supported (this FastML reads "
                f"{PLAN_FORMAT_VERSION}); re-create the plan with this version's fastml-autotune or "
                f"Plan.save, or upgrade FastML"
            )
        known = {"format_version", "default", "layers", "min_numel", "seed", "name", "meta", "local_steps",
                 "intra_node", "schedule", "link_latency_us", "link_gbps"}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known fields are {sorted(known)}")
        default = CodecConfig.from_dict(d["default"], f"{where}.default") if "default" in d \
            else RECIPES[DEFAULT_RECIPE]
        layers_in = d.get("layers", {})
        if not isinstance(layers_in, Mapping):
            raise ValueError(f"{where}.layers: expected an object of name -> codec settings")
        layers = tuple(
            (str(k), CodecConfig.from_dict(v, f"{where}.layers[{k!r}]")) for k, v in layers_in.items()
        )
        min_numel = d.get("min_numel", DEFAULT_MIN_NUMEL)
        seed = d.get("seed", 0)
        name = d.get("name", "custom")
        local = d.get("local_steps")
        local = None if local is None else LocalSteps.from_dict(local, f"{where}.local_steps")
        intra = d.get("intra_node")
        intra = None if intra is None else CodecConfig.from_dict(intra, f"{where}.intra_node")
        try:
            return cls(default=default, layers=layers, min_numel=min_numel, seed=seed, name=str(name),
                       local_steps=local, intra_node=intra, schedule=d.get("schedule", "auto"),
                       link_latency_us=d.get("link_latency_us"), link_gbps=d.get("link_gbps"))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Plan":
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"plan file {str(p)!r} does not exist; give a recipe name ({sorted(RECIPES)}) "
                             f"or the path of a plan JSON") from None
        except IsADirectoryError:
            raise ValueError(f"plan file {str(p)!r} is a directory; give the path of a plan JSON file "
                             f"inside it") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"plan file {str(p)!r} is not UTF-8 text ({e}); it is corrupted or not a "
                             f"plan: re-create it with Plan.save or fastml-autotune") from None
        except OSError as e:
            raise ValueError(f"plan file {str(p)!r} cannot be read ({e.strerror or e}); check the path "
                             f"and its permissions") from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # JSONDecodeError, the int-digits limit, deep nesting
            reason = str(e) if isinstance(e, ValueError) else "nested too deeply"
            raise ValueError(f"plan file {str(p)!r} is not valid JSON ({reason}); re-create it with "
                             f"Plan.save or fastml-autotune") from None
        return cls.from_dict(data, where=f"plan file {str(p)!r}")

    # -- serialisation -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = {
            "format_version": PLAN_FORMAT_VERSION,
            "name": self.name,
            "default": self.default.to_dict(),
            "layers": {k: v.to_dict() for k, v in self.layers},
            "min_numel": self.min_numel,
            "seed": self.seed,
        }
        if self.local_steps is not None:  # only when set: per-step plans keep their files and digests
            d["local_steps"] = self.local_steps.kwargs()
        if self.intra_node is not None:  # likewise
            d["intra_node"] = self.intra_node.to_dict()
        if self.schedule != "auto":  # likewise (the digest then covers it: ranks must agree)
            d["schedule"] = self.schedule
        for key in ("link_latency_us", "link_gbps"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        """Write the plan as JSON, atomically (a crash mid-write leaves any previous file intact)."""
        atomic_write_text(path, self.to_json())

    def digest(self) -> str:
        """A hash of everything that shapes the wire format; equal on every rank or registration fails."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()

    # -- look-up -------------------------------------------------------------------------------------------
    def for_parameter(self, name: str, numel: int | None = None) -> CodecConfig:
        """The codec for parameter ``name``; fp32 when ``numel`` is under ``min_numel``."""
        if numel is not None and numel < self.min_numel:
            return RECIPES["none"]
        return self._lookup(name)

    def _lookup(self, name: str) -> CodecConfig:
        for key, cfg in self.layers:
            if not key.startswith("re:") and key == name:
                return cfg
        for key, cfg in self.layers:
            if key.startswith("re:") and re.fullmatch(key[3:], name):
                return cfg
        return self.default

    def with_layers(self, layers: Mapping[str, CodecConfig] | Iterable[tuple[str, CodecConfig]],
                    **changes: Any) -> "Plan":
        items = layers.items() if isinstance(layers, Mapping) else layers
        return dataclasses.replace(self, layers=tuple(self.layers) + tuple(items), **changes)

    # -- checks -------------------------------------------------------------------------------------------
    def validate(self) -> None:
        if not isinstance(self.default, CodecConfig):
            raise ValueError(f"plan.default must be a CodecConfig, got {type(self.default).__name__}; use "
                             f"e.g. fastml_strategy.RECIPES['int4'], or Plan.from_recipe('int4') for a "
                             f"whole plan")
        self.default.validate("plan.default")
        for key, cfg in self.layers:
            if not isinstance(key, str) or not key:
                raise ValueError(f"plan.layers: key {key!r} must be a parameter name or 're:PATTERN'")
            if not isinstance(cfg, CodecConfig):
                raise ValueError(f"plan.layers[{key!r}] must be a CodecConfig, got {type(cfg).__name__}; "
                                 f"use e.g. fastml_strategy.RECIPES['int8'] or CodecConfig(codec='quantize', "
                                 f"bits=8)")
            if key.startswith("re:"):
                try:
                    re.compile(key[3:])
                except re.error as e:
                    raise ValueError(f"plan.layers[{key!r}]: invalid regular expression ({e}); "
                                     f"fix the pattern after 're:'") from None
            cfg.validate(f"plan.layers[{key!r}]")
        if not _is_int(self.min_numel) or self.min_numel < 0:
            problem = type_problem(self.min_numel) or f"is {self.min_numel!r}"
            raise ValueError(f"plan.min_numel {problem}; use a whole number >= 0 "
                             f"(tensors with fewer elements travel uncompressed)")
        if not _is_int(self.seed):
            raise ValueError(f"plan.seed {type_problem(self.seed)}; use a whole number")
        if not isinstance(self.name, str):
            raise ValueError(f"plan.name is {self.name!r}; use a string (it names the plan in logs)")
        if self.local_steps is not None and not isinstance(self.local_steps, LocalSteps):
            raise ValueError(f"plan.local_steps is a {type(self.local_steps).__name__}; use "
                             f"fastml_strategy.LocalSteps(every=H, ...) or None (synchronise every step)")
        if self.intra_node is not None:
            if not isinstance(self.intra_node, CodecConfig):
                raise ValueError(f"plan.intra_node is a {type(self.intra_node).__name__}; use a recipe name "
                                 f"('bf16', 'fp16', 'none') or a CodecConfig")
            if not codec_for(self.intra_node).intra_node:
                raise ValueError(
                    f"plan.intra_node is {self.intra_node.describe()}; the hop inside a machine takes "
                    f"{intra_node_codecs()} only: it carries the machine's summed "
                    f"gradient back to every rank after the compressed cross-machine stage, where no error "
                    f"feedback corrects a lossy code, and it runs on the fast link (use 'bf16' to halve it)")

        self._validate_schedule()

    def _validate_schedule(self) -> None:
        if not isinstance(self.schedule, str) or self.schedule not in SCHEDULES:
            raise ValueError(f"plan.schedule is {self.schedule!r}; use one of {list(SCHEDULES)} ('auto' picks "
                             f"per bucket from the link hint, 'ring' or 'halving' force one)")
        for key, what in (("link_latency_us", "the link's one-way latency in microseconds"),
                          ("link_gbps", "the link's bandwidth in Gbit/s")):
            v = getattr(self, key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                    or (key == "link_gbps" and v == 0):
                raise ValueError(f"plan.{key} is {v!r}; give {what} (a number "
                                 f"{'> 0' if key == 'link_gbps' else '>= 0'}), or None for the default")

    @property
    def intra_node_dtype(self) -> "torch.dtype | None":
        """The dtype the hop inside a machine travels in (None: the bucket's, summed in fp32)."""
        if self.intra_node is None or not self.intra_node.lossy:
            return None
        return codec_for(self.intra_node).dtype  # the cast codec's wire dtype

    def check_parameters(self, names: Iterable[str], aliases: Mapping[str, str] | None = None,
                         frozen: Iterable[str] = ()) -> None:
        """Raise ValueError if an exact name of the plan is not a parameter of the model (see
        :meth:`resolve_names`); warn about notes (a pattern that matches nothing, an alias, a frozen
        parameter)."""
        import warnings

        _, notes = self.resolve_names(names, aliases, frozen)
        for note in notes:
            warnings.warn(f"FastML plan: {note}", stacklevel=2)

    def resolve_names(self, names: Iterable[str], aliases: Mapping[str, str] | None = None,
                      frozen: Iterable[str] = ()) -> tuple["Plan", list[str]]:
        """Match the plan's keys against the model: ``names`` are the parameters that train,
        ``aliases`` maps other names of a parameter to its own (tied weights: ``head.weight`` ->
        ``tok.weight``), ``frozen`` names parameters that do not train now.

        An exact key that names an alias is rewritten to the parameter's name; one that names a frozen
        parameter is kept (it applies once the parameter trains); a ``re:`` pattern that matches no
        parameter is kept too. Each of these gives a note. A key that is none of these raises
        ValueError naming it. Returns ``(plan with aliases resolved, notes)``."""
        names = list(names)
        present = set(names)
        aliases = dict(aliases or {})
        frozen = set(frozen)
        notes: list[str] = []
        missing: list[str] = []
        layers: list[tuple[str, CodecConfig]] = []
        for key, cfg in self.layers:
            if key.startswith("re:"):
                everything = names + sorted(frozen)
                if not any(re.fullmatch(key[3:], n) for n in everything):
                    notes.append(f"the pattern {key!r} matches no parameter of the model; it does nothing")
                layers.append((key, cfg))
            elif key in present:
                layers.append((key, cfg))
            elif key in aliases:
                target = aliases[key]
                notes.append(f"{key!r} is another name of {target!r} (tied weights): its setting applies "
                             f"to {target!r}")
                layers.append((target, cfg))
            elif key in frozen:
                notes.append(f"{key!r} is frozen (requires_grad=False): its setting applies once it trains")
                layers.append((key, cfg))
            else:
                missing.append(key)
        if missing:
            sample = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
            raise ValueError(
                f"plan.layers names {missing} but the model has no such parameter (its parameters: "
                f"{sample}); use names from model.named_parameters() (without a 'module.' prefix), "
                f"or a 're:' pattern"
            )
        resolved = self if layers == list(self.layers) else dataclasses.replace(self, layers=tuple(layers))
        return resolved, notes


def _did_you_mean(name: Any) -> str:
    """``" (did you mean 'int4'?)"`` for a name close to a recipe's, else ``""``."""
    import difflib

    if not isinstance(name, str):
        return ""
    close = difflib.get_close_matches(name.lower(), list(RECIPES), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def resolve_plan(plan: Any) -> Plan:
    """Turn what a user passes (a Plan, a recipe name, a path to a plan JSON, a dict, None) into a Plan.

    None reads the environment variable ``FASTML_PLAN``, and falls back to the ``int4`` recipe.
    """
    if plan is None:
        env = os.environ.get("FASTML_PLAN")
        if not env:
            return Plan.from_recipe(DEFAULT_RECIPE)
        try:
            return resolve_plan(env)
        except ValueError as e:
            raise ValueError(f"FASTML_PLAN={env!r} is not a usable plan: {e}") from None
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, Mapping):
        return Plan.from_dict(plan)
    if isinstance(plan, (str, os.PathLike)):
        s = str(plan)
        if s in RECIPES:
            return Plan.from_recipe(s)
        if s.endswith(".json") or os.sep in s or Path(s).exists():
            return Plan.load(s)
        raise ValueError(
            f"plan {s!r} is neither a recipe ({', '.join(sorted(RECIPES))}) nor an existing plan JSON "
            f"file{_did_you_mean(s)}; pass one of those, a dict, or a fastml_strategy.Plan"
        )
    raise ValueError(f"plan must be a Plan, a recipe name, a plan JSON path or a dict, "
                     f"not {type(plan).__name__}")
