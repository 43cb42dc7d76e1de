"""Encode/decode kernels of FastML's codecs, each beside its pure-torch reference.

``quantize`` / ``dequantize`` implement the wire format documented in
:mod:`fastml_strategy.kernels.reference`; every backend produces exactly the same bytes.

Backends (``backend=``):

- ``None`` (automatic): ``"triton"`` for CUDA tensors when Triton works, ``"cpu"`` for CPU tensors
  when the compiled CPU path is available, else ``"torch"``;
- ``"triton"``: :mod:`~fastml_strategy.kernels.quantize_triton` (CUDA; CPU tensors too under
  ``TRITON_INTERPRET=1``, which the tests use);
- ``"cpu"``: :mod:`~fastml_strategy.kernels.cpu`, a C++ kernel compiled on first use with
  ``torch.utils.cpp_extension`` (about 15-20 s of CPU once per machine, cached) and registered as the
  torch operators ``torch.ops.fastml.quantize`` / ``dequantize`` / ``reduce_quantize``;
  ``FASTML_CPU_KERNEL=0`` disables it;
- ``"torch"``: the pure-torch reference (any device; the test oracle).

Segment tables (Triton only): ``encode_table`` / ``decode_table`` describe many chunks of one
quantization config in a message (laid out as :func:`chunk_layout` says), and ``quantize_segments`` /
``dequantize_segments`` encode or decode them all in one launch, bit for bit what ``quantize`` /
``dequantize`` give chunk by chunk; ``seed_column`` gives a table's seeds for another step.
:class:`fastml_strategy.codecs.QuantizeCodec` is their caller.

Top-k has no kernel here: :mod:`fastml_strategy.codecs` selects with a sampled threshold and decodes
with ``index_add_``, quantizing the selected values with the kernels above. A fused CPU
dequantize + scatter-add decoded a 1%-of-16.8M message in 1.5 ms against 3.2 ms, too little beside
the 42 ms selection to keep a second top-k implementation for.

Not public: the modules' launch constants and private helpers.
"""

from __future__ import annotations

import os

import torch

from fastml_strategy.kernels import reference
from fastml_strategy.kernels.reference import (ChunkLayout, check_args, check_out, chunk_layout, num_blocks, packed_nbytes,
                                               uniform)

__all__ = [
    # codec
    "quantize",
    "dequantize",
    "reduce_quantize",
    "quantize_reference",
    "dequantize_reference",
    # sizes
    "packed_nbytes",
    "num_blocks",
    "ChunkLayout",
    "chunk_layout",
    # segment tables (Triton): many chunks in one launch
    "encode_table",
    "decode_table",
    "seed_column",
    "quantize_segments",
    "dequantize_segments",
    # backends
    "resolve_backend",
    "available_backends",
    # stochastic rounding's counter-based uniform numbers
    "uniform",
]

_BACKENDS = ("torch", "triton", "cpu")
_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_triton_ok: bool | None = None


def _triton_works() -> bool:
    """Triton imports and has an active driver (checked once; never initialises CUDA by itself)."""
    global _triton_ok
    if _triton_ok is None:
        try:
            import triton  # noqa: F401
            from triton.runtime import driver

            driver.active.get_current_device()
            _triton_ok = True
        except Exception:  # noqa: BLE001 - no triton, no driver, no GPU: not usable
            _triton_ok = False
    return _triton_ok


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(t: torch.Tensor, backend: str | None) -> str:
    """The backend that will process ``t``: ``backend`` when given, else the automatic choice."""
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r}; use None (automatic), 'torch', 'cpu' or 'triton'")
    if backend is not None:
        return backend
    if t.is_cuda:
        return "triton" if _triton_works() else "torch"
    if t.device.type == "cpu":
        from fastml_strategy.kernels import cpu

        return "cpu" if cpu.available() else "torch"
    return "torch"


def available_backends(device: str | torch.device = "cpu") -> list[str]:
    """Backends that can run on ``device`` here (``"torch"`` always)."""
    dev = torch.device(device)
    out = ["torch"]
    if dev.type == "cpu":
        from fastml_strategy.kernels import cpu

        if cpu.available():
            out.append("cpu")
        if _interpreting():
            out.append("triton")
    elif dev.type == "cuda" and _triton_works():
        out.append("triton")
    return out


def _backend(be: str):
    """The module of backend ``be``. Each implements one narrow protocol, called with arguments this
    module has checked: ``quantize_into(x, bits, block_size, stochastic, seed, residual, residual_out,
    packed, meta)`` (``x`` flat, contiguous and not empty; the outputs allocated and sized) and
    ``dequantize_into(packed, meta, numel, bits, block_size, out, accumulate)`` (``numel`` > 0)."""
    if be == "triton":
        from fastml_strategy.kernels import quantize_triton

        return quantize_triton
    if be == "cpu":
        from fastml_strategy.kernels import cpu

        return cpu
    return reference


def quantize(
    x: torch.Tensor,
    bits: int,
    block_size: int = 512,
    stochastic: bool = False,
    seed: int = 0,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    backend: str | None = None,
    packed_out: torch.Tensor | None = None,
    meta_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` (fp32/fp16/bf16, flattened) to ``bits`` (1-8) per element, in blocks of
    ``block_size`` (a power of two >= 8).

    Returns ``(packed uint8[packed_nbytes(n, bits)], meta fp32[num_blocks(n, block_size), 2])``.
    With ``residual`` (fp32, n elements): encodes ``x + residual`` and writes the new residual
    (``x + residual - decoded``) to ``residual_out``, default ``residual`` in place; a non-finite block
    leaves its residual unchanged. A bf16 residual is read as fp32 and written rounded to nearest
    even, as ``residual.copy_(fp32 residual)`` would (the compiled CPU path does so in its one pass;
    the others go through an fp32 copy). ``stochastic`` rounds with the counter-based hash of ``seed``
    (same seed, same bytes on every backend). ``packed_out`` / ``meta_out``: contiguous tensors of
    those sizes to write into (e.g. views of a send buffer); they are returned.

    The one signature of the encoder: every backend is reached from here (:func:`_backend`).
    """
    check_args(bits, block_size)
    be = resolve_backend(x, backend)
    if x.dtype not in _KERNEL_DTYPES:
        if backend is None:
            be = "torch"  # e.g. float64: only the reference converts it
        elif be != "torch":
            raise TypeError(f"quantize: x is {x.dtype}; the {be} backend takes float32, float16 or bfloat16")
    if residual is not None and residual.dtype != torch.float32:
        native = be == "cpu" and residual.dtype == torch.bfloat16 and _backend("cpu").native_bf16_residual()
        if not native:  # through an fp32 copy: the same bytes, two more passes over the residual
            r32 = residual.to(torch.float32)
            out = quantize(x, bits, block_size, stochastic, seed, r32, None, be, packed_out, meta_out)
            (residual if residual_out is None else residual_out).copy_(r32)
            return out
    x = x.reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    n, nb, nbytes = x.numel(), num_blocks(x.numel(), block_size), packed_nbytes(x.numel(), bits)
    packed = packed_out if packed_out is not None else torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    meta = meta_out if meta_out is not None else torch.empty(nb, 2, dtype=torch.float32, device=x.device)
    if n == 0:
        return packed, meta
    check_out(packed, nbytes, torch.uint8, "packed_out")
    check_out(meta, 2 * nb, torch.float32, "meta_out")
    _backend(be).quantize_into(x, bits, block_size, stochastic, seed, residual, residual_out, packed, meta)
    return packed, meta


def dequantize(
    packed: torch.Tensor,
    meta: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int = 512,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode ``numel`` fp32 values; into ``out`` (contiguous fp32) when given, added to it when
    ``accumulate`` (the reduce step of scatter-reduce-allgather, with no temporary per peer)."""
    check_args(bits, block_size)
    be = resolve_backend(packed, backend)
    if out is None:
        out = (torch.zeros if accumulate else torch.empty)(numel, dtype=torch.float32, device=packed.device)
    if numel == 0:
        return out
    check_out(out, numel, torch.float32, "out")
    _backend(be).dequantize_into(packed, meta, numel, bits, block_size, out, accumulate)
    return out


def quantize_reference(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize` on the pure-torch reference (``backend="torch"``): the test oracle."""
    return quantize(*args, backend="torch", **kwargs)


def dequantize_reference(*args, **kwargs) -> torch.Tensor:
    """:func:`dequantize` on the pure-torch reference (``backend="torch"``)."""
    return dequantize(*args, backend="torch", **kwargs)


def reduce_quantize(
    sources: list[tuple[torch.Tensor, torch.Tensor]],
    numel: int,
    bits: int,
    block_size: int,
    divisor: float,
    stochastic: bool = False,
    seed: int = 0,
    packed_out: torch.Tensor | None = None,
    meta_out: torch.Tensor | None = None,
    acc: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reduce step of scatter-reduce-allgather: decode the ``(packed, meta)`` messages of
    ``sources`` (``numel`` elements each, ``bits`` per element, blocks of ``block_size``), sum them in
    source order, divide by ``divisor`` and quantize the result (no residual).

    Defined as ``dequantize`` of the first into ``acc``, ``dequantize(accumulate=True)`` of the others,
    ``acc.div_(divisor)`` and ``quantize(acc)``, which is what runs on the torch and Triton backends
    (``acc``: a contiguous fp32 scratch of ``numel`` elements, allocated when not given). The compiled
    CPU backend fuses the four, block by block in L1, into the same bytes without writing the sum.
    Returns ``(packed, meta)``."""
    check_args(bits, block_size)
    if not sources:
        raise ValueError("reduce_quantize: no sources")
    be = resolve_backend(sources[0][0], backend)
    if packed_out is None:
        packed_out = torch.empty(packed_nbytes(numel, bits), dtype=torch.uint8, device=sources[0][0].device)
    if meta_out is None:
        meta_out = torch.empty(num_blocks(numel, block_size), 2, dtype=torch.float32, device=sources[0][0].device)
    if be == "cpu":
        from fastml_strategy.kernels import cpu

        if cpu.has_reduce():
            cpu.reduce_quantize_into(sources, numel, bits, block_size, divisor, stochastic, seed, packed_out,
                                meta_out)
            return packed_out, meta_out
    if acc is None:
        acc = torch.empty(numel, dtype=torch.float32, device=sources[0][0].device)
    for i, (packed, meta) in enumerate(sources):
        dequantize(packed, meta, numel, bits, block_size, out=acc, accumulate=i > 0, backend=be)
    acc.div_(divisor)
    return quantize(acc, bits, block_size, stochastic, seed, backend=be, packed_out=packed_out,
                    meta_out=meta_out)


# -- segment tables (Triton; imported on first use, as Triton must not load with the package) --------------
def encode_table(segments, bits: int, block_size: int, device) -> tuple[torch.Tensor, int]:
    """:func:`fastml_strategy.kernels.quantize_triton.encode_table`."""
    from fastml_strategy.kernels import quantize_triton

    return quantize_triton.encode_table(segments, bits, block_size, device)


def decode_table(segments, bits: int, block_size: int, device) -> tuple[torch.Tensor, int]:
    """:func:`fastml_strategy.kernels.quantize_triton.decode_table`."""
    from fastml_strategy.kernels import quantize_triton

    return quantize_triton.decode_table(segments, bits, block_size, device)


def seed_column(numels, seeds, block_size: int) -> torch.Tensor:
    """:func:`fastml_strategy.kernels.quantize_triton.seed_column`."""
    from fastml_strategy.kernels import quantize_triton

    return quantize_triton.seed_column(numels, seeds, block_size)


def quantize_segments(x: torch.Tensor, msg: torch.Tensor, table: torch.Tensor, g: int, bits: int,
                      block_size: int, stochastic: bool = False, residual: torch.Tensor | None = None,
                      residual_out: torch.Tensor | None = None) -> None:
    """:func:`fastml_strategy.kernels.quantize_triton.quantize_segments`."""
    from fastml_strategy.kernels import quantize_triton

    quantize_triton.quantize_segments(x, msg, table, g, bits, block_size, stochastic, residual, residual_out)


def dequantize_segments(msg: torch.Tensor, out: torch.Tensor, table: torch.Tensor, g: int, bits: int,
                        block_size: int, sources: int = 1, src_stride: int = 0,
                        accumulate: bool = False) -> torch.Tensor:
    """:func:`fastml_strategy.kernels.quantize_triton.dequantize_segments`."""
    from fastml_strategy.kernels import quantize_triton

    return quantize_triton.dequantize_segments(msg, out, table, g, bits, block_size, sources, src_stride,
                                               accumulate)
