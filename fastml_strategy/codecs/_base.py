"""The codec registry: the open :class:`Codec` name, the :class:`CodecConfig` base of every codec's
settings, the :class:`WireCodec` base of every codec, and :func:`register_codec`, which ties the three
together (torchao's ``register_quantize_module_handler`` is the model: one decorator, one dict, no
if-ladder to extend).

A codec is one module of :mod:`fastml_strategy.codecs` that defines

1. its settings: a frozen dataclass subclass of :class:`CodecConfig` with only the fields it reads,
   which checks them (``check``) and names them (``label``);
2. its class: a :class:`WireCodec` subclass (the wire format and the work on one chunk; its fallback
   rule, :meth:`WireCodec.effective`; its kernel entry points), decorated with
   ``@register_codec("name")``, whose class attributes say what the rest of FastML reads about it:
   ``settings`` (the class of 1.), ``recipes`` (named plans, ``Plan.from_recipe``), ``candidates``
   (what the autotuner searches), ``uniform`` (which recipes the autotuner times as uniform baselines),
   ``check`` (the recipe of its family the autotuner's final check always trains), ``sharded``
   (whether FSDP/HSDP run it) and ``intra_node`` (whether it may carry the hop inside a machine).

Registration makes ``Codec.NAME`` exist, adds the recipes to ``RECIPES`` and the candidates to the
autotuner's search space; ``CodecConfig(codec="name", ...)`` and a plan's ``{"codec": "name"}`` then
build the settings class. Nothing outside the codec's module names it.

This module imports nothing of FastML but :mod:`fastml_strategy._validate`: the codec modules build on
it, :mod:`fastml_strategy.config` (plans) builds on the codecs, and no codec imports a plan.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Mapping

import torch

from fastml_strategy._validate import _is_int, type_problem

__all__ = [
    "WIRE_FORMAT_VERSION", "Codec", "CodecConfig", "ResidualConfig", "WireCodec", "register_codec",
    "codec_class", "codec_for", "registered_codecs", "settings_class", "RECIPES", "candidates",
    "uniform_recipes", "DEFAULT_BLOCK_SIZE", "RESIDUAL_DTYPES",
]

# The version of the bytes FastML puts on the wire: every registered codec's chunk format, the layout
# of the messages and their 64-byte headers. Ranks compare it before the first step (with the plan:
# fastml_strategy.comm._distributed.agreed_plan) and refuse to run together when it differs. It is tied to
# the bytes by tests/test_wire_digests.py, which stores a digest of each codec's bytes for fixed inputs
# under the version: raise it with any change that a rank of the previous build would decode
# differently (a digest that changes). A new codec does not change any stored digest: it adds its own
# under the current version (a build without it refuses a plan that names it, by name, at load).
WIRE_FORMAT_VERSION = 2  # 2: the lowrank codec (added when a new codec still raised the version)

# 512 elements per max-min block: int4 then costs 4 + 64/512 = 4.125 bits per element (ratio 7.76
# against fp32) and int2 2.125 bits (ratio 15.1), while a block stays small enough that one outlier
# does not flatten the resolution of a whole layer.
DEFAULT_BLOCK_SIZE = 512
RESIDUAL_DTYPES = frozenset({"fp32", "bf16"})

# Chunk boundaries of the codecs without blocks fall on multiples of 16 elements: 64 bytes of fp32
# (a cache line) and a multiple of 4 bytes for fp16/bf16, so every chunk's encoding stays aligned.
CHUNK_UNIT = 16


def align4(n: int) -> int:
    return (n + 3) & ~3


def all_finite(t: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(t).all()


def store(out: torch.Tensor, y: torch.Tensor, accumulate: bool) -> None:
    """A decoder's last step: ``out = y``, or ``out += y`` when accumulating."""
    if accumulate:
        out.add_(y)
    else:
        out.copy_(y)


def ring_bytes(nbytes: int, world_size: int) -> float:
    """What one rank sends of a message of ``nbytes`` in a ring (scatter-reduce-allgather)
    all-reduce: 2(W-1)/W of it."""
    return 2.0 * (world_size - 1) / world_size * nbytes


# -- the open codec name ----------------------------------------------------------------------------------
class _CodecType(type):
    """``Codec("quantize")``, ``Codec.QUANTIZE``, ``list(Codec)``, ``"fp8" in Codec``: the registered
    names, as an enum of them would answer (an enum cannot grow, so a codec module could not add one)."""

    def __call__(cls, value: Any) -> "Codec":
        if isinstance(value, cls):
            return value
        member = cls._members.get(value) if isinstance(value, str) else None
        if member is None:
            raise ValueError(f"{value!r} is not a valid Codec")
        return member

    def __getattr__(cls, attr: str) -> "Codec":
        for m in cls._members.values():
            if m.name == attr:
                return m
        raise AttributeError(f"Codec has no member {attr!r}; registered: {[m.name for m in cls]}")

    def __getitem__(cls, name: str) -> "Codec":
        try:
            return getattr(cls, name)
        except AttributeError:
            raise KeyError(name) from None

    def __iter__(cls):
        return iter(tuple(cls._members.values()))

    def __len__(cls) -> int:
        return len(cls._members)

    def __contains__(cls, value: Any) -> bool:
        return isinstance(value, str) and str.__str__(value) in cls._members


class Codec(str, metaclass=_CodecType):
    """A registered codec's name (a ``str``: ``Codec.QUANTIZE == "quantize"``). Members come from
    :func:`register_codec`; ``Codec(name)`` gives the one member of a name, so ``is`` compares them."""

    __slots__ = ()
    _members: ClassVar[dict[str, "Codec"]] = {}

    @property
    def value(self) -> str:
        return str.__str__(self)

    @property
    def name(self) -> str:
        return self.value.upper().replace("-", "_")

    def __str__(self) -> str:
        return f"Codec.{self.name}"

    def __format__(self, spec: str) -> str:  # as the enum formatted its members
        return format(str(self), spec)

    def __repr__(self) -> str:
        return f"<Codec.{self.name}: {self.value!r}>"

    def __reduce__(self):
        return Codec, (self.value,)

    @classmethod
    def _add(cls, value: str) -> "Codec":
        if value not in cls._members:
            member = str.__new__(cls, value)
            cls._members[value] = member
        return cls._members[value]


# -- settings ---------------------------------------------------------------------------------------------
# Plan format 1 wrote one flat record for every codec: these fields (and the low-rank codec's rank and
# factors), whichever codec read them. The six codecs of that release (their settings classes set
# ``legacy = True``) still write the record, so their plan files and digests stay byte for byte what
# they were, and accept a field of it that they do not read (it never did anything: it is dropped).
# Codecs added since write only their own fields.
_V1_RECORD: tuple[tuple[str, Any], ...] = (
    ("bits", None), ("block_size", DEFAULT_BLOCK_SIZE), ("stochastic", False), ("topk", None),
    ("topk_count", None), ("error_feedback", True), ("residual_dtype", "fp32"), ("fallback_bits", 8))
_V1_FIELDS = frozenset(k for k, _ in _V1_RECORD) | {"rank", "factors"}
# The value of each of those fields in a record whose codec does not read it (the flat record's
# defaults; the low-rank fields were written for that codec only). A record of that release always
# holds them: they load. Any other value means the user asked for something this codec does not do
# (``{"codec": "quantize", "topk": 0.01}`` is not top-k, ``{"codec": "fp16", "bits": 4}`` not int4),
# and is refused rather than dropped.
_V1_UNREAD = dict(_V1_RECORD) | {"rank": 4, "factors": "fp32"}
_CONSTRUCTED = "CodecConfig"  # the ``where`` of errors raised at construction


def _own_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init)


class _ConfigType(type):
    """``CodecConfig(codec="quantize", bits=4)`` builds the registered settings class of the codec
    (``QuantizeConfig(bits=4)``); calling a settings class itself builds it directly."""

    def __call__(cls, *args: Any, **kw: Any):
        if cls is not CodecConfig:
            return super().__call__(*args, **kw)
        if len(args) > 1:
            raise TypeError("CodecConfig(codec, **settings): give the settings by name")
        name = args[0] if args else kw.pop("codec", "fp32")
        sub = settings_class(name)
        own = set(_own_fields(sub))
        if sub.legacy:  # the flat record's fields that this codec does not read, as that record wrote them
            _refuse_unread(sub, own, kw)
            kw = {k: v for k, v in kw.items() if k in own or k not in _V1_FIELDS}
        extra = sorted(set(kw) - own)
        if extra:
            raise TypeError(f"CodecConfig: the {sub.codec.value} codec has no setting(s) {extra}; its "
                            f"settings are {sorted(own)}")
        return sub(**kw)


def _refuse_unread(sub: type, own: set[str], kw: Mapping[str, Any]) -> None:
    """Raise ValueError for a flat-record field that ``sub``'s codec does not read, set to a value
    other than the record's (:data:`_V1_UNREAD`): a setting that would silently do nothing. A codec
    without a residual takes either ``error_feedback`` (it has none either way)."""
    for k in sorted(set(kw) & _V1_FIELDS - own):
        v = kw[k]
        if v == _V1_UNREAD[k] and type(v) is type(_V1_UNREAD[k]) or (k == "error_feedback" and isinstance(v, bool)):
            continue
        readers = sorted(c.value for c in Codec if k in _own_fields(settings_class(c.value)))
        raise ValueError(
            f"{_CONSTRUCTED}: the {sub.codec.value} codec does not read {k}={v!r} (it would do nothing); "
            f"remove it, or use a codec that reads {k} ({', '.join(readers) or 'none'}); the "
            f"{sub.codec.value} codec's settings are {sorted(own)}")


@dataclass(frozen=True)
class CodecConfig(metaclass=_ConfigType):
    """The compression of one parameter's gradient: the base of every codec's settings class, and the
    constructor of any of them (``CodecConfig(codec="quantize", bits=4)``, ``CodecConfig()`` for fp32).

    A settings class holds only the fields its codec reads; values out of range raise ValueError at
    construction, naming the field and the fix. A codec that keeps no residual reads as
    ``error_feedback=False`` (and ``residual_dtype="fp32"``)."""

    codec: ClassVar[Codec]  # set by register_codec
    wire: ClassVar[type["WireCodec"]]  # the codec class, set by register_codec
    legacy: ClassVar[bool] = False  # writes plan format 1's flat record (the six codecs of that release)
    error_feedback = False  # what a codec without a residual answers (a field of those with one)
    residual_dtype = "fp32"

    def __post_init__(self) -> None:
        self.validate(_CONSTRUCTED)

    # -- what a settings class states --------------------------------------------------------------------
    def check(self, fail: Callable[[str, str, str], None]) -> None:
        """Call ``fail(field, problem, fix)`` for a setting this codec cannot take."""

    def label(self) -> str:
        """The codec's part of :meth:`describe` (``int4``, ``topk1%-int4``, ``lowrank4``...)."""
        return self.codec.value

    # -- what every codec's settings answer ---------------------------------------------------------------
    def validate(self, where: str = "codec") -> None:
        """Raise ValueError naming the field and the fix if a setting is out of range."""

        def fail(fieldname: str, problem: str, fix: str) -> None:
            raise ValueError(f"{where}: {fieldname} {problem}; {fix}")

        self.check(fail)

    @property
    def lossy(self) -> bool:
        """Whether the plan compresses this tensor (every codec but fp32). A layer that is not lossy
        travels uncompressed, batched with the bucket's other such tensors (in fp16/bf16 when the
        gradients already are: exact either way)."""
        return self.wire.lossy

    @property
    def uses_residual(self) -> bool:
        """Whether this codec keeps an error-feedback residual (fp16/bf16 casts do not need one)."""
        return bool(self.error_feedback) and self.wire.error_feedback

    @property
    def residual_torch_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.residual_dtype == "bf16" else torch.float32

    def describe(self) -> str:
        """A short human name: ``int4``, ``topk1%-int4``, ``fp16``, ``int4-noef``, ``int4-rbf16``..."""
        name = self.label()
        if not self.wire.error_feedback:
            return name
        if not self.error_feedback:
            return name + "-noef"
        return name + ("-rbf16" if self.residual_dtype == "bf16" else "")

    # -- JSON ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        own = dataclasses.asdict(self)
        if not self.legacy:
            return {"codec": self.codec.value, **own}
        d = {"codec": self.codec.value, **{k: own.get(k, default) for k, default in _V1_RECORD}}
        d.update({k: v for k, v in own.items() if k not in d})
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "codec") -> "CodecConfig":
        if not isinstance(d, Mapping):
            raise ValueError(f"{where}: expected an object with a 'codec' field, got {type(d).__name__}")
        if "codec" not in d:
            raise ValueError(f"{where}: missing field 'codec'; use one of {[c.value for c in Codec]}")
        try:
            sub = settings_class(d["codec"])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        known = set(_own_fields(sub)) | ({"codec"} | (_V1_FIELDS if sub.legacy else set()))
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; known fields are "
                             f"{sorted(known)}")
        try:
            return CodecConfig(**d)
        except ValueError as e:
            msg = str(e).removeprefix(f"{_CONSTRUCTED}: ")
            raise ValueError(f"{where}: {msg}") from None


# -- shared field checks (a field's rule is the same in every codec that has it) ------------------------------
def check_bool(cfg: CodecConfig, name: str, fail) -> None:
    if not isinstance(getattr(cfg, name), bool):
        fail(name, f"is {getattr(cfg, name)!r}", "use true or false")


def check_block_size(cfg: CodecConfig, fail) -> None:
    bs = cfg.block_size
    if not _is_int(bs) or bs < 8 or bs > 65536 or bs & (bs - 1):
        fail("block_size", type_problem(bs) or f"is {bs!r}", "use a power of two from 8 to 65536 (512 is the default)")


def check_bits(bits: Any, fail, fix: str, name: str = "bits", optional: bool = False) -> None:
    if optional and bits is None:
        return
    if not _is_int(bits) or not 1 <= bits <= 8:
        fail(name, type_problem(bits) or f"is {bits!r}, outside 1-8", fix)


@dataclass(frozen=True)
class ResidualConfig(CodecConfig):
    """The settings of a codec that keeps an error-feedback residual (its subclasses add their own)."""

    # Error feedback: what compression drops is added back into the next step's gradient. Costs one
    # residual per parameter (memory the size of the model); without it, top-k does not converge.
    error_feedback: bool = True
    # dtype of the error-feedback residual: "fp32", or "bf16" for half the memory (the residual is
    # rounded to bf16 after each step; the encoder still adds it in fp32). Under FSDP a residual is as
    # large as the unsharded gradient, so this is the memory knob there (docs/fsdp.md has the table).
    residual_dtype: str = "fp32"

    def check(self, fail) -> None:
        check_bool(self, "error_feedback", fail)
        if self.residual_dtype not in RESIDUAL_DTYPES:
            fail("residual_dtype", f"is {self.residual_dtype!r}",
                 f"use one of {sorted(RESIDUAL_DTYPES)} (bf16 halves the residual's memory)")


# -- the codec class --------------------------------------------------------------------------------------
class WireCodec:
    """One codec bound to one settings object (see :mod:`fastml_strategy.codecs`).

    Buffers are uint8 tensors of exactly :meth:`nbytes` bytes (a view into a message); inputs are flat
    float tensors, outputs flat fp32. Nothing here reads a value on the host."""

    # -- what a subclass states --------------------------------------------------------------------------
    codec: ClassVar[Codec]  # set by register_codec
    settings: ClassVar[type[CodecConfig]]  # its settings class
    family: ClassVar[str]  # the autotuner's codec-time family (its measured scale applies per family)
    lossy: ClassVar[bool] = True  # False: the plan's "uncompressed" (batched with the other small tensors)
    error_feedback: ClassVar[bool] = False  # can keep a residual (then the settings' error_feedback decides)
    sparse: ClassVar[bool] = False  # all-gathered and scatter-added rather than scatter-reduced
    lowrank: ClassVar[bool] = False  # a matrix's factors, all-reduced per bucket (fastml_strategy.comm._lowrank)
    segment_tables: ClassVar[bool] = False  # has encode_table/encode_segments/... (many chunks per launch)
    # -- what the rest of FastML reads about it (register_codec collects them) -------------------------------
    recipes: ClassVar[Mapping[str, CodecConfig]] = {}  # named plans (Plan.from_recipe, RECIPES)
    candidates: ClassVar[Mapping[str, CodecConfig]] = {}  # the autotuner's per-layer options, best error first
    uniform: ClassVar[tuple[str, ...]] = ()  # recipes the autotuner times as uniform baselines
    # the recipe of its family the autotuner's final check always trains beside the tuned plan (None:
    # none): a family the calibration never ran uniformly is still compared by its own run
    check: ClassVar[str | None] = None
    sharded: ClassVar[bool] = True  # runs under FSDP/HSDP (searched there, with -rbf16 variants)
    intra_node: ClassVar[bool] = False  # may carry the hop inside a machine (Plan.intra_node): exact or a cast

    __slots__ = ("cfg",)

    def __init__(self, cfg: CodecConfig) -> None:
        self.cfg = cfg

    def __reduce__(self):  # pickles as its settings: the same instance comes back
        return codec_for, (self.cfg,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cfg.describe()})"

    @classmethod
    def name(cls, cfg: CodecConfig) -> str:
        """The codec's part of :meth:`CodecConfig.describe` (:meth:`CodecConfig.label`)."""
        return cfg.label()

    @classmethod
    def describe(cls, cfg: CodecConfig) -> str:
        """:meth:`CodecConfig.describe`."""
        return cfg.describe()

    # -- policy ---------------------------------------------------------------------------------------
    def effective(self, numel: int, world_size: int, shape=None) -> CodecConfig:
        """The codec this layer really uses (``numel`` elements, ``shape`` where known) at
        ``world_size``: its own settings, unless the codec falls back to another one there (top-k past
        the world size where all_gather stops paying, low-rank for a tensor too small to gain)."""
        return self.cfg

    def wire_config(self, dtype: torch.dtype) -> CodecConfig:
        """The settings that carry this codec's layers for gradients of ``dtype`` (its own, unless
        the codec travels in the gradients' dtype: fp32's)."""
        return self.cfg

    def density(self, numel: int) -> float:
        """The fraction of a tensor's ``numel`` entries a message carries (1: every one)."""
        return 1.0

    def rank_bytes(self, numel: int, world_size: int, shape=None) -> float:
        """Codec bytes one rank sends per step for a layer of ``numel`` elements that takes this codec
        (headers not included): a dense codec's scatter-reduce-allgather sends 2(W-1)/W of its
        encoding."""
        return ring_bytes(self.nbytes(numel), world_size)

    @torch.no_grad()
    def roundtrip(self, x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, int]:
        """Encode and decode ``x`` locally (no error feedback, no communication): ``(decoded fp32 tensor
        shaped like x, encoded bytes)``: the codec's own error on a real gradient."""
        flat = x.detach().reshape(-1).to(torch.float32)
        n = flat.numel()
        out = torch.zeros(n, dtype=torch.float32, device=flat.device)
        nbytes = self.nbytes(n)
        buf = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
        self.encode(flat, buf, seed=seed)
        self.decode(buf, n, out)
        return out.view_as(x), nbytes

    # -- the wire format ---------------------------------------------------------------------------------
    def chunk_unit(self) -> int:
        """Elements a chunk boundary must be a multiple of, so that no block spans two chunks and every
        chunk's encoding stays 4-byte aligned."""
        return CHUNK_UNIT

    def part_unit(self) -> int:
        """Elements a part boundary of the hierarchical all-reduce must be a multiple of (a part is
        one local rank's share of a parameter, compressed across machines as a tensor of its own):
        the chunk unit, unless the codec may fall back to another one for a part."""
        return self.chunk_unit()

    def nbytes(self, numel: int) -> int:
        """Encoded bytes of a chunk (or one whole sparse message) of ``numel`` elements: a multiple of 4."""
        raise NotImplementedError

    def split(self, buf: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(metadata, codes)``: the uint8 views of an encoded chunk's block metadata (empty for a
        codec without blocks) and of its codes or values (padding excluded)."""
        raise NotImplementedError

    # -- the work -------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
               residual_out: torch.Tensor | None = None, seed: int = 0) -> None:
        """Encode one chunk ``x`` into ``out``. With ``residual`` (a codec that keeps one), the encoder
        reads ``x + residual`` and writes the new residual to ``residual_out`` (default: ``residual``,
        in place); a residual may be fp32 or bf16, and a non-finite input leaves it unchanged (per
        block, or for the whole chunk). Codecs without a residual ignore it."""
        raise NotImplementedError

    def decode(self, buf: torch.Tensor, numel: int, out: torch.Tensor, accumulate: bool = False) -> None:
        """Decode one chunk into fp32 ``out`` (``+=`` when accumulating)."""
        raise NotImplementedError

    def reduce(self, bufs: list[torch.Tensor], numel: int, out: torch.Tensor, divisor: float,
               acc: torch.Tensor, seed: int = 0) -> None:
        """The reduce step of a dense chunk: decode the messages ``bufs`` (``numel`` elements each), sum
        them in order, divide by ``divisor`` and encode the result into ``out`` (no error feedback),
        using the fp32 scratch ``acc``. A codec may fuse the steps (quantize on the compiled CPU path:
        then ``acc`` is left unwritten); the bytes are those of the steps one by one."""
        for i, b in enumerate(bufs):
            self.decode(b, numel, acc, accumulate=i > 0)
        acc.div_(divisor)
        self.encode(acc, out, seed=seed)

    def finite(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        """Whether an encoded chunk decodes to finite values (a 0-d bool tensor; no host read)."""
        raise NotImplementedError

    # -- the reference digest of the bytes (tests/test_wire_digests.py) ----------------------------------
    # Why the digest test cannot hash this codec's bytes ("": it can), for a codec whose messages exist
    # only inside a collective and that does not override wire_sample. Stated, so the test can print it.
    digest_exempt: ClassVar[str] = ""

    def wire_sample(self, x: torch.Tensor, seed: int = 0) -> list[torch.Tensor]:
        """What this codec puts on the wire for the CPU tensor ``x``, as uint8 tensors: the digest test
        hashes them for fixed inputs and compares with the digests stored for
        :data:`WIRE_FORMAT_VERSION`. Here: ``x`` encoded; with a residual (``cfg.uses_residual``) two
        error-feedback steps from a zero residual, and the residual after them; a dense codec also the
        reduce step of three messages (``x``, ``-x``, ``x`` rolled by one). A codec whose messages are
        not one encode per tensor (several rounds) overrides this with what it sends."""
        n = x.numel()

        def encode(v, residual=None, s=seed):
            buf = torch.zeros(self.nbytes(n), dtype=torch.uint8)
            self.encode(v, buf, residual, seed=s)
            return buf

        out = [encode(x)]
        if self.error_feedback and self.cfg.uses_residual:
            r = torch.zeros(n, dtype=self.cfg.residual_torch_dtype)
            out += [encode(x, r), encode(x.flip(0), r, seed + 1), r.view(torch.uint8).clone()]
        if not self.sparse:
            red = torch.zeros(self.nbytes(n), dtype=torch.uint8)
            self.reduce([out[0], encode(-x), encode(x.roll(1))], n, red, 3.0, torch.zeros(n), seed=seed + 2)
            out.append(red)
        return out


# -- the registry -----------------------------------------------------------------------------------------
_REGISTRY: dict[Codec, type[WireCodec]] = {}
# Named recipes (Plan.from_recipe), from every registered codec's ``recipes``, in registration order.
RECIPES: dict[str, CodecConfig] = {}


def register_codec(name: str):
    """Class decorator: register ``cls`` (a :class:`WireCodec` subclass whose ``settings`` is its
    :class:`CodecConfig` subclass) as the codec ``name``; makes ``Codec.NAME``, and adds its recipes."""

    def deco(cls: type[WireCodec]) -> type[WireCodec]:
        codec = Codec._add(str(name))
        if codec in _REGISTRY and _REGISTRY[codec] is not cls:
            raise ValueError(f"register_codec: {codec.value!r} is registered already, to {_REGISTRY[codec].__name__}")
        settings = cls.__dict__.get("settings")
        if not (isinstance(settings, type) and issubclass(settings, CodecConfig)) or settings is CodecConfig:
            raise TypeError(f"register_codec({name!r}): {cls.__name__}.settings must be its own CodecConfig "
                            f"subclass (a frozen dataclass of the fields it reads)")
        clash = sorted(set(cls.recipes) & set(RECIPES) - set(_REGISTRY.get(codec, cls).recipes))
        if clash:
            raise ValueError(f"register_codec({name!r}): recipe name(s) {clash} are taken by another codec")
        cls.codec = settings.codec = codec
        settings.wire = cls
        _REGISTRY[codec] = cls
        RECIPES.update(cls.recipes)
        codec_for.cache_clear()
        return cls

    return deco


def codec_class(codec: Codec | str) -> type[WireCodec]:
    """The class registered for ``codec``."""
    try:
        return _REGISTRY[Codec(codec)]
    except (KeyError, ValueError):
        raise ValueError(f"codec {getattr(codec, 'value', codec)!r} has no registered class; register one "
                         f"with @fastml_strategy.codecs.register_codec") from None


def settings_class(codec: Any) -> type[CodecConfig]:
    """The settings class of the codec named ``codec`` (ValueError naming the registered ones)."""
    try:
        return _REGISTRY[Codec(codec)].settings
    except (KeyError, ValueError, TypeError):
        raise ValueError(f"codec={getattr(codec, 'value', codec)!r} is not a codec; use one of "
                         f"{[c.value for c in Codec]}") from None


@functools.lru_cache(maxsize=None)
def codec_for(cfg: CodecConfig) -> WireCodec:
    """The codec of ``cfg``: its registered class bound to these settings (one instance per config)."""
    return type(cfg).wire(cfg)


def registered_codecs() -> dict[Codec, type[WireCodec]]:
    """Every registered codec class, by :class:`Codec` member, in registration order."""
    return dict(_REGISTRY)


def candidates() -> dict[str, CodecConfig]:
    """The autotuner's per-layer options: every registered codec's ``candidates``, in registration order."""
    out: dict[str, CodecConfig] = {}
    for cls in _REGISTRY.values():
        out.update(cls.candidates)
    return out


def check_recipes() -> tuple[str, ...]:
    """The recipes the autotuner's final check always trains: every registered codec's ``check``."""
    return tuple(cls.check for cls in _REGISTRY.values() if cls.check)


def uniform_recipes() -> tuple[str, ...]:
    """The recipes the autotuner times as uniform baselines: every registered codec's ``uniform``."""
    return tuple(r for cls in _REGISTRY.values() for r in cls.uniform)
