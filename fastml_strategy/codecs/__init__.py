"""Codecs: how one flat gradient tensor travels. One module per codec, behind one registry.

A codec is a module of this package (:mod:`~fastml_strategy.codecs.plain` for fp32/fp16/bf16,
:mod:`~fastml_strategy.codecs.quantize`, :mod:`~fastml_strategy.codecs.topk`,
:mod:`~fastml_strategy.codecs.lowrank`, :mod:`~fastml_strategy.codecs.fp8`) that defines its settings,
a :class:`CodecConfig` subclass with only the fields it reads, and its class, a :class:`WireCodec`
subclass registered with ``@register_codec("name")`` (:mod:`fastml_strategy.codecs._base` says how).
:func:`codec_for` gives the instance for a settings object (the class bound to those settings). The
class is everything FastML knows about that codec:

- its settings class (``settings``), its named recipes (``recipes``: ``RECIPES`` and
  ``Plan.from_recipe``), the autotuner's options (``candidates``) and uniform baselines
  (``uniform``), whether FSDP/HSDP run it (``sharded``) and whether it may carry the hop inside a
  machine (``intra_node``);
- its policy: the codec a layer really takes at a world size or shape (``effective``: top-k's fallback
  to quantize, low-rank's to fp32), the bytes a rank sends for a layer (``rank_bytes``), the
  fraction of entries a message carries (``density``), the dtype it travels in for 16-bit gradients
  (``wire_config``), whether it is ``lossy`` and whether it can keep an ``error_feedback`` residual;
- its wire format: where a chunk may end (``chunk_unit``), a chunk's encoded size (``nbytes``, a
  multiple of 4, so that the next part of a shared message buffer stays aligned) and the split of an
  encoded chunk into block metadata and codes (``split``);
- its work on one chunk, through its kernel: ``encode`` (with error feedback when a residual is
  given), ``decode`` (stored or added), ``reduce`` (the reduce step of scatter-reduce-allgather:
  decode the ranks' messages, sum, divide, re-encode), ``finite`` (whether an encoded chunk decodes to
  finite values, read from the metadata where there is some) and ``roundtrip`` (the autotuner's local
  measure of its error);
- how ranks combine it (``sparse``): dense codecs encode every element, so a chunk can be decoded,
  summed with the other ranks' chunks and re-encoded (scatter-reduce-allgather); top-k messages are
  all-gathered and scatter-added by every rank, in rank order (:mod:`fastml_strategy.collective`);
- whether it has a kernel that encodes or decodes many chunks in one launch (``segment_tables``:
  quantize, through Triton), and the autotuner's name for the codec time it measures (``family``).

Adding a codec: its module in this package (found and imported on import, after the four modules
above, which keep the order of the release before the registry), its kernel, example settings in
tests/test_codec_contract.py's ``EXAMPLES``, and its digests (``python tests/test_wire_digests.py
--regenerate``); nothing else. The contract tests then run over it (round trip, zeros, NaN/inf,
pickling, a 2-rank all-reduce and reduce-scatter), plans take ``{"codec": "name"}`` and its recipes,
and the autotuner searches its candidates. docs/architecture.md has the steps and how
:data:`WIRE_FORMAT_VERSION` relates to a new codec.

The wire interface (``encode_chunk``, ``chunk_nbytes``, ``wire_bytes``, ``roundtrip``...) is in
:mod:`fastml_strategy.codecs._wire`; callers reach it as attributes of this package.
"""

from __future__ import annotations

import importlib
import pkgutil

from fastml_strategy.codecs._base import (DEFAULT_BLOCK_SIZE, RECIPES, RESIDUAL_DTYPES, WIRE_FORMAT_VERSION, Codec,
                                          CodecConfig, ResidualConfig, WireCodec, candidates, codec_class, codec_for,
                                          check_recipes, register_codec, registered_codecs, settings_class,
                                          uniform_recipes)
# The codecs, in registration order (the order of RECIPES, of the autotuner's options and baselines).
from fastml_strategy.codecs.plain import Bf16Codec, Bf16Config, Fp16Codec, Fp16Config, Fp32Codec, Fp32Config
from fastml_strategy.codecs.quantize import QuantizeCodec, QuantizeConfig
from fastml_strategy.codecs.topk import TopkCodec, TopkConfig, select_topk
from fastml_strategy.codecs.lowrank import LowRankCodec, LowRankConfig
# Every other codec module of this package registers itself on import, in name order: a new codec is
# its module, with no line to add here (fastml_strategy.codecs.fp8 is the example).
_BUILT_IN = {"plain", "quantize", "topk", "lowrank"}
for _m in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _m.startswith("_") and _m not in _BUILT_IN:
        importlib.import_module(f"{__name__}.{_m}")
from fastml_strategy.codecs._wire import (chunk_finite, chunk_nbytes, chunk_unit, decode_chunk, decode_dense,
                                          decode_topk_add, dense_nbytes, effective_config, encode_chunk,
                                          encode_dense, encode_topk, encode_topk_ef, is_sparse, reduce_chunk,
                                          reduce_scatter_bytes, roundtrip, topk_nbytes, wire_bytes, wire_config)

__all__ = [
    # the registry
    "WIRE_FORMAT_VERSION",
    "Codec",
    "CodecConfig",
    "ResidualConfig",
    "WireCodec",
    "register_codec",
    "codec_class",
    "codec_for",
    "settings_class",
    "registered_codecs",
    "RECIPES",
    "candidates",
    "uniform_recipes",
    "check_recipes",
    # the codecs and their settings
    "Fp32Codec", "Fp32Config",
    "Fp16Codec", "Fp16Config",
    "Bf16Codec", "Bf16Config",
    "QuantizeCodec", "QuantizeConfig",
    "TopkCodec", "TopkConfig",
    "LowRankCodec", "LowRankConfig",
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
