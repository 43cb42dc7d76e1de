"""The compiled CPU path of the quantization codec: ``quantize_cpu.cpp``, built on first use.

Why compiled: on one thread, pure eager torch makes a dozen passes over memory (convert, add, min/max,
subtract, scale, round, clamp, pack, decode, subtract...), each a full read and write of the tensor,
and tops out near 0.5 GB/s for int4 with error feedback, where the memory limit is about 2.7 GB/s.
The C++ kernel does the whole encode in one pass over memory (each block of 512 is processed in L1),
with explicit SIMD for AVX2 (AVX-512 machines too), SSE2 (any x86-64) and NEON (aarch64) and a
scalar fallback, so it runs at a large fraction of the memory bandwidth on every build (see
``benchmarks/RESULTS.md``).

How it is built: plain C ABI (no torch headers, no ninja, no Python.h), compiled with the system's
C++ compiler (``$CXX``, else ``g++``, else ``c++``) as
``-O3 -march=native -ffp-contract=off -fno-fast-math -fno-trapping-math`` into a cache directory
(``$FASTML_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastml_strategy``, else ``~/.cache/fastml_strategy``),
keyed by a hash of the source, the flags, the compiler's version and the CPU's model and flags (the
``-march=native`` build of one machine never runs on another), and loaded with ctypes, which releases
the GIL during a call. Compiling takes about 2 s, once per machine. Several processes compiling at
once are safe (each writes a private file, then renames it into place).

Builds: ``FASTML_CPU_MARCH`` (default ``native``) chooses ``-march``: ``x86-64-v3`` is what an
AVX2-only machine runs, ``x86-64`` the SSE2 baseline, and ``generic`` the scalar kernels (no explicit
SIMD, the compiler's default target). A build this CPU cannot run (``x86-64-v3`` without AVX2, say)
is refused rather than loaded. :func:`use_build` switches the builds in one process (the tests and
``benchmarks/bench_codecs.py`` run native and AVX2-only side by side); :func:`build_info` says which
instruction set a build uses.

Bit-exact with the reference: the same IEEE fp32 operations in the same order, and
``-ffp-contract=off`` so no multiply-add is fused.

Fallback: if compiling or loading fails, :func:`available` returns False after warning once, and the
dispatcher uses the torch reference. ``FASTML_CPU_KERNEL=0`` forces the reference without trying.
``FASTML_CPU_THREADS`` sets the threads one call may use (default: ``torch.get_num_threads()``,
at most one per 256 Ki elements).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from fastml_strategy.kernels.reference import HASH_GOLDEN, num_blocks, packed_nbytes

__all__ = [
    # the codec
    "quantize",
    "dequantize",
    "reduce_quantize",
    "has_reduce",
    "native_bf16_residual",
    # the build
    "available",
    "build_info",
    # tests and benchmarks: one process runs several builds (e.g. native and AVX2-only)
    "use_build",
    "local_builds",
]

_SRC = Path(__file__).with_name("quantize_cpu.cpp")
# -ffp-contract=off: no fused multiply-add (bit-exactness). -fno-trapping-math changes no value, only
# whether FP exception flags may be raised: without it gcc does not vectorise the scalar build's clamp.
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-std=c++17",
          "-shared", "-fPIC", "-pthread")


# The scalar kernels: no -march (the compiler's default target) and no explicit SIMD.
_GENERIC = "generic"
# What each x86-64 micro-architecture level needs from /proc/cpuinfo (so a build this CPU cannot run is
# refused instead of dying on an illegal instruction). Other -march values are taken on trust.
_LEVEL_FLAGS = {
    "x86-64": (),
    "x86-64-v2": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"),
    "x86-64-v3": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1", "bmi2",
                  "f16c", "fma", "abm", "movbe", "xsave"),
    "x86-64-v4": ("cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3", "avx", "avx2", "bmi1", "bmi2",
                  "f16c", "fma", "abm", "movbe", "xsave", "avx512f", "avx512bw", "avx512cd", "avx512dq",
                  "avx512vl"),
}


def _default_march() -> str:
    return os.environ.get("FASTML_CPU_MARCH", "native").strip() or "native"


def _check_march(march: str) -> str:
    if not march or not all(c.isalnum() or c in "-_." for c in march):
        raise RuntimeError(f"{march!r} (FASTML_CPU_MARCH or use_build) is not a -march value: use e.g. "
                           f"native, x86-64-v3, or {_GENERIC!r} for the scalar kernels")
    return march


def _flags(march: str | None = None) -> tuple:
    """The compiler flags for ``-march=march`` (default ``FASTML_CPU_MARCH``, else ``native``;
    ``x86-64-v3`` builds for any AVX2 machine, so an AVX-512 machine can measure what AVX2-only users
    get; ``generic``: the scalar kernels for the compiler's default target)."""
    march = _check_march(_default_march() if march is None else march)
    if march == _GENERIC:
        return tuple(f for f in _FLAGS if f != "-march=native") + ("-DFASTML_CPU_SCALAR=1",)
    return tuple(f"-march={march}" if f == "-march=native" else f for f in _FLAGS)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _missing_features(march: str) -> list[str]:
    """CPU features that ``-march=march`` needs and this machine lacks (empty when it can run it, or
    when that cannot be told)."""
    need = _LEVEL_FLAGS.get(march)
    if not need or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    have = _cpu_flags()
    return [f for f in need if f not in have] if have else []


def local_builds() -> list[str]:
    """The builds worth testing and benchmarking on this machine: ``native``, and on x86-64 also
    ``x86-64-v3`` (AVX2-only, when this CPU can run it), ``x86-64`` (SSE2) and ``generic`` (scalar);
    elsewhere ``native`` and ``generic``."""
    if platform.machine().lower() in ("x86_64", "amd64"):
        builds = ["native", "x86-64-v3", "x86-64", _GENERIC]
    else:
        builds = ["native", _GENERIC]
    return [b for b in builds if not _missing_features(b)]


_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_MIN_ELEMS_PER_THREAD = 1 << 18

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None  # the default build (FASTML_CPU_MARCH), or None if it failed
_tried = False
_info: dict = {}
_other: dict[str, tuple[ctypes.CDLL, dict]] = {}  # builds loaded by use_build, by -march value
_override: ctypes.CDLL | None = None  # set inside use_build


def _enabled() -> bool:
    return os.environ.get("FASTML_CPU_KERNEL", "1").strip().lower() not in ("0", "false", "no", "off")


def _cache_dir() -> Path:
    if os.environ.get("FASTML_CACHE_DIR"):
        base = Path(os.environ["FASTML_CACHE_DIR"])
    elif os.environ.get("XDG_CACHE_HOME"):
        base = Path(os.environ["XDG_CACHE_HOME"]) / "fastml_strategy"
    else:
        base = Path.home() / ".cache" / "fastml_strategy"
    return base / "kernels"


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if cand and shutil.which(cand):
            return cand
    return None


def _cpu_id() -> str:
    parts = [platform.machine()]
    try:
        with open("/proc/cpuinfo") as f:
            seen = set()
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
                    seen.add(key)
                    parts.append(line.strip())
    except OSError:
        parts.append(platform.processor())
    return "\n".join(parts)


def _build(march: str | None = None, info: dict | None = None, source: Path | None = None) -> ctypes.CDLL:
    """Compile (or take from the cache) and load the build for ``march`` of ``source`` (default: this
    package's ``quantize_cpu.cpp``); fills ``info``."""
    info = _info if info is None else info
    source = _SRC if source is None else Path(source)
    march = _check_march(_default_march() if march is None else march)
    missing = _missing_features(march)
    if missing:
        raise RuntimeError(f"-march={march} needs CPU features this machine lacks ({', '.join(missing)}), so "
                           "its code would die on an illegal instruction; unset FASTML_CPU_MARCH (native)")
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (tried $CXX, g++, c++, clang++)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    src = source.read_bytes()
    flags = _flags(march)
    key = hashlib.sha256(b"\0".join([src, " ".join(flags).encode(), version.encode(),
                                     _cpu_id().encode()])).hexdigest()[:20]
    out_dir = _cache_dir()
    lib_path = out_dir / f"quantize_cpu-{key}.so"
    info.update(compiler=cxx, march=march, flags=" ".join(flags), source=str(source), path=str(lib_path),
                cached=lib_path.exists(), compile_s=0.0)
    if not lib_path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            t0 = time.perf_counter()
            proc = subprocess.run([cxx, *flags, "-o", tmp, str(source)], capture_output=True, text=True,
                                  timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cxx} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
            info["compile_s"] = time.perf_counter() - t0
            os.replace(tmp, lib_path)  # atomic: concurrent builders (DDP ranks) are safe
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(lib_path))
    p, i64, i32, u32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_uint32
    lib.fastml_quantize.argtypes = [p, i32, i64, p, p, p, p, i32, i64, i32, u32, i32]
    lib.fastml_quantize.restype = i32
    lib.fastml_dequantize.argtypes = [p, i64, p, i64, i32, i64, p, i32, i32]
    lib.fastml_dequantize.restype = i32
    if hasattr(lib, "fastml_quantize_r"):  # (sources before 2026-12-01 lack it: native_bf16_residual)
        lib.fastml_quantize_r.argtypes = [p, i32, i64, p, p, i32, p, p, i32, i64, i32, u32, i32]
        lib.fastml_quantize_r.restype = i32
    if hasattr(lib, "fastml_reduce_quantize"):  # (sources before 2026-12-01 lack it: has_reduce)
        lib.fastml_reduce_quantize.argtypes = [p, p, p, i32, ctypes.c_float, i64, i32, i64, p, p, i32, u32, i32]
        lib.fastml_reduce_quantize.restype = i32
    lib.fastml_cpu_abi_version.restype = i32
    if lib.fastml_cpu_abi_version() != 2:
        raise RuntimeError("stale library in the cache (ABI version mismatch)")
    if hasattr(lib, "fastml_cpu_isa"):  # (sources before 2026-12 lack it)
        lib.fastml_cpu_isa.restype = ctypes.c_char_p
        info["isa"] = lib.fastml_cpu_isa().decode()
    else:
        info["isa"] = "?"
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _lib = _build()
        except Exception as e:  # noqa: BLE001 - any failure means: use the reference
            _info["error"] = f"{type(e).__name__}: {e}"
            warnings.warn(
                "FastML's compiled CPU codec could not be built, so CPU tensors use the pure-torch "
                f"reference (20x slower or more). This happened because {_info['error']}. Install a C++ "
                "compiler (e.g. `apt-get install g++`) or point $CXX at one; set FASTML_CPU_KERNEL=0 "
                "to use the reference without trying (and without this warning).",
                RuntimeWarning, stacklevel=3)
            _lib = None
        _tried = True
        return _lib


def _active() -> ctypes.CDLL | None:
    """The build this call uses: the one :func:`use_build` selected, else the default."""
    return _override if _override is not None else _load()


def available() -> bool:
    """Whether the compiled CPU path can be used (builds it on the first call unless disabled)."""
    return _enabled() and (_override is not None or _load() is not None)


def build_info(march: str | None = None) -> dict:
    """Compiler, ``march``, ``flags``, ``isa`` (the kernels' instruction set: avx2, sse2, neon or
    scalar), ``source``, library path, whether it came from the cache, compile seconds, or the error.
    ``march``: a build loaded by :func:`use_build` (default: the default build)."""
    if march is not None and march in _other:
        return dict(_other[march][1])
    _load()
    return dict(_info)


@contextlib.contextmanager
def use_build(march: str, source: str | os.PathLike | None = None) -> Iterator[dict]:
    """Within the block, this module (so ``backend="cpu"``) uses the build for ``-march=march``
    (``"native"``, ``"x86-64-v3"``, ``"x86-64"``, ``"generic"`` for the scalar kernels, ...), compiled
    on first use into its own cache entry; yields its :func:`build_info`. ``source``: another version
    of ``quantize_cpu.cpp`` with the same C ABI (e.g. the previous commit's, to measure a change).

    For tests and benchmarks: the switch is process-wide (every thread), and blocks must not overlap
    across threads. Raises ``RuntimeError`` if the build cannot be compiled or this CPU cannot run it.
    """
    global _override
    march = _check_march(march)
    key = march if source is None else f"{march}@{Path(source).resolve()}"
    with _lock:
        if key not in _other:
            info: dict = {}
            lib = _build(march, info, None if source is None else Path(source))
            _other[key] = (lib, info)
        lib, info = _other[key]
    saved, _override = _override, lib
    try:
        yield dict(info)
    finally:
        _override = saved


def _threads(n: int) -> int:
    t = int(os.environ.get("FASTML_CPU_THREADS", "0") or 0) or torch.get_num_threads()
    return max(1, min(t, n // _MIN_ELEMS_PER_THREAD))


def _check(t: torch.Tensor, numel: int, dtype: torch.dtype, name: str) -> None:
    if t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(
            f"{name}: expected a contiguous CPU {dtype} tensor of {numel} elements, got {t.device} "
            f"{t.dtype} {tuple(t.shape)} (contiguous={t.is_contiguous()})")


def quantize(
    x: torch.Tensor,
    bits: int,
    block_size: int = 512,
    stochastic: bool = False,
    seed: int = 0,
    residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    packed_out: torch.Tensor | None = None,
    meta_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compiled twin of :func:`~fastml_strategy.kernels.reference.quantize_reference`."""
    lib = _active()
    if lib is None:
        raise RuntimeError(f"the compiled CPU codec is unavailable: {_info.get('error')}")
    if x.dtype not in _DTYPE_CODE:
        raise TypeError(f"quantize: x is {x.dtype}; the codec takes float32, float16 or bfloat16")
    x = x.reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    n = x.numel()
    nb = num_blocks(n, block_size)
    nbytes = packed_nbytes(n, bits)
    packed = packed_out if packed_out is not None else torch.empty(nbytes, dtype=torch.uint8)
    meta = meta_out if meta_out is not None else torch.empty(nb, 2, dtype=torch.float32)
    _check(packed, nbytes, torch.uint8, "packed_out")
    _check(meta, 2 * nb, torch.float32, "meta_out")
    r_ptr = rout_ptr = None
    r_dtype = torch.float32
    if residual is not None:
        r_dtype = residual.dtype
        if r_dtype == torch.bfloat16 and not hasattr(lib, "fastml_quantize_r"):
            raise ValueError("quantize: this build of the CPU codec takes a float32 residual only")
        _check(residual, n, r_dtype if r_dtype == torch.bfloat16 else torch.float32, "residual")
        r_ptr = residual.data_ptr()
        if residual_out is not None:
            _check(residual_out, n, r_dtype, "residual_out")
            rout_ptr = residual_out.data_ptr()
    seed_s = (int(seed) * HASH_GOLDEN) & 0xFFFFFFFF
    if r_dtype == torch.bfloat16:
        rc = lib.fastml_quantize_r(x.data_ptr(), _DTYPE_CODE[x.dtype], n, r_ptr, rout_ptr, 2, packed.data_ptr(),
                                   meta.data_ptr(), bits, block_size, int(bool(stochastic)), seed_s, _threads(n))
    else:
        rc = lib.fastml_quantize(x.data_ptr(), _DTYPE_CODE[x.dtype], n, r_ptr, rout_ptr, packed.data_ptr(),
                                 meta.data_ptr(), bits, block_size, int(bool(stochastic)), seed_s, _threads(n))
    if rc != 0:
        raise ValueError(f"quantize: invalid arguments (bits={bits}, block_size={block_size}): bits must be "
                         "1-8 and block_size a power of two >= 8")
    return packed, meta


def dequantize(
    packed: torch.Tensor,
    meta: torch.Tensor,
    numel: int,
    bits: int,
    block_size: int = 512,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
) -> torch.Tensor:
    """Compiled twin of :func:`~fastml_strategy.kernels.reference.dequantize_reference`."""
    if out is None:
        out = (torch.zeros if accumulate else torch.empty)(numel, dtype=torch.float32)
    _check(out, numel, torch.float32, "out")
    _decode(packed, meta, numel, bits, block_size, out, 1 if accumulate else 0)
    return out


def _decode(packed, meta, numel, bits, block_size, out, mode):
    lib = _active()
    if lib is None:
        raise RuntimeError(f"the compiled CPU codec is unavailable: {_info.get('error')}")
    if numel == 0:
        return
    packed = packed.reshape(-1).contiguous()
    meta = meta.reshape(-1).to(torch.float32).contiguous()
    nb = num_blocks(numel, block_size)
    if meta.numel() != 2 * nb or packed.numel() < packed_nbytes(numel, bits) or packed.dtype != torch.uint8:
        raise ValueError(
            f"dequantize: {numel} elements of {bits} bits in blocks of {block_size} need "
            f"{packed_nbytes(numel, bits)} uint8 payload bytes and {nb}x2 metadata; got {packed.numel()} "
            f"{packed.dtype} and {meta.numel()} metadata values")
    rc = lib.fastml_dequantize(packed.data_ptr(), packed.numel(), meta.data_ptr(), numel, bits, block_size,
                               out.data_ptr(), mode, _threads(numel))
    if rc != 0:
        raise ValueError(f"dequantize: invalid arguments (bits={bits}, block_size={block_size})")


def native_bf16_residual() -> bool:
    """Whether the build in use reads and writes a bf16 residual itself (:func:`quantize` with a
    bfloat16 ``residual``: 2 bytes read and 2 written per element instead of 4 and 4); an older source
    given to :func:`use_build` may not."""
    lib = _active()
    return lib is not None and hasattr(lib, "fastml_quantize_r")


def has_reduce() -> bool:
    """Whether the build in use has the fused reduce (:func:`reduce_quantize`); an older source given
    to :func:`use_build` may not."""
    lib = _active()
    return lib is not None and hasattr(lib, "fastml_reduce_quantize")


def reduce_quantize(
    sources: list[tuple[torch.Tensor, torch.Tensor]],
    numel: int,
    bits: int,
    block_size: int,
    divisor: float,
    stochastic: bool,
    seed: int,
    packed_out: torch.Tensor,
    meta_out: torch.Tensor,
) -> None:
    """Compiled twin of :func:`fastml_strategy.kernels.reduce_quantize`: the ``(packed, meta)``
    messages of ``sources`` (``numel`` elements each) decoded, summed in order, divided by ``divisor``
    and quantized into ``packed_out`` / ``meta_out``, in one pass over each block."""
    lib = _active()
    if lib is None or not hasattr(lib, "fastml_reduce_quantize"):
        raise RuntimeError("the compiled CPU codec in use has no fused reduce (see has_reduce())")
    nb = num_blocks(numel, block_size)
    nbytes = packed_nbytes(numel, bits)
    _check(packed_out, nbytes, torch.uint8, "packed_out")
    _check(meta_out, 2 * nb, torch.float32, "meta_out")
    if numel == 0:
        return
    n = len(sources)
    packed_ptrs = (ctypes.c_void_p * n)()
    avail = (ctypes.c_int64 * n)()
    meta_ptrs = (ctypes.c_void_p * n)()
    keep = []  # contiguous copies, alive until the call returns
    for i, (packed, meta) in enumerate(sources):
        packed = packed.reshape(-1).contiguous()
        meta = meta.reshape(-1).to(torch.float32).contiguous()
        if packed.dtype != torch.uint8 or packed.numel() < nbytes or meta.numel() != 2 * nb:
            raise ValueError(
                f"reduce_quantize: source {i}: {numel} elements of {bits} bits in blocks of {block_size} "
                f"need {nbytes} uint8 payload bytes and {nb}x2 metadata; got {packed.numel()} "
                f"{packed.dtype} and {meta.numel()} metadata values")
        keep.append((packed, meta))
        packed_ptrs[i], avail[i], meta_ptrs[i] = packed.data_ptr(), packed.numel(), meta.data_ptr()
    seed_s = (int(seed) * HASH_GOLDEN) & 0xFFFFFFFF
    rc = lib.fastml_reduce_quantize(packed_ptrs, avail, meta_ptrs, n, float(divisor), numel, bits, block_size,
                                    packed_out.data_ptr(), meta_out.data_ptr(), int(bool(stochastic)), seed_s,
                                    _threads(numel))
    if rc != 0:
        raise ValueError(f"reduce_quantize: invalid arguments (bits={bits}, block_size={block_size}, "
                         f"{n} sources)")
