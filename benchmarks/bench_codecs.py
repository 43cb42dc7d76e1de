"""Codec throughput: GB/s of fp32 input for encode (with and without error feedback) and decode (plain
and accumulate), per bit-width, for every available backend, beside the memory limit in the same run.

The memory limit is measured two ways on the same tensor: ``clone`` (allocates, as a naive caller
would; on CPU this pays the page faults of fresh memory) and ``copy`` (into a preallocated buffer:
the traffic a pass over memory can reach). ``%copy`` compares each operation's memory traffic
(bytes read + written per element: encode 4 + bits/8, with error feedback 12 + bits/8, with a bf16
error-feedback residual 8 + bits/8, decode 4 + bits/8, decode-and-add 8 + bits/8; copy 8) with the
copy's. ``reduce2`` is the reduce step of scatter-reduce-allgather for 2 ranks (decode two messages, add,
halve, encode: ``kernels.reduce_quantize``), in GB/s of fp32 elements; its traffic counts the three
messages (3 bits/8 per element), and a build without the fused kernel runs it as the separate calls.

The codecs run as the collective calls them: outputs preallocated (``packed_out``/``meta_out``/
``out``), the residual updated in place. CPU runs use one thread unless ``--threads``.

The compiled CPU path runs once per build in ``--builds``: by default ``native`` and, on an x86-64
machine that can run it, ``x86-64-v3`` (the AVX2-only build that a machine without AVX-512 compiles),
so one AVX-512 machine measures both. Builds, operations and bit-widths are interleaved (every build
times one case before the next case starts), so load from other jobs hits them alike; the copy is
timed before, between and after the bit-widths, and the best is the reference. ``--rounds R`` repeats
the whole set R times and keeps each case's best call, so that a burst of load cannot spoil one case.

    python benchmarks/bench_codecs.py                        # CPU, 100 MB, bits 1-8, one thread
    python benchmarks/bench_codecs.py --bits 4 --backends cpu --builds native,x86-64-v3,x86-64,generic
    python benchmarks/bench_codecs.py --backends cpu --rounds 3 --verify   # RESULTS.md's CPU table
    python benchmarks/bench_codecs.py --backends cpu --baseline /tmp/old.cpp --size-mb 0.5 --reps 300
    python benchmarks/bench_codecs.py --backends cpu --loader-baseline /tmp/cpu_ctypes.py --bits 4 --rounds 3
    python benchmarks/bench_codecs.py --device cuda --size-mb 1024 --sweep
    python benchmarks/bench_codecs.py --bits 4 --backends cpu,torch --csv /tmp/b.csv

Writes a CSV (default ``benchmarks/out/bench_codecs.csv``, git-ignored; the runs RESULTS.md quotes
pass ``--csv benchmarks/results/bench_codecs_<machine>.csv``, written atomically) and prints a table.
Each case's row has both the median and the best of its timed calls (``median_s``/``best_s``,
``gbps_input_median``/``gbps_input``), and every row the machine (CPU model, family, SIMD flags,
cores; the GPU's name), Python, torch, ``torch.version.cuda``, triton and the load average at the start
and at the end of the run (``benchmarks/_bench.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import _bench  # noqa: E402

from fastml_strategy.kernels import cpu as cpu_kernels  # noqa: E402
from fastml_strategy.kernels import (  # noqa: E402
    available_backends,
    dequantize,
    num_blocks,
    packed_nbytes,
    quantize,
    reduce_quantize,
)

OPS = ("encode", "encode_ef", "encode_ef_rbf16", "decode", "decode_acc", "reduce2")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def traffic_per_elem(op: str, bits: int, in_bytes: int = 4) -> float:
    """Bytes read + written per element; ``in_bytes``: the encoder's input element (fp32 4, bf16/fp16 2)."""
    return {"clone": 8.0, "copy": 8.0, "encode": in_bytes + bits / 8, "encode_ef": in_bytes + 8 + bits / 8,
            "encode_ef_rbf16": in_bytes + 4 + bits / 8, "decode": 4 + bits / 8, "decode_acc": 8 + bits / 8,
            "reduce2": 3 * bits / 8}[op]


class Timer:
    def __init__(self, device: torch.device, reps: int, budget_s: float):
        self.cuda = device.type == "cuda"
        self.reps = reps
        self.budget_s = budget_s

    def __call__(self, fn) -> tuple[float, float]:
        """(median, best) seconds per call of :meth:`samples`."""
        times = self.samples(fn)
        return statistics.median(times), min(times)

    def samples(self, fn) -> list[float]:
        """Seconds per call: one warm-up, then up to ``reps`` calls (at least 3) within the budget."""
        fn()
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < self.reps and (len(times) < 3 or time.perf_counter() - start < self.budget_s):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3)
            else:
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
        return times


def machine(device: torch.device) -> str:
    """The GPU's name, or the CPU's model, family and SIMD flags (``_bench.cpu_info``)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    c = _bench.cpu_info()
    return f"{c['cpu']} (family {c['cpu_family']}; {c['cpu_flags']}; {c['cores']} cpus)"


def default_builds() -> list[str]:
    """``native``, plus ``x86-64-v3`` (the AVX2-only build) where this CPU can run it."""
    return [b for b in cpu_kernels.local_builds() if b in ("native", "x86-64-v3")]


def impls(backends: list[str], builds: list[str], baseline: str | None = None,
          loader: str | None = None) -> list[tuple[str, str, str | None]]:
    """(label, backend, build): the compiled CPU path once per build (and per build of ``baseline``,
    as ``BUILD@baseline``, and through the ``loader`` module, as ``BUILD@loader``), other backends once."""
    out = []
    for be in backends:
        if be == "cpu":
            for b in builds:
                if baseline:
                    out.append((f"cpu[{b}@baseline]", "cpu", f"{b}@{baseline}"))
                if loader:
                    out.append((f"cpu[{b}@loader]", "cpu", f"{b}#{loader}"))
                out.append((f"cpu[{b}]", "cpu", b))
        else:
            out.append((be, be, None))
    return out


def selected(build: str | None):
    """Select a build (``MARCH``, ``MARCH@SOURCE``, or ``MARCH#LOADER``: through another version of
    ``kernels/cpu.py``) for the block."""
    if not build:
        return contextlib.nullcontext({})
    if "#" in build:
        return through_loader(*build.split("#", 1))
    march, _, source = build.partition("@")
    return cpu_kernels.use_build(march, source or None)


_LOADERS: dict[str, object] = {}


@contextlib.contextmanager
def through_loader(march: str, path: str):
    """Within the block, ``backend="cpu"`` runs the module at ``path`` (another version of
    ``fastml_strategy/kernels/cpu.py``, e.g. the ctypes loader before the torch operators:
    ``git show 110ba41:fastml_strategy/kernels/cpu.py > /tmp/cpu_ctypes.py``), its build ``march``, so
    the dispatch of both versions is timed side by side through ``kernels.quantize``."""
    import importlib.util

    import fastml_strategy.kernels as pkg

    if path not in _LOADERS:
        spec = importlib.util.spec_from_file_location(f"_bench_loader_{len(_LOADERS)}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod._SRC = cpu_kernels._SRC  # the same kernel source: only the loading and the calls differ
        _LOADERS[path] = mod
    mod, saved = _LOADERS[path], pkg.cpu
    pkg.cpu = mod  # what ``from fastml_strategy.kernels import cpu`` in the dispatcher finds
    try:
        with mod.use_build(march) as info:
            yield info
    finally:
        pkg.cpu = saved


def run(args) -> list[dict]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
        os.environ["FASTML_CPU_THREADS"] = str(args.threads)
    n = int(args.size_mb * 1e6) // 4
    bs = args.block_size
    backends = args.backends.split(",") if args.backends else available_backends(device)
    if device.type == "cpu" and "triton" in backends and not args.backends:
        backends.remove("triton")  # the interpreter is a test tool, not a CPU path
    timer = Timer(device, args.reps, args.budget_s)
    builds = (args.builds.split(",") if args.builds else default_builds()) if device.type == "cpu" else []
    todo = impls(backends, builds, args.baseline, args.loader_baseline or None)
    isa = {}
    for label, _be, build in todo:
        if build:
            with selected(build) as info:
                isa[label] = info.get("isa", "")
    g = torch.Generator(device="cpu").manual_seed(0)
    x32 = torch.randn(n, generator=g).to(device)  # the copy's tensor, and the encoder's input as fp32
    x = x32.to(DTYPES[args.dtype])
    residual = (torch.randn(n, generator=g) * 0.01).to(device)
    residual16 = residual.to(torch.bfloat16)
    out = torch.zeros(n, device=device)
    dst = torch.empty_like(x32)
    stamp = _dt.datetime.now().isoformat(timespec="seconds")
    common = dict(date=stamp, device=device.type, machine=machine(device), numel=n, block_size=bs,
                  dtype=args.dtype, rounding="stochastic" if args.stochastic else "nearest",
                  threads=args.threads if device.type == "cpu" else "", **_bench.environment(device))
    print(f"bench_codecs: {_bench.machine_line(env=common)}; {_bench.load_line()}", file=sys.stderr, flush=True)
    # Every timing of every round, by (label, op, bits, build): a case's median and best are over all
    # rounds, so a burst of load from other jobs cannot spoil all of one case's calls.
    samples: dict[tuple, list[float]] = {}
    stoch = args.stochastic

    def add(label, op, bits, fn, build=None):
        samples.setdefault((label, op, bits, build), []).extend(timer.samples(fn))

    for rnd in range(args.rounds):
        add("-", "copy", 0, lambda: dst.copy_(x32))
        if rnd == 0:
            add("-", "clone", 0, lambda: x32.clone())
        for bits in args.bits:
            nbytes, nb = packed_nbytes(n, bits), num_blocks(n, bs)
            packed = torch.empty(nbytes, dtype=torch.uint8, device=device)
            meta = torch.empty(nb, 2, device=device)
            packed2 = torch.empty(nbytes, dtype=torch.uint8, device=device)  # reduce2's second message
            meta2 = torch.empty(nb, 2, device=device)
            packed3 = torch.empty(nbytes, dtype=torch.uint8, device=device)  # and its output
            meta3 = torch.empty(nb, 2, device=device)
            cases = {
                "encode": lambda be: quantize(x, bits, bs, stoch, 1, backend=be, packed_out=packed, meta_out=meta),
                "encode_ef": lambda be: quantize(x, bits, bs, stoch, 1, residual=residual, backend=be,
                                                 packed_out=packed, meta_out=meta),
                "encode_ef_rbf16": lambda be: quantize(x, bits, bs, stoch, 1, residual=residual16, backend=be,
                                                       packed_out=packed, meta_out=meta),
                "decode": lambda be: dequantize(packed, meta, n, bits, bs, out=out, backend=be),
                "decode_acc": lambda be: dequantize(packed, meta, n, bits, bs, out=out, accumulate=True,
                                                    backend=be),
                "reduce2": lambda be: reduce_quantize([(packed, meta), (packed2, meta2)], n, bits, bs, 2, stoch, 1,
                                                      packed_out=packed3, meta_out=meta3, acc=out, backend=be),
            }
            for op in OPS:
                for label, be, build in todo:
                    with selected(build):
                        if op.startswith("decode") or op == "reduce2":  # payloads this implementation wrote
                            cases["encode"](be)
                            if op == "reduce2":
                                quantize(x32 * 0.5, bits, bs, stoch, 2, backend=be, packed_out=packed2, meta_out=meta2)
                        add(label, op, bits, lambda: cases[op](be), build)
            print(f"  round {rnd + 1}/{args.rounds} bits={bits} done", file=sys.stderr, flush=True)
            add("-", "copy", 0, lambda: dst.copy_(x32))  # again: on a shared machine, keep the best
    rows = [make_row(dict(common, build=build or "", isa=isa.get(label, "")), label, op, bits, n,
                     (statistics.median(t), min(t)))
            for (label, op, bits, build), t in samples.items()]
    if args.verify:
        for label, be, build in todo:
            if be != "torch":
                with selected(build):
                    verify(x, residual, bs, args.bits, [be], label)
    if args.sweep and device.type == "cuda":
        rows += sweep(args, x, residual, out, timer, common)
    copies = [r for r in rows if r["op"] == "copy"]
    best = max(copies, key=lambda r: r["traffic_gbps"])
    rows = [r for r in rows if r["op"] != "copy"] + [best]
    for r in rows:
        r["pct_of_copy"] = round(100 * r["traffic_gbps"] / best["traffic_gbps"], 1)
    return rows


def verify(x, residual, bs, bits_list, backends, label=None) -> None:
    """Each backend against the torch reference on the full-size tensor (large indices included):
    packed bytes, metadata, new residual and decoded values, stochastic rounding included."""
    n = x.numel()
    for bits in bits_list:
        ref_r = residual.clone()
        ref = quantize(x, bits, bs, stochastic=True, seed=7, residual=ref_r, backend="torch")
        ref_y = dequantize(*ref, n, bits, bs, backend="torch")
        for be in backends:
            r = residual.clone()
            got = quantize(x, bits, bs, stochastic=True, seed=7, residual=r, backend=be)
            y = dequantize(*got, n, bits, bs, backend=be)
            bad = {"packed": int((got[0] != ref[0]).sum()), "meta": int((got[1] != ref[1]).sum()),
                   "residual": int((r != ref_r).sum()), "decoded": int((y != ref_y).sum())}
            status = "bit-exact" if not any(bad.values()) else f"MISMATCH {bad}"
            print(f"  verify {label or be} bits={bits} n={n}: {status}", flush=True)
        del ref_r, ref, ref_y


def make_row(common: dict, backend: str, op: str, bits: int, n: int, times: tuple[float, float]) -> dict:
    med, best = times
    in_bytes = 2 if common.get("dtype") in ("bfloat16", "float16") else 4
    per = traffic_per_elem(op, bits, in_bytes)
    return dict(common, backend=backend, op=op, bits=bits, median_s=round(med, 6), best_s=round(best, 6),
                gbps_input=round(n * 4 / best / 1e9, 3), gbps_input_median=round(n * 4 / med / 1e9, 3),
                bytes_per_elem=per, traffic_gbps=round(n * per / best / 1e9, 3))


def sweep(args, x, residual, out, timer, common) -> list[dict]:
    """Triton launch shapes for int4: elements per program x warps (module constants patched)."""
    from fastml_strategy.kernels import quantize_triton as qt

    n, bs, bits = x.numel(), args.block_size, 4
    packed = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=x.device)
    meta = torch.empty(num_blocks(n, bs), 2, device=x.device)
    saved = (qt._CUDA_ELEMS_PER_PROGRAM, qt._CUDA_NUM_WARPS)
    rows = []
    try:
        for elems, warps in [(512, 1), (1024, 1), (2048, 1), (1024, 2), (2048, 2), (4096, 2), (2048, 4),
                             (4096, 4), (4096, 8)]:
            qt._CUDA_ELEMS_PER_PROGRAM, qt._CUDA_NUM_WARPS = elems, warps
            for op, fn in (
                ("encode", lambda: quantize(x, bits, bs, backend="triton", packed_out=packed, meta_out=meta)),
                ("encode_ef", lambda: quantize(x, bits, bs, residual=residual, backend="triton",
                                               packed_out=packed, meta_out=meta)),
                ("decode_acc", lambda: dequantize(packed, meta, n, bits, bs, out=out, accumulate=True,
                                                  backend="triton")),
            ):
                rows.append(make_row(dict(common, build="", isa=""), f"triton[{elems}x{warps}w]", op, bits, n,
                                     timer(fn)))
            print(f"  sweep {elems}x{warps} done", file=sys.stderr, flush=True)
    finally:
        qt._CUDA_ELEMS_PER_PROGRAM, qt._CUDA_NUM_WARPS = saved
    return rows


def print_table(rows: list[dict]) -> None:
    unit = "GB/s"
    inp = "" if rows[0].get("dtype", "float32") == "float32" else f" (encoder input {rows[0]['dtype']})"
    rnd = ", stochastic rounding" if rows[0].get("rounding") == "stochastic" else ""
    print(f"\n{rows[0]['machine']}, {rows[0]['device']}, {rows[0]['numel'] * 4 / 1e6:.0f} MB fp32{inp}{rnd}, "
          f"block {rows[0]['block_size']}, threads {rows[0]['threads'] or '-'}; {unit} of fp32 input, best "
          "of the timed calls (its memory traffic as % of the copy's)")
    for r in sorted((r for r in rows if r["op"] in ("clone", "copy")), key=lambda r: r["op"], reverse=True):
        print(f"  {r['op']:>6}: {r['gbps_input']:8.2f} {unit}  ({r['traffic_gbps']:.2f} {unit} moved; "
              f"median {r['gbps_input_median']:.2f})")
    copy = next((r for r in rows if r["op"] == "copy"), None)
    backends = list(dict.fromkeys(r["backend"] for r in rows if r["op"] not in ("clone", "copy")))
    for be in backends:
        sub = [r for r in rows if r["backend"] == be]
        bits = sorted({r["bits"] for r in sub})
        isa = f" ({sub[0]['isa']} kernels)" if sub[0].get("isa") else ""
        print(f"\n  backend {be}{isa}")
        print("  " + f"{'op':<16}" + "".join(f"{'int' + str(b):>15}" for b in bits))
        for op in OPS:
            cells = []
            for b in bits:
                hit = [r for r in sub if r["op"] == op and r["bits"] == b]
                cells.append(f"{hit[0]['gbps_input']:8.2f} ({hit[0]['pct_of_copy']:3.0f}%)" if hit else " " * 15)
            if any(c.strip() for c in cells):
                print("  " + f"{op:<16}" + "".join(f"{c:>15}" for c in cells))
    cpus = [be for be in backends if be.startswith("cpu[")]
    if len(cpus) > 1 and copy:
        print(f"\n  side by side ({unit} of input; copy {copy['gbps_input']:.2f}):")
        width = max(22, *(len(be) + 2 for be in cpus))
        print("  " + f"{'op':<21}" + "".join(f"{be:>{width}}" for be in cpus))
        for b in sorted({r["bits"] for r in rows if r["backend"] in cpus}):
            for op in OPS:
                hit = {r["backend"]: r for r in rows if r["op"] == op and r["bits"] == b and r["backend"] in cpus}
                if hit:
                    cells = [f"{hit[be]['gbps_input']:8.2f} ({hit[be]['pct_of_copy']:3.0f}%)" if be in hit else ""
                             for be in cpus]
                    print("  " + f"{op + ' int' + str(b):<21}" + "".join(f"{c:>{width}}" for c in cells))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--size-mb", type=float, default=100.0, help="fp32 input size in MB (default 100)")
    p.add_argument("--bits", type=lambda s: [int(b) for b in s.split(",")], default=list(range(1, 9)),
                   help="comma-separated bit-widths (default 1-8)")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32",
                   help="the encoder's input (GB/s stay per fp32-sized element: 4 bytes per element)")
    p.add_argument("--stochastic", action="store_true", help="encode with stochastic rounding (seed 1)")
    p.add_argument("--backends", default="", help="comma-separated (default: every available one)")
    p.add_argument("--builds", default="",
                   help="builds of the compiled CPU path, comma-separated -march values or 'generic' (scalar) "
                        "(default: native, plus x86-64-v3 on x86-64 machines that can run it)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per case, at most (CUDA: use ~20)")
    p.add_argument("--budget-s", type=float, default=2.0, help="stop repeating a case after this long")
    p.add_argument("--baseline", default="",
                   help="another quantize_cpu.cpp (e.g. `git show HEAD~1:fastml_strategy/kernels/quantize_cpu.cpp "
                        "> /tmp/old.cpp`): each build of it runs beside the same build of this one")
    p.add_argument("--loader-baseline", default="",
                   help="another fastml_strategy/kernels/cpu.py (e.g. `git show 110ba41:fastml_strategy/kernels/cpu.py "
                        "> /tmp/cpu_ctypes.py`, the ctypes loader): each build also runs through it, as BUILD@loader")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the whole interleaved set this many times; each case keeps its best call "
                        "(use 3 or more on a shared machine)")
    p.add_argument("--sweep", action="store_true", help="CUDA: also time Triton launch shapes (int4)")
    p.add_argument("--verify", action="store_true",
                   help="also check each backend bit-exactly against the torch reference at this size")
    p.add_argument("--csv", default=str(Path(__file__).resolve().parent / "out" / "bench_codecs.csv"))
    args = p.parse_args(argv)
    rows = run(args)
    print_table(rows)
    path = Path(args.csv)
    cols = ["date", "device", "machine", "backend", "build", "isa", "dtype", "rounding", "op", "bits", "block_size",
            "numel", "threads",
            "median_s", "best_s", "gbps_input", "gbps_input_median", "bytes_per_elem", "traffic_gbps", "pct_of_copy"]
    end = _bench.load()
    rows = [dict({c: r.get(c, "") for c in cols}, **{k: v for k, v in r.items() if k not in cols},
                 load_1m_end=round(end[0], 2)) for r in rows]
    print(f"\n{_bench.machine_line(env=rows[0])}; load average {rows[0]['load_1m']:.2f} at the start, "
          f"{end[0]:.2f} at the end")
    _bench.write_csv(path, rows, env={})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
