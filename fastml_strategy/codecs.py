"""Codecs: how one flat gradient tensor travels. One class per codec, behind one registry.

A codec is a subclass of :class:`WireCodec` registered for its :class:`~fastml_strategy.config.Codec`
with :func:`register_codec`; :func:`codec_for` gives the instance for a
:class:`~fastml_strategy.config.CodecConfig` (the class bound to those settings). The class is
everything FastML knows about that codec:

- its settings: the checks of the config fields it reads (``check``), its short name (``describe``),
  whether it is ``lossy`` and whether it can keep an ``error_feedback`` residual;
- its wire format: where a chunk may end (``chunk_unit``), a chunk's encoded size (``nbytes``, a
  multiple of 4, so that the next part of a shared message buffer stays aligned) and the split of an
  encoded chunk into block metadata and codes (``split``);
- its work on one chunk: ``encode`` (with error feedback when a residual is given), ``decode``
  (stored or added), ``reduce`` (the reduce step of scatter-reduce-allgather: decode the ranks'
  messages, sum, divide, re-encode) and ``finite`` (whether an encoded chunk decodes to finite
  values, read from the metadata where there is some, so a receiver need not scan the result);
- how ranks combine it (``sparse``): dense codecs (fp32, fp16, bf16, quantize) encode every element,
  so a chunk can be decoded, summed with the other ranks' chunks and re-encoded
  (scatter-reduce-allgather); top-k messages are not (a sum of sparse vectors is not sparse): they are
  all-gathered and scatter-added by every rank, in rank order (:mod:`fastml_strategy.collective`);
- whether it has a kernel that encodes or decodes many chunks in one launch (``segment_tables``:
  quantize, through Triton);
- the autotuner's name for the codec time it measures (``family``).

Adding a codec: a member of :class:`~fastml_strategy.config.Codec`, one class here (or in any module
imported before plans are built) decorated with ``@register_codec(Codec.NEW)``, and its kernel. The
contract tests (tests/test_codec_contract.py) then run over it: round trip, zeros, NaN/inf, pickling,
and a 2-rank all-reduce and reduce-scatter. A codec whose bytes change, or a new codec, raises
:data:`WIRE_FORMAT_VERSION`, so that ranks running different FastML builds refuse to start together.

The wire interface
------------------
The collectives (:mod:`fastml_strategy.collective`, :mod:`fastml_strategy.fsdp`) reach a codec through
the functions below, one per method (``encode_chunk`` is ``codec_for(cfg).encode``, and so on): a
chunk's bytes are only ever read or written here, and a test can replace one function to make every
collective fail at that point. ``roundtrip`` and ``wire_bytes`` serve the autotuner: the first applies a
codec to one tensor locally (no communication), the second predicts a layer's codec bytes on the wire
per step (without the 64-byte message headers, which ``state.stats()['bytes_sent']`` counts too).
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from fastml_strategy import kernels
from fastml_strategy.config import Codec, CodecConfig, type_problem

__all__ = [
    # the registry
    "WIRE_FORMAT_VERSION",
    "WireCodec",
    "register_codec",
    "codec_class",
    "codec_for",
    "registered_codecs",
    # the codecs
    "Fp32Codec",
    "Fp16Codec",
    "Bf16Codec",
    "QuantizeCodec",
    "TopkCodec",
    "LowRankCodec",
    # the wire interface (any codec)
    "is_sparse",
    "wire_config",
    "chunk_unit",
    "chunk_nbytes",
    "encode_chunk",
    "decode_chunk",
    "reduce_chunk",
    "chunk_finite",
    "encode_topk_ef",
    # one family
    "dense_nbytes",
    "encode_dense",
    "decode_dense",
    "topk_nbytes",
    "encode_topk",
    "decode_topk_add",
    "select_topk",
    # planning
    "effective_config",
    "wire_bytes",
    "reduce_scatter_bytes",
    "roundtrip",
]

# The version of the bytes FastML puts on the wire: every codec's chunk format, the layout of the
# messages and their 64-byte headers. Ranks compare it before the first step (with the plan:
# fastml_strategy._distributed.agreed_plan) and refuse to run together when it differs. Raise it with
# any change that a rank of the previous build would decode differently.
WIRE_FORMAT_VERSION = 2  # 2: the lowrank codec (a new codec raises it: see the module docstring)

# Chunk boundaries of the codecs without blocks fall on multiples of 16 elements: 64 bytes of fp32
# (a cache line) and a multiple of 4 bytes for fp16/bf16, so every chunk's encoding stays aligned.
_CHUNK_UNIT = 16


def _align4(n: int) -> int:
    return (n + 3) & ~3


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(t).all()


# -- the registry -----------------------------------------------------------------------------------------
_REGISTRY: dict[Codec, type["WireCodec"]] = {}


def register_codec(codec: Codec):
    """Class decorator: make ``cls`` the codec of ``codec`` (a :class:`~fastml_strategy.config.Codec`
    member); one class per member."""

    def deco(cls: type["WireCodec"]) -> type["WireCodec"]:
        if codec in _REGISTRY and _REGISTRY[codec] is not cls:
            raise ValueError(f"register_codec: {codec.value!r} is registered already, to "
                             f"{_REGISTRY[codec].__name__}")
        cls.codec = codec
        _REGISTRY[codec] = cls
        codec_for.cache_clear()
        return cls

    return deco


def codec_class(codec: Codec) -> type["WireCodec"]:
    """The class registered for ``codec``."""
    try:
        return _REGISTRY[codec]
    except KeyError:
        raise ValueError(f"codec {getattr(codec, 'value', codec)!r} has no registered class; register one "
                         f"with @fastml_strategy.codecs.register_codec") from None


@functools.lru_cache(maxsize=None)
def codec_for(cfg: CodecConfig) -> "WireCodec":
    """The codec of ``cfg``: its registered class bound to these settings (one instance per config)."""
    return codec_class(cfg.codec)(cfg)


def registered_codecs() -> dict[Codec, type["WireCodec"]]:
    """Every registered codec class, by :class:`~fastml_strategy.config.Codec` member."""
    return dict(_REGISTRY)


class WireCodec:
    """One codec bound to one :class:`~fastml_strategy.config.CodecConfig` (see the module docstring).

    Buffers are uint8 tensors of exactly :meth:`nbytes` bytes (a view into a message); inputs are flat
    float tensors, outputs flat fp32. Nothing here reads a value on the host."""

    # -- what a subclass states --------------------------------------------------------------------------
    codec: ClassVar[Codec]  # set by register_codec
    family: ClassVar[str]  # the autotuner's codec-time family (its measured scale applies per family)
    lossy: ClassVar[bool] = True  # False: the plan's "uncompressed" (batched with the other small tensors)
    error_feedback: ClassVar[bool] = False  # can keep a residual (then CodecConfig.error_feedback decides)
    sparse: ClassVar[bool] = False  # all-gathered and scatter-added rather than scatter-reduced
    lowrank: ClassVar[bool] = False  # a matrix's factors, all-reduced per bucket (fastml_strategy._lowrank)
    segment_tables: ClassVar[bool] = False  # has encode_table/encode_segments/... (many chunks per launch)

    __slots__ = ("cfg",)

    def __init__(self, cfg: CodecConfig) -> None:
        self.cfg = cfg

    def __reduce__(self):  # pickles as its settings: the same instance comes back
        return codec_for, (self.cfg,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cfg.describe()})"

    # -- settings (CodecConfig asks) -------------------------------------------------------------------
    @classmethod
    def check(cls, cfg: CodecConfig, fail) -> None:
        """Call ``fail(field, problem, fix)`` for a setting of ``cfg`` this codec cannot take."""

    @classmethod
    def name(cls, cfg: CodecConfig) -> str:
        """The codec's part of :meth:`CodecConfig.describe`."""
        return cls.codec.value

    @classmethod
    def describe(cls, cfg: CodecConfig) -> str:
        """A short human name: ``int4``, ``topk1%-int4``, ``fp16``, ``int4-noef``, ``int4-rbf16``..."""
        name = cls.name(cfg)
        if not cls.error_feedback:
            return name
        if not cfg.error_feedback:
            return name + "-noef"
        return name + ("-rbf16" if cfg.residual_dtype == "bf16" else "")

    def effective(self, numel: int, world_size: int, shape=None) -> CodecConfig:
        """The codec this layer really uses (``numel`` elements, ``shape`` where known) at
        ``world_size``: its own settings, unless the codec falls back to another one there (top-k past
        the world size where all_gather stops paying, low-rank for a tensor too small to gain)."""
        return self.cfg

    # -- the wire format ---------------------------------------------------------------------------------
    def chunk_unit(self) -> int:
        """Elements a chunk boundary must be a multiple of, so that no block spans two chunks and every
        chunk's encoding stays 4-byte aligned."""
        return _CHUNK_UNIT

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


# -- uncompressed and cast codecs ----------------------------------------------------------------------
class _PlainCodec(WireCodec):
    """The chunk is the values themselves, in ``dtype`` (4-byte aligned)."""

    dtype: ClassVar[torch.dtype]
    __slots__ = ()

    def nbytes(self, numel: int) -> int:
        return _align4(numel * self.dtype.itemsize)

    def split(self, buf: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        return buf[:0], buf[: numel * self.dtype.itemsize]

    def _values(self, buf: torch.Tensor, numel: int) -> torch.Tensor:
        return buf[: numel * self.dtype.itemsize].view(self.dtype)

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        self._values(out, x.numel()).copy_(x)

    def decode(self, buf, numel, out, accumulate=False) -> None:
        y = self._values(buf, numel)
        if accumulate:
            out.add_(y)
        else:
            out.copy_(y)

    def finite(self, buf, numel) -> torch.Tensor:
        if numel == 0:
            return torch.ones((), dtype=torch.bool, device=buf.device)
        return _all_finite(self._values(buf, numel))


@register_codec(Codec.FP32)
class Fp32Codec(_PlainCodec):
    """fp32 as it is: exact (a plan's ``none``; the batched small tensors)."""

    family = "fp32"
    lossy = False
    dtype = torch.float32
    __slots__ = ()

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        out.view(torch.float32).copy_(x)  # ``out`` is exactly 4 bytes per element: no slice to take


@register_codec(Codec.FP16)
class Fp16Codec(_PlainCodec):
    """Cast to fp16 for the wire, summed in fp32; no residual (the error of a cast is tiny)."""

    family = "cast"
    dtype = torch.float16
    __slots__ = ()


@register_codec(Codec.BF16)
class Bf16Codec(_PlainCodec):
    """Cast to bf16 for the wire, summed in fp32; no residual."""

    family = "cast"
    dtype = torch.bfloat16
    __slots__ = ()


# -- quantize -----------------------------------------------------------------------------------------------
def _check_bits(cfg: CodecConfig, fail, fix: str, optional: bool = False) -> None:
    bits = cfg.bits
    if optional and bits is None:
        return
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        fail("bits", type_problem(bits) or f"is {bits!r}, outside 1-8", fix)


@register_codec(Codec.QUANTIZE)
class QuantizeCodec(WireCodec):
    """Max-min per block of ``block_size`` elements, ``bits`` per element, bit-packed, optionally
    with stochastic rounding; a chunk is laid out as
    :func:`fastml_strategy.kernels.reference.chunk_layout` says (``[metadata | codes]``), the codes in
    the format of :mod:`fastml_strategy.kernels.reference`."""

    family = "quantize"
    error_feedback = True
    segment_tables = True
    __slots__ = ()

    @classmethod
    def check(cls, cfg, fail) -> None:
        _check_bits(cfg, fail, "quantization takes 1 to 8 bits per element")

    @classmethod
    def name(cls, cfg) -> str:
        return f"int{cfg.bits}" + ("-sr" if cfg.stochastic else "")

    def chunk_unit(self) -> int:
        return self.cfg.block_size

    def layout(self, numel: int) -> kernels.ChunkLayout:
        return kernels.chunk_layout(numel, self.cfg.bits, self.cfg.block_size)

    def nbytes(self, numel: int) -> int:
        return self.layout(numel).nbytes

    def split(self, buf, numel) -> tuple[torch.Tensor, torch.Tensor]:
        lay = self.layout(numel)
        return buf[: lay.meta], buf[lay.meta: lay.meta + lay.codes]

    def _views(self, buf: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(metadata as fp32 [nblocks, 2], packed codes)``: what the kernels read and write."""
        meta, codes = self.split(buf, numel)
        return meta.view(torch.float32).view(-1, 2), codes

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        # The encoder writes metadata and codes straight into the message (offsets are 4-aligned);
        # the kernels take a bf16 residual themselves.
        c = self.cfg
        meta, codes = self._views(out, x.numel())
        kernels.quantize(x, c.bits, c.block_size, c.stochastic, seed, residual, residual_out,
                         packed_out=codes, meta_out=meta)

    def decode(self, buf, numel, out, accumulate=False) -> None:
        c = self.cfg
        meta, codes = self._views(buf, numel)
        kernels.dequantize(codes, meta, numel, c.bits, c.block_size, out=out, accumulate=accumulate)

    def reduce(self, bufs, numel, out, divisor, acc, seed=0) -> None:
        # one pass on the compiled CPU path (kernels.reduce_quantize)
        c = self.cfg
        meta_out, codes_out = self._views(out, numel)
        sources = [self._views(b, numel)[::-1] for b in bufs]  # (codes, meta) per message
        kernels.reduce_quantize(sources, numel, c.bits, c.block_size, divisor, c.stochastic, seed,
                                packed_out=codes_out, meta_out=meta_out, acc=acc)

    def finite(self, buf, numel) -> torch.Tensor:
        if numel == 0:
            return torch.ones((), dtype=torch.bool, device=buf.device)
        return _all_finite(buf[: self.layout(numel).meta].view(torch.float32))  # the blocks' (min, scale)

    # -- segment tables: every chunk of many layers of this config in one launch (Triton) ------------
    def table_key(self) -> tuple:
        """Codecs with equal keys share a table: what the launch reads of the config."""
        c = self.cfg
        return (c.bits, c.block_size, c.stochastic, c.uses_residual)

    def encode_table(self, chunks, device) -> tuple[torch.Tensor, int]:
        """The table of an :meth:`encode_segments` launch; ``chunks``: ``(x_off, r_off, rout_off,
        msg_off, numel)`` per chunk (:func:`fastml_strategy.kernels.encode_table`, seeds 0)."""
        c = self.cfg
        return kernels.encode_table([(*ch, 0) for ch in chunks], c.bits, c.block_size, device)

    def decode_table(self, chunks, device) -> tuple[torch.Tensor, int]:
        """The table of a :meth:`decode_segments` launch; ``chunks``: ``(msg_off, out_off, numel)``."""
        return kernels.decode_table(chunks, self.cfg.bits, self.cfg.block_size, device)

    def set_table_seeds(self, table: torch.Tensor, numels, seeds) -> None:
        """Give an encode table's chunks (of ``numels`` elements) the stochastic-rounding ``seeds``
        (a pinned, non-blocking upload of one column on a GPU)."""
        col = kernels.seed_column(numels, seeds, self.cfg.block_size)
        if table.is_cuda:
            col = col.pin_memory()
        table[:, 7].copy_(col, non_blocking=table.is_cuda)

    def encode_segments(self, x: torch.Tensor, msg: torch.Tensor, table: tuple[torch.Tensor, int],
                        residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None) -> None:
        """Encode every chunk of ``table`` from ``x`` into ``msg`` (error feedback with ``residual``)."""
        c = self.cfg
        kernels.quantize_segments(x, msg, table[0], table[1], c.bits, c.block_size, c.stochastic, residual,
                                  residual_out)

    def decode_segments(self, msg: torch.Tensor, out: torch.Tensor, table: tuple[torch.Tensor, int],
                        sources: int = 1, src_stride: int = 0, accumulate: bool = False) -> torch.Tensor:
        """Decode (and sum ``sources`` copies of) every chunk of ``table`` into ``out``; returns whether
        all are finite (a 0-d bool tensor)."""
        c = self.cfg
        return kernels.dequantize_segments(msg, out, table[0], table[1], c.bits, c.block_size, sources,
                                           src_stride, accumulate)


# -- top-k ------------------------------------------------------------------------------------------------------
# Below this size, or for a dense k, plain torch.topk is cheap enough.
_SAMPLED_TOPK_MIN = 1 << 16
_SAMPLE = 1 << 18


def select_topk(a: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of ``k`` largest entries of the magnitudes ``a`` (no particular order).

    ``torch.topk`` of 1% of a 16.8M-element layer costs about a second on one CPU thread. Instead: take
    a strided sample of 256K entries, pick the threshold that about 1.5k entries of ``a`` should pass,
    keep the candidates at or above it (one compare pass), and run ``torch.topk`` on those only. If
    the sample's guess leaves fewer than ``k`` candidates, retry once with a lower quantile,
    then fall back to the full ``torch.topk`` (42 ms instead of 367 ms for 1% of 16.8M elements, one
    thread). Tensors of at most 65,536 elements, and k over 1/8 of the tensor, take ``torch.topk``.

    The contract (tests/test_codecs.py checks it past 65,536 elements): exactly ``k`` distinct
    indices; every selected non-NaN magnitude is >= every unselected non-NaN magnitude (a true top-k;
    among ties at the k-th magnitude any may be chosen); deterministic for the same input. A NaN
    entry may or may not be selected (it fails the threshold compare): :func:`encode_topk` marks a
    non-finite input in the message itself, so this does not matter on the wire.
    """
    n = a.numel()
    # On a GPU, torch.topk is fast, and the sampled path would read the host (nonzero, numel).
    if n <= _SAMPLED_TOPK_MIN or 8 * k > n or a.is_cuda:
        return torch.topk(a, k, sorted=False).indices
    stride = max(1, n // _SAMPLE)
    sample = a[::stride]
    s = sample.numel()
    for factor in (1.5, 4.0):
        ks = min(s, max(1, int(factor * k * s / n) + 1))
        t = torch.topk(sample, ks, sorted=False).values.min()
        cand = torch.nonzero(a >= t).squeeze(1)
        if cand.numel() >= k:
            return cand[torch.topk(a[cand], k, sorted=False).indices]
    return torch.topk(a, k, sorted=False).indices


@register_codec(Codec.TOPK)
class TopkCodec(WireCodec):
    """The ``k`` largest-magnitude entries: a message is their values (fp32, or quantized with
    ``bits`` in one block layout of ``k`` elements) then their int32 indices. All-gathered and
    scatter-added in rank order; in a reduce-scatter (nothing re-encoded) a chunk's message is the
    top-k of that chunk."""

    family = "topk"
    error_feedback = True
    sparse = True
    __slots__ = ("values",)

    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__(cfg)
        # the codec of the selected values (None: fp32 values)
        self.values: QuantizeCodec | None = None if cfg.bits is None else codec_for(
            CodecConfig(codec=Codec.QUANTIZE, bits=cfg.bits, block_size=cfg.block_size, stochastic=cfg.stochastic))

    @classmethod
    def check(cls, cfg, fail) -> None:
        if cfg.topk_count is None and cfg.topk is None:
            fail("topk", "is not set", "give a fraction in (0, 1] (topk=0.01 keeps 1%) or topk_count")
        if cfg.topk_count is not None and (isinstance(cfg.topk_count, bool) or not isinstance(cfg.topk_count, int)
                                           or cfg.topk_count < 1):
            fail("topk_count", type_problem(cfg.topk_count) or f"is {cfg.topk_count!r}", "give a whole number >= 1")
        if cfg.topk is not None and (
            isinstance(cfg.topk, bool) or not isinstance(cfg.topk, (int, float))
            or not 0.0 < float(cfg.topk) <= 1.0
        ):
            fail("topk", type_problem(cfg.topk, number=True) or f"is {cfg.topk!r}, outside (0, 1]",
                 "give the kept fraction, e.g. topk=0.01 for 1%")
        _check_bits(cfg, fail, "quantized top-k values take 1 to 8 bits (None: fp32)", optional=True)

    @classmethod
    def name(cls, cfg) -> str:
        amount = f"{cfg.topk_count}" if cfg.topk_count is not None else f"{cfg.topk * 100:g}%"
        return f"topk{amount}" + (f"-int{cfg.bits}" if cfg.bits else "")

    def _value_nbytes(self, k: int) -> int:
        return 4 * k if self.values is None else self.values.nbytes(k)

    def effective(self, numel: int, world_size: int, shape=None) -> CodecConfig:
        cfg = self.cfg
        if world_size <= 1:
            return cfg
        if cfg.fallback_bits is None:
            dense = CodecConfig(codec=Codec.FP32)
        else:
            dense = CodecConfig(codec=Codec.QUANTIZE, bits=cfg.fallback_bits, block_size=cfg.block_size,
                                stochastic=cfg.stochastic, error_feedback=cfg.error_feedback,
                                residual_dtype=cfg.residual_dtype)
        sparse_bytes = (world_size - 1) * self.nbytes(numel)
        if sparse_bytes > _dense_rank_bytes(numel, dense, world_size):
            return dense
        return cfg

    def part_unit(self) -> int:
        # a part may take the dense fallback (effective_config): its quantization block
        return int(self.cfg.block_size)

    def nbytes(self, numel: int) -> int:
        k = self.cfg.topk_k(numel)
        return self._value_nbytes(k) + 4 * k

    def split(self, buf, numel) -> tuple[torch.Tensor, torch.Tensor]:
        # metadata: the quantized values' block metadata; codes: the values' codes, then the indices
        meta = buf[:0] if self.values is None else self.values.split(buf, self.cfg.topk_k(numel))[0]
        return meta, buf[meta.numel(): self.nbytes(numel)]

    def select(self, v: torch.Tensor, out: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Select the ``k`` largest-magnitude entries of fp32 ``v``; write values + int32 indices to
        ``out``. Returns ``(indices, decoded values)``: what the message decodes to at the selected
        indices (the values as the receiver sees them), so the caller can form the error-feedback
        residual ``v - decoded`` in place. A non-finite ``v`` poisons the first value with NaN, so
        every rank sees it (one max-reduction of ``|v|`` tells: it is NaN or inf exactly when ``v``
        is not finite)."""
        n = v.numel()
        k = self.cfg.topk_k(n)
        a = v.abs()
        idx = select_topk(a, k)
        vals = v[idx]
        if n:  # on the device: no host read
            vals[:1].masked_fill_(~torch.isfinite(a.max()), float("nan"))
        vbytes = self._value_nbytes(k)
        if self.values is None:
            out[:vbytes].view(torch.float32).copy_(vals)
            sent = vals
        else:
            self.values.encode(vals, out[:vbytes], seed=seed)
            sent = torch.empty(k, dtype=torch.float32, device=v.device)
            self.values.decode(out[:vbytes], k, sent)
        out[vbytes: vbytes + 4 * k].view(torch.int32).copy_(idx)
        return idx, sent

    def encode_rest(self, x: torch.Tensor, out: torch.Tensor, residual: torch.Tensor | None = None,
                    seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode the message of ``x + residual`` (``x`` alone without one) into ``out``. Returns
        ``(rest, finite)``: ``rest`` a fresh fp32 tensor, the input minus what the message decodes to
        (the new residual under error feedback; the compression error otherwise), ``finite`` a 0-d bool
        tensor, whether the message decodes to finite values (when not, the step is skipped on every
        rank and ``rest`` must not become the residual)."""
        if residual is not None and x.dtype == residual.dtype == torch.float32:
            v = torch.add(x, residual)  # one pass
        else:
            v = x.to(torch.float32, copy=True)
            if residual is not None:
                v += residual
        idx, sent = self.select(v, out, seed=seed)
        v[idx] -= sent
        return v, _all_finite(sent)

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        if x.numel() == 0:
            return
        if residual is None:
            self.select(x.to(torch.float32), out, seed=seed)
            return
        r32 = residual.to(torch.float32)  # itself when fp32
        rest, finite = self.encode_rest(x, out, r32, seed)
        # decided on the device: a non-finite message leaves the residual as it was
        (residual if residual_out is None else residual_out).copy_(torch.where(finite, rest, r32))

    def add_to(self, buf: torch.Tensor, numel: int, out: torch.Tensor) -> torch.Tensor:
        """Scatter-add one rank's message into fp32 ``out``; returns whether its values are all finite
        (a 0-d bool tensor: checking k values is cheaper than checking the dense result)."""
        k = self.cfg.topk_k(numel)
        vbytes = self._value_nbytes(k)
        if self.values is None:
            vals = buf[:vbytes].view(torch.float32)
        else:
            vals = torch.empty(k, dtype=torch.float32, device=out.device)
            self.values.decode(buf[:vbytes], k, vals)
        # Clamped: a rank that failed sends whatever its buffer held (the error travels in the header
        # and every rank raises at the end of the step), and an index out of range must not reach
        # index_add_ (a device-side assert on CUDA). A valid message's indices are all below numel.
        idx = buf[vbytes: vbytes + 4 * k].view(torch.int32).to(torch.int64).clamp_(0, max(numel - 1, 0))
        out.index_add_(0, idx, vals)
        return _all_finite(vals)

    def decode(self, buf, numel, out, accumulate=False) -> None:
        if not accumulate:
            out.zero_()
        if numel:
            self.add_to(buf, numel, out)

    def finite(self, buf, numel) -> torch.Tensor:
        if numel == 0:
            return torch.ones((), dtype=torch.bool, device=buf.device)
        k = self.cfg.topk_k(numel)
        if self.values is None:
            return _all_finite(buf[: 4 * k].view(torch.float32))
        return self.values.finite(buf, k)


# -- low-rank (PowerSGD) -----------------------------------------------------------------------------------
@register_codec(Codec.LOWRANK)
class LowRankCodec(WireCodec):
    """PowerSGD: an m x n gradient matrix travels as its rank-``rank`` factors P (m x r) and Q (n x r),
    all-reduced per bucket in two rounds with warm-started Q and error feedback
    (:mod:`fastml_strategy._lowrank` runs it; its layers are a section of the bucket layout of their
    own, not chunks). A layer it cannot compress with gain (1-D, ``(m + n) r >= m n``, no known
    shape) falls back to fp32 (:meth:`effective`), batched with the bucket's other uncompressed
    tensors, as torch's PowerSGD hook all-reduces those uncompressed.

    A flat chunk has no matrix shape, so where a collective hands this codec a chunk (a reduce-scatter,
    the reduce step) it is that fallback's chunk: the chunk methods below are fp32's, and so is
    :meth:`wire_sample` (the factors travel as fp32 arrays or through the fp16/bf16/int8 codecs, whose
    bytes have digests of their own; a matmul's float sums may differ across BLAS builds, so their values
    are not a machine-independent digest)."""

    family = "lowrank"
    error_feedback = True
    lowrank = True
    __slots__ = ("flat", "factor")

    def __init__(self, cfg: CodecConfig) -> None:
        super().__init__(cfg)
        self.flat = codec_for(CodecConfig(codec=Codec.FP32))  # the chunk form (no shape: no matrix)
        # the codec of the factors through the compressed all-reduce (None: a plain fp32 all-reduce)
        self.factor: CodecConfig | None = {
            "fp32": None, "fp16": CodecConfig(codec=Codec.FP16), "bf16": CodecConfig(codec=Codec.BF16),
            "int8": CodecConfig(codec=Codec.QUANTIZE, bits=8, block_size=cfg.block_size, error_feedback=False),
        }.get(cfg.factors)

    @classmethod
    def check(cls, cfg, fail) -> None:
        from fastml_strategy.config import LOWRANK_FACTORS

        r = cfg.rank
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            fail("rank", type_problem(r) or f"is {r!r}", "give the rank of the approximation, a whole number >= 1 "
                 "(4 is PowerSGD's usual choice)")
        if cfg.factors not in LOWRANK_FACTORS:
            fail("factors", f"is {cfg.factors!r}", f"use one of {list(LOWRANK_FACTORS)} (how P and Q travel)")

    @classmethod
    def name(cls, cfg) -> str:
        return f"lowrank{cfg.rank}" + ("" if cfg.factors == "fp32" else f"-{cfg.factors}")

    # -- what the layer becomes ---------------------------------------------------------------------------
    def compressible(self, shape) -> bool:
        """Whether a tensor of ``shape`` gains: a matrix (2-D or more) with ``(m + n) r < m n``."""
        from fastml_strategy._lowrank import matrix_shape

        if shape is None or len(shape) < 2:
            return False
        m, n = matrix_shape(shape)
        return (m + n) * self.cfg.rank < m * n

    def effective(self, numel: int, world_size: int, shape=None) -> CodecConfig:
        return self.cfg if self.compressible(shape) else self.flat.cfg

    def factor_numels(self, shape) -> tuple[int, int]:
        """Elements of P and Q of a tensor of ``shape``: ``(m r, n r)``."""
        from fastml_strategy._lowrank import matrix_shape

        m, n = matrix_shape(shape)
        return m * self.cfg.rank, n * self.cfg.rank

    def factor_round_bytes(self, numel: int, world_size: int) -> float:
        """Codec bytes this rank sends for ``numel`` factor elements in one round (a ring all-reduce's
        2(W-1)/W of their encoding; headers not included)."""
        enc = 4 * numel if self.factor is None else chunk_nbytes(numel, self.factor)
        return 2.0 * (world_size - 1) / world_size * enc

    # -- the chunk form: fp32's ----------------------------------------------------------------------
    def nbytes(self, numel):
        return self.flat.nbytes(numel)

    def split(self, buf, numel):
        return self.flat.split(buf, numel)

    def encode(self, x, out, residual=None, residual_out=None, seed=0) -> None:
        self.flat.encode(x, out)

    def decode(self, buf, numel, out, accumulate=False) -> None:
        self.flat.decode(buf, numel, out, accumulate)

    def finite(self, buf, numel):
        return self.flat.finite(buf, numel)


# -- the wire interface: one chunk of any codec -------------------------------------------------------------
# A reduce-scatter never re-encodes a sum, so top-k works there like a dense codec: each rank encodes
# the chunk it sends to rank j (top-k of that chunk), and rank j adds the W messages it receives.
def is_sparse(cfg: CodecConfig) -> bool:
    """Whether messages of ``cfg`` are all-gathered and scatter-added by every rank (top-k: a sum of
    sparse vectors is not sparse), rather than scatter-reduced with the chunk sum re-encoded."""
    return codec_for(cfg).sparse


def wire_config(cfg: CodecConfig, dtype: torch.dtype) -> CodecConfig:
    """The codec that carries ``cfg`` for gradients of ``dtype``: an uncompressed (fp32) layer whose
    gradients are already fp16/bf16 travels in that dtype, exactly and in half the bytes."""
    if cfg.codec is Codec.FP32 and dtype in (torch.float16, torch.bfloat16):
        return CodecConfig(codec=Codec.FP16 if dtype == torch.float16 else Codec.BF16)
    return cfg


def chunk_unit(cfg: CodecConfig) -> int:
    """:meth:`WireCodec.chunk_unit` of ``cfg``'s codec."""
    return codec_for(cfg).chunk_unit()


def chunk_nbytes(numel: int, cfg: CodecConfig) -> int:
    """:meth:`WireCodec.nbytes`: encoded bytes of one chunk (or one whole top-k message) of ``numel``
    elements, a multiple of 4."""
    return codec_for(cfg).nbytes(numel)


def encode_chunk(x: torch.Tensor, cfg: CodecConfig, out: torch.Tensor, residual: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None, seed: int = 0) -> None:
    """:meth:`WireCodec.encode`: one chunk ``x`` into ``out`` (``chunk_nbytes`` long), with error
    feedback when ``residual`` is given."""
    codec_for(cfg).encode(x, out, residual, residual_out, seed)


def decode_chunk(buf: torch.Tensor, numel: int, cfg: CodecConfig, out: torch.Tensor,
                 accumulate: bool = False) -> None:
    """:meth:`WireCodec.decode`: one chunk into fp32 ``out`` (``+=`` when accumulating)."""
    codec_for(cfg).decode(buf, numel, out, accumulate)


def reduce_chunk(bufs: list[torch.Tensor], numel: int, cfg: CodecConfig, out: torch.Tensor, divisor: float,
                 acc: torch.Tensor, seed: int = 0) -> None:
    """:meth:`WireCodec.reduce`: decode ``bufs``, sum in order, divide by ``divisor``, encode into
    ``out``."""
    codec_for(cfg).reduce(bufs, numel, out, divisor, acc, seed)


def chunk_finite(buf: torch.Tensor, numel: int, cfg: CodecConfig) -> torch.Tensor:
    """:meth:`WireCodec.finite`: whether an encoded chunk decodes to finite values (a 0-d bool tensor;
    no sync)."""
    return codec_for(cfg).finite(buf, numel)


# -- one family (the functions before the codec classes; kept for callers that name a family) ----------
def _dense(cfg: CodecConfig) -> WireCodec:
    codec = codec_for(cfg)
    if codec.sparse:
        raise ValueError(f"{cfg.codec} is not a dense codec")
    return codec


def dense_nbytes(numel: int, cfg: CodecConfig) -> int:
    """Encoded size in bytes of ``numel`` elements under a dense codec."""
    return _dense(cfg).nbytes(numel)


def encode_dense(x: torch.Tensor, cfg: CodecConfig, out: torch.Tensor, residual: torch.Tensor | None = None,
                 residual_out: torch.Tensor | None = None, seed: int = 0) -> None:
    """:meth:`WireCodec.encode` of a dense codec."""
    _dense(cfg).encode(x, out, residual, residual_out, seed)


def decode_dense(buf: torch.Tensor, numel: int, cfg: CodecConfig, out: torch.Tensor,
                 accumulate: bool = False) -> None:
    """:meth:`WireCodec.decode` of a dense codec."""
    _dense(cfg).decode(buf, numel, out, accumulate)


def _topk(cfg: CodecConfig) -> TopkCodec:
    codec = codec_for(cfg)
    if not isinstance(codec, TopkCodec):
        raise ValueError(f"{cfg.codec} is not top-k")
    return codec


def topk_nbytes(numel: int, cfg: CodecConfig) -> int:
    """Bytes of one rank's top-k message for a tensor of ``numel`` elements: values then indices."""
    return _topk(cfg).nbytes(numel)


def encode_topk(v: torch.Tensor, cfg: CodecConfig, out: torch.Tensor,
                seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`TopkCodec.select`."""
    return _topk(cfg).select(v, out, seed)


def decode_topk_add(buf: torch.Tensor, numel: int, cfg: CodecConfig, out: torch.Tensor) -> torch.Tensor:
    """:meth:`TopkCodec.add_to`."""
    return _topk(cfg).add_to(buf, numel, out)


def encode_topk_ef(x: torch.Tensor, cfg: CodecConfig, out: torch.Tensor, residual: torch.Tensor | None = None,
                   seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """:meth:`TopkCodec.encode_rest`: the message of ``x + residual``, and ``(rest, finite)``."""
    return _topk(cfg).encode_rest(x, out, residual, seed)


# -- planning helpers -------------------------------------------------------------------------------
def _dense_rank_bytes(numel: int, cfg: CodecConfig, world_size: int) -> float:
    return 2.0 * (world_size - 1) / world_size * chunk_nbytes(numel, cfg)


def effective_config(cfg: CodecConfig, numel: int, world_size: int, shape=None) -> CodecConfig:
    """The codec a layer really uses at ``world_size`` (:meth:`WireCodec.effective`): top-k falls back
    to its dense codec where its all_gather traffic ((W-1) messages per rank) would exceed a
    scatter-reduce-allgather's; low-rank to fp32 for a tensor whose ``shape`` (None: unknown, a flat
    vector) it cannot compress with gain."""
    return codec_for(cfg).effective(numel, world_size, shape)


def wire_bytes(numel: int, cfg: CodecConfig, world_size: int, shape=None) -> int:
    """Codec bytes this rank sends per step for one tensor (``state.stats()['bytes_sent']`` counts
    these plus the 64-byte header of each message). A low-rank layer's (``shape`` given): its factors'
    share of the bucket's two factor rounds."""
    if world_size <= 1:
        return 0
    cfg = effective_config(cfg, numel, world_size, shape)
    codec = codec_for(cfg)
    if codec.lowrank:
        return int(round(sum(codec.factor_round_bytes(n, world_size) for n in codec.factor_numels(shape))))
    if is_sparse(cfg):
        return (world_size - 1) * chunk_nbytes(numel, cfg)
    return int(round(_dense_rank_bytes(numel, cfg, world_size)))


def reduce_scatter_bytes(chunk_numels: list[int], cfg: CodecConfig, rank: int | None = None) -> int:
    """Bytes one rank sends for one tensor in a compressed reduce-scatter whose chunk ``j`` (the part
    rank ``j`` owns) has ``chunk_numels[j]`` elements: every chunk but its own (``rank``; None: the
    mean over ranks), each encoded on its own."""
    sizes = [chunk_nbytes(n, cfg) for n in chunk_numels]
    if rank is not None:
        return sum(sizes) - sizes[rank]
    W = len(sizes)
    return int(round(sum(sizes) * (W - 1) / W)) if W else 0


@torch.no_grad()
def roundtrip(x: torch.Tensor, cfg: CodecConfig, seed: int = 0) -> tuple[torch.Tensor, int]:
    """Encode and decode one tensor locally: ``(decoded fp32 tensor shaped like x, encoded bytes)``.

    No error feedback and no communication: this measures the codec's own error on a real gradient.
    A low-rank codec approximates ``x`` viewed as a matrix (:func:`fastml_strategy._lowrank.
    low_rank_roundtrip`); a tensor it does not compress takes its fallback, fp32.
    """
    codec = codec_for(cfg)
    if codec.lowrank and codec.compressible(tuple(x.shape)):
        from fastml_strategy._lowrank import low_rank_roundtrip

        m, n = codec.factor_numels(tuple(x.shape))
        nbytes = sum(4 * k if codec.factor is None else chunk_nbytes(k, codec.factor) for k in (m, n))
        return low_rank_roundtrip(x, cfg.rank, seed=seed), nbytes
    flat = x.detach().reshape(-1).to(torch.float32)
    n = flat.numel()
    out = torch.zeros(n, dtype=torch.float32, device=flat.device)
    nbytes = codec.nbytes(n)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=flat.device)
    codec.encode(flat, buf, seed=seed)
    codec.decode(buf, n, out)
    return out.view_as(x), nbytes
