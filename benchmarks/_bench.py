"""What every benchmark records beside its figures, and how it writes them.

- :func:`environment`: the machine and the software as CSV columns (CPU model, family and model number,
  the SIMD flags that decide which kernels run: avx2 / avx512f / avx512bw / avx512_bf16 / asimd / sve,
  cores, Python, torch, ``torch.version.cuda``, triton, the device's name) and the load average.
  :func:`machine_line` says the same in one line for the printed output.
- :func:`write_csv`: writes rows atomically (``fastml_strategy._io.atomic_open``), the columns of
  :func:`environment` added to every row, so a CSV never says less than its figures need.
- :func:`default_csv`: ``benchmarks/results/NAME`` for the run the docs quote, ``benchmarks/out/NAME``
  (git-ignored) for smoke and partial runs, so a quick run never overwrites a cited CSV.
- :class:`CollectiveBytes` and :func:`ddp_bucket_bytes`: the bytes a method hands to the all-reduce,
  measured rather than typed in (the "compression" of DDP and torch's hooks).

Benchmarks are scripts run from the repository root (``python benchmarks/X.py``), so this module is
imported as ``_bench`` (the script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import csv
import os
import platform
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUT = HERE / "out"
_SIMD = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "asimd", "sve")


def cpu_info() -> dict:
    """Model name, family, model number and the SIMD flags of the first CPU in /proc/cpuinfo."""
    model, fam, mod, flags = "", "?", "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                k, _, v = line.partition(":")
                k = k.strip()
                if k == "model name" and not model:
                    model = v.strip()
                elif k == "cpu family" and fam == "?":
                    fam = v.strip()
                elif k == "model" and mod == "?":
                    mod = v.strip()
                elif k in ("flags", "Features") and not flags:
                    flags = set(v.split())
    except OSError:
        pass
    return {"cpu": model or platform.processor() or platform.machine() or "unknown CPU",
            "cpu_family": fam, "cpu_model": mod,
            "cpu_flags": " ".join(f for f in _SIMD if f in flags) or "no AVX2",
            "cores": os.cpu_count()}


def _triton_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return ""
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return ""


def software(device=None) -> dict:
    """Python, torch, the CUDA torch was built with, triton (empty where absent) and the device's name."""
    import torch

    dev, driver = "cpu", ""
    if device is not None and str(device).startswith("cuda") and torch.cuda.is_available():
        dev = torch.cuda.get_device_name(torch.device(device))
        driver = _nvidia_driver()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "torch_cuda": torch.version.cuda or "", "triton": _triton_version(), "device_name": dev,
            "gpu_driver": driver, "fastml_cpu_march": os.environ.get("FASTML_CPU_MARCH", "native")}


def _nvidia_driver() -> str:
    """The NVIDIA driver's version from nvidia-smi, or empty where it cannot be asked."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def load() -> tuple[float, float, float]:
    try:
        return os.getloadavg()
    except OSError:  # pragma: no cover - not on Linux
        return (float("nan"),) * 3


def environment(device=None) -> dict:
    """Every column a figure needs beside it: machine, software, load average (1, 5, 15 min) now."""
    l1, l5, l15 = load()
    return {**cpu_info(), **software(device), "load_1m": round(l1, 2), "load_5m": round(l5, 2),
            "load_15m": round(l15, 2)}


def machine_line(device=None, env: dict | None = None) -> str:
    """``AMD EPYC (family 25, model 17; avx2 avx512f ...), 2 cores, Python 3.11.7, torch 2.13.0+cpu``,
    plus CUDA, triton and the GPU where a CUDA device is given."""
    e = env or environment(device)
    s = (f"{e['cpu']} (family {e['cpu_family']}, model {e['cpu_model']}; {e['cpu_flags']}), {e['cores']} cores, "
         f"Python {e['python']}, torch {e['torch']}")
    if e["device_name"] != "cpu":
        s += (f", CUDA {e['torch_cuda'] or '?'}, triton {e['triton'] or 'not installed'}, {e['device_name']}"
              f" (driver {e.get('gpu_driver') or '?'})")
    return s


def load_line() -> str:
    return "load average " + " ".join(f"{v:.2f}" for v in load())


def default_csv(name: str, documented: bool) -> str:
    """Where a run writes NAME by default: ``benchmarks/results/`` when it is the run the docs quote,
    ``benchmarks/out/`` (git-ignored) otherwise."""
    return str((RESULTS if documented else OUT) / name)


def write_csv(path, rows: list[dict], env: dict | None = None) -> None:
    """Write ``rows`` (dicts; columns in order of first appearance) atomically, with the columns of
    :func:`environment` (or ``env``) appended to every row where the row has none of its own."""
    from fastml_strategy._io import atomic_open

    env = environment() if env is None else env
    rows = [{**r, **{k: v for k, v in env.items() if k not in r}} for r in rows]
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with atomic_open(path, "w") as f:
        w = csv.DictWriter(f, fieldnames=fields, lineterminator="\n")
        w.writeheader()
        w.writerows(rows)


class CollectiveBytes:
    """Counts the bytes of the tensors handed to ``torch.distributed.all_reduce`` while active.

    torch's DDP hooks (``fp16_compress_hook``, ``powerSGD_hook``, ``allreduce_hook``) call
    ``torch.distributed.all_reduce`` through the module, so wrapping the module's attribute sees exactly
    what they send to the collective (the fp16 tensor, PowerSGD's P and Q matrices and its uncompressed
    1-D tensors). DDP's own all-reduce runs in C++ and is not seen: use :func:`ddp_bucket_bytes`.
    """

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self._orig = None

    def __enter__(self) -> "CollectiveBytes":
        import torch.distributed as dist

        self._orig = orig = dist.all_reduce

        def counted(tensor, *args, **kwargs):
            self.bytes += tensor.numel() * tensor.element_size()
            self.calls += 1
            return orig(tensor, *args, **kwargs)

        dist.all_reduce = counted
        return self

    def reset(self) -> None:
        self.bytes = self.calls = 0

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        dist.all_reduce = self._orig


def ddp_bucket_bytes(ddp) -> int | None:
    """Bytes DDP's own reducer hands to the all-reduce per step: the sum of its buckets' flat buffers
    (``reducer._get_zeros_like_grad_buckets()``: the buckets as they are after the first iteration's
    rebuild; else DDP's logging data). None where torch reports neither."""
    try:
        return sum(b.buffer().numel() * b.buffer().element_size()
                   for b in ddp.reducer._get_zeros_like_grad_buckets()) or None
    except Exception:  # private torch APIs: if they change, the column says "not measured" (empty)
        pass
    try:
        sizes = ddp._get_ddp_logging_data().get("bucket_sizes", "")
        return sum(int(s) for s in str(sizes).replace(",", " ").split()) or None
    except Exception:
        return None


def grad_bytes(model) -> int:
    """Bytes of the gradients a step produces (every parameter that requires one, at its dtype)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
