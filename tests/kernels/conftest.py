"""Kernel tests: which device and backends they run on.

By default the tensors live on the CPU, and the backends under test are the compiled CPU path
(``"cpu"``), once per build that this machine can run (``cpu[native]``; on x86-64 also
``cpu[x86-64-v3]``, the AVX2-only build, ``cpu[x86-64]``, SSE2, and ``cpu[generic]``, the scalar
kernels: see ``cpu.local_builds``), and the Triton kernels through Triton's interpreter (``"triton"``;
tests/conftest.py sets ``TRITON_INTERPRET=1``). The ``backend`` fixture yields ``"cpu"`` with that
build selected (``cpu.use_build``). With ``FASTML_TEST_DEVICE=cuda`` (and ``TRITON_INTERPRET=0``, see
``benchmarks/gpu_check.sh``) the tensors live on the GPU and the backends are the real Triton kernels
and the torch reference run on CUDA. The oracle is always the torch reference on the CPU.
"""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = os.environ.get("FASTML_TEST_DEVICE", "cpu")


def _backends() -> list[str]:
    if DEVICE == "cuda":
        return ["triton", "torch"]
    from fastml_strategy.kernels import cpu

    out = []
    if cpu.available():
        out += [f"cpu[{b}]" for b in cpu.local_builds()]
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        try:
            import triton  # noqa: F401

            out.append("triton")
        except ImportError:
            pass
    return out


BACKENDS = _backends()


def pytest_collection_modifyitems(items):
    # The interpreter evaluates both sides of tl.where in numpy: 0 * inf and 1 / 0 there are expected.
    for item in items:
        if "kernels" in str(item.fspath):
            item.add_marker(pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("FASTML_TEST_DEVICE=cuda but torch sees no CUDA device")
    return torch.device(DEVICE)


CPU_BUILDS = [b[4:-1] for b in BACKENDS if b.startswith("cpu[")]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """A backend name for ``backend=``; for ``cpu[BUILD]``, ``"cpu"`` with that build selected."""
    name = request.param
    if not name.startswith("cpu["):
        yield name
        return
    from fastml_strategy.kernels import cpu

    with cpu.use_build(name[4:-1]):
        yield "cpu"


@pytest.fixture(params=CPU_BUILDS or [pytest.param(None, marks=pytest.mark.skip("no compiled CPU path"))])
def cpu_build(request):
    """Each build of the compiled CPU path, selected: yields the ``cpu`` module."""
    from fastml_strategy.kernels import cpu

    with cpu.use_build(request.param):
        yield cpu
