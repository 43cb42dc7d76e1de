"""The builds of the compiled CPU codec: each uses the instruction set its -march promises, a build the
CPU cannot run is refused, and every build (here, and aarch64's NEON and scalar builds under qemu
where a cross compiler is installed) writes the same bytes.

The bit-exact tests against the torch reference run once per local build through the ``backend``
fixture (``cpu[native]``, ``cpu[x86-64-v3]``, ...: see conftest.py); this file checks the builds
themselves.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from fastml_strategy.kernels import quantize, quantize_reference

cpu = pytest.importorskip("fastml_strategy.kernels.cpu")
pytestmark = pytest.mark.skipif(not cpu.available(), reason="compiled CPU path unavailable")

X86 = platform.machine().lower() in ("x86_64", "amd64")
DIGEST_SRC = Path(__file__).with_name("codec_digest.cpp")


def _expected_native_isa() -> str:
    flags = cpu._cpu_flags()
    if not X86:
        return "neon" if platform.machine().lower() in ("aarch64", "arm64") else "scalar"
    return "avx2" if "avx2" in flags else "sse2"  # AVX-512 machines run the AVX2 kernels too


def test_each_build_uses_its_instruction_set():
    expected = {"native": _expected_native_isa(), "x86-64-v3": "avx2", "x86-64": "sse2", "generic": "scalar"}
    builds = cpu.local_builds()
    assert "native" in builds and "generic" in builds
    if X86 and "avx2" in cpu._cpu_flags():
        assert "x86-64-v3" in builds  # an AVX-512 or AVX2 machine always measures the AVX2-only build
    for b in builds:
        with cpu.use_build(b) as info:
            assert info["isa"] == expected[b], (b, info)
            assert f"-march={b}" in info["flags"] or b == "generic"
            x = torch.randn(1000)
            p, m = quantize(x, 4, backend="cpu")
            assert torch.equal(p, quantize_reference(x, 4)[0])
    assert cpu.build_info("x86-64-v3" if "x86-64-v3" in builds else "generic")["isa"]


@pytest.mark.skipif(not X86, reason="x86-64 levels")
def test_build_this_cpu_cannot_run_is_refused(monkeypatch):
    """-march=x86-64-v3 on a CPU without AVX2 would die on an illegal instruction: refused instead,
    with the reason, and the default build falls back to the reference with a warning."""
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"sse2", "sse4_2"})
    monkeypatch.setattr(cpu, "_other", {})
    assert cpu.local_builds() == ["native", "x86-64", "generic"]
    with pytest.raises(RuntimeError, match="avx2"):
        with cpu.use_build("x86-64-v3"):
            pass
    monkeypatch.setattr(cpu, "_lib", None)
    monkeypatch.setattr(cpu, "_tried", False)
    monkeypatch.setattr(cpu, "_info", {})
    monkeypatch.setenv("FASTML_CPU_MARCH", "x86-64-v3")
    with pytest.warns(RuntimeWarning, match="lacks"):
        assert not cpu.available()


def test_use_build_restores_the_default():
    default = cpu.build_info()["path"]
    with cpu.use_build("generic"):
        assert cpu._active() is not cpu._load()
    assert cpu._active() is cpu._load() and cpu.build_info()["path"] == default
    with pytest.raises(RuntimeError, match="not a -march value"):
        with cpu.use_build("x86-64; rm -rf /"):
            pass


def _compile(cxx: str, flags: list[str], out: Path) -> None:
    proc = subprocess.run([cxx, *flags, "-o", str(out), str(DIGEST_SRC)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _digest_flags(march: str | None, scalar: bool = False) -> list[str]:
    flags = [f for f in cpu._flags("generic") if f not in ("-shared", "-fPIC", "-DFASTML_CPU_SCALAR=1")]
    if march:
        flags.append(f"-march={march}")
    if scalar:
        flags.append("-DFASTML_CPU_SCALAR=1")
    return flags


@pytest.mark.skipif(not (X86 and shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64")),
                    reason="needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt-get install g++-aarch64-linux-gnu "
                           "qemu-user)")
def test_aarch64_builds_write_the_same_bytes(tmp_path):
    """NEON and scalar aarch64 builds, run under qemu, against this machine's scalar build (which the
    reference tests check): 2304 cases of sizes, block sizes, bits 1-8, fp32/fp16/bf16, residual and
    stochastic rounding, specials, 1 and 3 threads, decode / add, a bf16 residual and the fused
    reduce of three messages."""
    cxx = cpu._compiler()
    jobs = {
        "host": (cxx, _digest_flags(None, scalar=True), None),
        "neon": ("aarch64-linux-gnu-g++", _digest_flags("armv8-a") + ["-static"], "qemu-aarch64"),
        "arm-scalar": ("aarch64-linux-gnu-g++", _digest_flags("armv8-a", scalar=True) + ["-static"], "qemu-aarch64"),
    }
    with ThreadPoolExecutor(3) as pool:
        list(pool.map(lambda kv: _compile(kv[1][0], kv[1][1], tmp_path / kv[0]), jobs.items()))
    outs = {}
    for name, (_cxx, _flags, runner) in jobs.items():
        cmd = ([runner] if runner else []) + [str(tmp_path / name)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
        isa, *lines = proc.stdout.splitlines()
        outs[name] = (isa, lines)
    assert outs["neon"][0] == "isa neon" and outs["arm-scalar"][0] == "isa scalar"
    host = outs["host"][1]
    assert host[-1] == "cases 2304" and all(" rc=0 " in line for line in host[:-1])
    for name in ("neon", "arm-scalar"):
        diff = [(a, b) for a, b in zip(host, outs[name][1]) if a != b]
        assert not diff and len(outs[name][1]) == len(host), f"{name}: {len(diff)} cases differ, e.g. {diff[:3]}"


def test_kernels_are_torch_operators():
    """The default build's kernels are the operators torch.ops.fastml.*: the profiler records them by
    name, torch.compile traces them (aot_eager: functionalised, without an Inductor build), and a direct
    call with a wrong buffer raises instead of writing out of bounds."""
    from fastml_strategy.kernels import packed_nbytes, quantize

    assert cpu.build_info()["namespace"] == "fastml" and cpu.ops() is torch.ops.fastml
    n = 3000
    x = torch.randn(n)
    packed, meta = torch.empty(packed_nbytes(n, 4), dtype=torch.uint8), torch.empty(6, 2)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        quantize(x, 4, packed_out=packed, meta_out=meta, backend="cpu")
    assert "fastml::quantize" in {e.key for e in prof.key_averages()}

    def encode(v):
        p, m = torch.empty(packed_nbytes(n, 4), dtype=torch.uint8), torch.empty(6, 2)
        torch.ops.fastml.quantize(v, 4, 512, False, 0, None, None, p, m, 1)
        return p, m

    got = torch.compile(encode, backend="aot_eager", fullgraph=True)(x)
    ref = quantize_reference(x, 4)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    with pytest.raises(ValueError, match="packed_out: expected a contiguous CPU Byte tensor of 1500"):
        torch.ops.fastml.quantize(x, 4, 512, False, 0, None, None, torch.empty(3, dtype=torch.uint8), meta, 1)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        torch.ops.fastml.quantize(x.double(), 4, 512, False, 0, None, None, packed, meta, 1)


@pytest.mark.timeout(240)
def test_a_build_killed_mid_way_does_not_hang_later_loads(tmp_path):
    """cpp_extension.load marks a build with a ``lock`` file that its writer removes when done; a
    writer killed mid-build (a test's timeout, Ctrl-C) left it, and every later process waited on it
    forever, at the first codec call, using no CPU. The build folder's flock (released by the system
    when its holder dies) makes such a file stale, removed by the next load. And a second checkout of
    the same sources loads the first one's build rather than compiling again."""
    import os
    import sys

    folder = Path(cpu.build_info()["path"]).parent
    (folder / "lock").touch()  # what a killed build leaves
    code = ("from fastml_strategy.kernels import cpu; assert cpu.available(), cpu.build_info(); "
            "print(cpu.build_info()['cached'])")
    env = dict(os.environ, PYTHONPATH=str(Path(cpu.__file__).parents[2]))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (folder / "lock").exists()
    # the same sources from another checkout: one build folder, no compile
    pkg = tmp_path / "checkout" / "fastml_strategy"
    shutil.copytree(Path(cpu.__file__).parents[1], pkg, ignore=shutil.ignore_patterns("__pycache__"))
    env["PYTHONPATH"] = str(pkg.parent)
    code = ("from fastml_strategy.kernels import cpu; import fastml_strategy as f; assert cpu.available(); "
            "i = cpu.build_info(); print(f.__file__, i['cached'], i['compile_s'])")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    where, cached, _ = r.stdout.split()
    assert where.startswith(str(pkg)) and cached == "True", r.stdout
