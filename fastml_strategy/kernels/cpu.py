"""The compiled CPU path of the quantization codec: ``quantize_cpu.cpp`` as torch operators, built on first use.

Why compiled: on one thread, pure eager torch makes a dozen passes over memory (convert, add, min/max,
subtract, scale, round, clamp, pack, decode, subtract...), each a full read and write of the tensor,
and tops out near 0.5 GB/s for int4 with error feedback, where the memory limit is about 2.7 GB/s.
The C++ kernel does the whole encode in one pass over memory (each block of 512 is processed in L1),
with explicit SIMD for AVX2 (AVX-512 machines too), SSE2 (any x86-64) and NEON (aarch64) and a
scalar fallback, so it runs at a large fraction of the memory bandwidth on every build (see
``benchmarks/RESULTS.md``).

How it is built: ``quantize_cpu.cpp`` (the kernels, plain C++ with a C ABI and no torch headers) and
``quantize_cpu_op.cpp`` (the kernels as torch operators, ``torch.library``'s ``fastml::quantize``,
``fastml::dequantize`` and ``fastml::reduce_quantize``, so torch.compile, the profiler and TorchScript see
them) are compiled by ``torch.utils.cpp_extension.load`` (ninja; the compiler ``$CXX``, else ``g++``,
else ``c++``) with ``-O3 -march=native -ffp-contract=off -fno-fast-math -fno-trapping-math`` into a cache
directory (``$FASTML_CACHE_DIR``, else ``$XDG_CACHE_HOME/fastml_strategy``, else
``~/.cache/fastml_strategy``), one build directory per hash of both sources, the flags, the compiler's
version, the CPU's model and flags (the ``-march=native`` build of one machine never runs on another)
and torch's version (the operators are compiled against its headers), and loaded with
``torch.ops.load_library``. Calling an operator releases the GIL, as the ctypes call before it did.
The first build takes about 15-20 s of CPU (torch's headers; the kernels alone compile in 2-7 s), once
per machine; several processes building at once (DDP ranks) take turns on cpp_extension's lock file and
load the one result. Building at first use rather than at install: an install-time build would need
torch inside pip's isolated build environment (a second, possibly different torch, whose ABI the
library must match) and cannot use ``-march=native`` for a wheel built elsewhere; ``import
fastml_strategy`` builds nothing (the first CPU encode does).

Builds: ``FASTML_CPU_MARCH`` (default ``native``) chooses ``-march``: ``x86-64-v3`` is what an
AVX2-only machine runs, ``x86-64`` the SSE2 baseline, and ``generic`` the scalar kernels (no explicit
SIMD, the compiler's default target). A build this CPU cannot run (``x86-64-v3`` without AVX2, say)
is refused rather than loaded. :func:`use_build` switches the builds in one process (the tests and
``benchmarks/bench_codecs.py`` run native and AVX2-only side by side); :func:`build_info` says which
instruction set a build uses.

Bit-exact with the reference: the same IEEE fp32 operations in the same order, and
``-ffp-contract=off`` so no multiply-add is fused.

Fallback: if compiling or loading fails (no compiler, no ninja, a compile error), :func:`available`
returns False after warning once, with the reason, and the dispatcher uses the torch reference.
``FASTML_CPU_KERNEL=0`` forces the reference without trying. ``FASTML_CPU_THREADS`` sets the threads
one call may use (default: ``torch.get_num_threads()``, at most one per 256 Ki elements).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch

from fastml_strategy.kernels.reference import seed_word

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
    "ops",
    # tests and benchmarks: one process runs several builds (e.g. native and AVX2-only)
    "use_build",
    "local_builds",
]

_SRC = Path(__file__).with_name("quantize_cpu.cpp")
_OP_SRC = Path(__file__).with_name("quantize_cpu_op.cpp")  # the torch operators around the kernels
# -ffp-contract=off: no fused multiply-add (bit-exactness). -fno-trapping-math changes no value, only
# whether FP exception flags may be raised: without it gcc does not vectorise the scalar build's clamp.
# (torch.utils.cpp_extension adds -fPIC, -std=c++20 and torch's include paths; tests/kernels/codec_digest.cpp
# compiles the kernel alone with these.)
_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-pthread")


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


_MIN_ELEMS_PER_THREAD = 1 << 18

_lock = threading.Lock()
_lib: _Build | None = None  # the default build (FASTML_CPU_MARCH), or None if it failed
_tried = False
_info: dict = {}
_other: dict[str, "_Build"] = {}  # builds loaded by use_build, by -march value (and source)
_override: "_Build | None" = None  # set inside use_build
_faked: set[str] = set()  # operator namespaces whose fake implementations are registered


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


class _Build(NamedTuple):
    """One loaded build: its operators (``torch.ops.<namespace>``), its :func:`build_info`, and which
    entry points its kernel source has (an older source given to :func:`use_build` may lack some)."""

    ops: object
    info: dict
    bf16_residual: bool
    reduce: bool


def _build(march: str | None = None, info: dict | None = None, source: Path | None = None,
           namespace: str = "fastml") -> _Build:
    """Compile (or take from the cache) and load the build for ``march`` of ``source`` (default: this
    package's ``quantize_cpu.cpp``), its operators in ``torch.ops.<namespace>``; fills ``info``."""
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
    from torch.utils import cpp_extension  # (imports setuptools: only here, at the first build)

    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not installed, and torch.utils.cpp_extension builds with it "
                           "(`pip install ninja`)")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    flags = (*_flags(march), f"-DFASTML_OP_NAMESPACE={namespace}")
    key = hashlib.sha256(b"\0".join([source.read_bytes(), _OP_SRC.read_bytes(), " ".join(flags).encode(),
                                     version.encode(), _cpu_id().encode(), torch.__version__.encode()])
                         ).hexdigest()[:20]
    name = f"fastml_cpu_{key}"
    build_dir = _cache_dir() / name
    lib_path = build_dir / f"{name}.so"
    info.update(compiler=cxx, march=march, flags=" ".join(flags), source=str(source), path=str(lib_path),
                cached=lib_path.exists(), compile_s=0.0, namespace=namespace)
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with _cxx_env(cxx), _build_lock(build_dir):  # cpp_extension compiles with $CXX (else c++)
        srcs = [_source_copy(build_dir, "op.cpp", _OP_SRC), _source_copy(build_dir, "kernel.cpp", source)]
        cpp_extension.load(name, srcs, extra_cflags=list(flags),
                           extra_ldflags=["-pthread", "-Wl,-Bsymbolic"], build_directory=str(build_dir),
                           is_python_module=False, verbose=False)
    if not info["cached"]:
        info["compile_s"] = time.perf_counter() - t0
    ops = getattr(torch.ops, namespace)
    if ops.abi_version() != 2:
        raise RuntimeError(f"{lib_path}: the kernel's ABI version is {ops.abi_version()}, not 2")
    features = ops.features()
    info["isa"] = ops.isa()
    if namespace not in _faked:  # (a retried load finds the library loaded, its operators registered)
        for op in ("quantize", "dequantize", "reduce_quantize"):  # they write into their arguments: no output
            torch.library.register_fake(f"{namespace}::{op}")(_no_output)
        _faked.add(namespace)
    return _Build(ops, info, bool(features & 1), bool(features & 2))


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Processes building (or loading) one build take turns on an ``flock`` of the build folder,
    which the system releases when its holder dies. Holding it, a ``lock`` file that
    ``cpp_extension.load`` left there is stale: its writer was killed mid-build (a timeout, Ctrl-C)
    and every later load would wait on it forever, the library long built (torch's ``FileBaton``
    has no owner to check)."""
    import fcntl

    with open(build_dir / ".fastml.flock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _source_copy(build_dir: Path, name: str, source: Path) -> str:
    """``source`` copied into the build folder (the folder's name hashes the sources' bytes): the
    build file then names the same paths from every checkout, so a second checkout of the same code
    loads the build instead of compiling it again."""
    dst = build_dir / name
    data = source.read_bytes()
    if not dst.exists() or dst.read_bytes() != data:
        tmp = dst.with_name(f".{name}.{os.getpid()}")
        tmp.write_bytes(data)
        os.replace(tmp, dst)
    return str(dst)


def _no_output(*args, **kwargs) -> None:
    """The operators' fake (meta) implementation for torch.compile: they return nothing."""


@contextlib.contextmanager
def _cxx_env(cxx: str) -> Iterator[None]:
    saved = os.environ.get("CXX")
    os.environ["CXX"] = cxx
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CXX"]
        else:
            os.environ["CXX"] = saved


def _load() -> _Build | None:
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        try:
            _lib = _build()
        except Exception as e:  # noqa: BLE001 - any failure means: use the reference
            _info["error"] = f"{type(e).__name__}: {str(e).strip()[-800:]}"
            warnings.warn(
                "FastML's compiled CPU codec could not be built, so CPU tensors use the pure-torch "
                f"reference (20x slower or more). This happened because {_info['error']}. Install a C++ "
                "compiler (e.g. `apt-get install g++`) or point $CXX at one, and ninja (`pip install ninja`); "
                "set FASTML_CPU_KERNEL=0 to use the reference without trying (and without this warning).",
                RuntimeWarning, stacklevel=3)
            _lib = None
        _tried = True
        return _lib


def _active() -> _Build | None:
    """The build this call uses: the one :func:`use_build` selected, else the default."""
    return _override if _override is not None else _load()


def _require() -> _Build:
    b = _active()
    if b is None:
        raise RuntimeError(f"the compiled CPU codec is unavailable: {_info.get('error')}")
    return b


def available() -> bool:
    """Whether the compiled CPU path can be used (builds it on the first call unless disabled)."""
    return _enabled() and (_override is not None or _load() is not None)


def build_info(march: str | None = None) -> dict:
    """Compiler, ``march``, ``flags``, ``isa`` (the kernels' instruction set: avx2, sse2, neon or
    scalar), ``source``, library path, the operators' ``namespace``, whether it came from the cache,
    compile seconds, or the error. ``march``: a build loaded by :func:`use_build` (default: the default
    build)."""
    if march is not None and march in _other:
        return dict(_other[march].info)
    _load()
    return dict(_info)


def ops() -> object:
    """The operators of the build in use (``torch.ops.fastml`` for the default build): ``quantize``,
    ``dequantize``, ``reduce_quantize`` (see ``quantize_cpu_op.cpp`` for their schemas), ``isa``,
    ``features``. Raises ``RuntimeError`` when the compiled path is unavailable."""
    return _require().ops


@contextlib.contextmanager
def use_build(march: str, source: str | os.PathLike | None = None) -> Iterator[dict]:
    """Within the block, this module (so ``backend="cpu"``) uses the build for ``-march=march``
    (``"native"``, ``"x86-64-v3"``, ``"x86-64"``, ``"generic"`` for the scalar kernels, ...), compiled
    on first use into its own cache entry, its operators in a namespace of their own
    (``torch.ops.fastml_<march>_<n>``; the default build's are ``torch.ops.fastml``); yields its
    :func:`build_info`. ``source``: another version of ``quantize_cpu.cpp`` with the same C ABI (e.g.
    the previous commit's, to measure a change).

    For tests and benchmarks: the switch is process-wide (every thread), and blocks must not overlap
    across threads. Raises ``RuntimeError`` if the build cannot be compiled or this CPU cannot run it.
    """
    global _override
    march = _check_march(march)
    key = march if source is None else f"{march}@{Path(source).resolve()}"
    if source is None and march == _default_march() and _load() is not None:
        build = _lib  # the default build itself: no second compile of the same code
    else:
        with _lock:
            if key not in _other:
                namespace = f"fastml_{march.replace('-', '_').replace('.', '_')}_{len(_other)}"
                info: dict = {}
                _other[key] = _build(march, info, None if source is None else Path(source), namespace)
            build = _other[key]
    saved, _override = _override, build
    try:
        yield dict(build.info)
    finally:
        _override = saved


def _threads(n: int) -> int:
    t = int(os.environ.get("FASTML_CPU_THREADS", "0") or 0) or torch.get_num_threads()
    return max(1, min(t, n // _MIN_ELEMS_PER_THREAD))


def quantize_into(x, bits, block_size, stochastic, seed, residual, residual_out, packed, meta) -> None:
    """Compiled twin of :func:`~fastml_strategy.kernels.reference.quantize_into` (the protocol of
    :func:`fastml_strategy.kernels._backend`: checked there; ``torch.ops.fastml.quantize``)."""
    b = _require()
    b.ops.quantize(x, bits, block_size, bool(stochastic), seed_word(seed), residual, residual_out, packed, meta,
                   _threads(x.numel()))


def dequantize_into(packed, meta, numel, bits, block_size, out, accumulate) -> None:
    """Compiled twin of :func:`~fastml_strategy.kernels.reference.dequantize_into`
    (``torch.ops.fastml.dequantize``)."""
    b = _require()
    b.ops.dequantize(*_message(packed, meta), numel, bits, block_size, out, bool(accumulate), _threads(numel))


def _message(packed: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A message's payload and metadata as the operators take them: flat, contiguous, fp32 metadata."""
    return packed.reshape(-1).contiguous(), meta.reshape(-1).to(torch.float32).contiguous()


def native_bf16_residual() -> bool:
    """Whether the build in use reads and writes a bf16 residual itself (:func:`quantize` with a
    bfloat16 ``residual``: 2 bytes read and 2 written per element instead of 4 and 4); an older source
    given to :func:`use_build` may not."""
    b = _active()
    return b is not None and b.bf16_residual


def has_reduce() -> bool:
    """Whether the build in use has the fused reduce (:func:`reduce_quantize`); an older source given
    to :func:`use_build` may not."""
    b = _active()
    return b is not None and b.reduce


def reduce_quantize_into(sources, numel, bits, block_size, divisor, stochastic, seed, packed_out, meta_out) -> None:
    """Compiled twin of :func:`fastml_strategy.kernels.reduce_quantize`: the ``(packed, meta)``
    messages of ``sources`` (``numel`` elements each) decoded, summed in order, divided by ``divisor``
    and quantized into ``packed_out`` / ``meta_out``, in one pass over each block
    (``torch.ops.fastml.reduce_quantize``)."""
    b = _require()
    msgs = [_message(p, m) for p, m in sources]
    b.ops.reduce_quantize([p for p, _ in msgs], [m for _, m in msgs], float(divisor), numel, bits, block_size,
                          packed_out, meta_out, bool(stochastic), seed_word(seed), _threads(numel))
