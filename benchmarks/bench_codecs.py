"""Codec throughput: GB/s of fp32 input for encode (with and without error feedback) and decode (plain
and accumulate), per bit-width, for every available backend, beside the memory limit in the same run.

The memory limit is measured two ways on the same tensor: ``clone`` (allocates, as a naive caller
would; on CPU this pays the page faults of fresh memory) and ``copy`` (into a preallocated buffer:
the traffic a pass over memory can reach). ``%copy`` compares each operation's memory traffic
(bytes read + written per element: encode 4 + bits/8, with error feedback 12 + bits/8, decode
4 + bits/8, decode-and-add 8 + bits/8; copy 8) with the copy's.

The codecs run as the collective calls them: outputs preallocated (``packed_out``/``meta_out``/
``out``), the residual updated in place. CPU runs use one thread unless ``--threads``.

    python benchmarks/bench_codecs.py                        # CPU, 100 MB, bits 1-8, one thread
    python benchmarks/bench_codecs.py --device cuda --size-mb 1024 --sweep
    python benchmarks/bench_codecs.py --bits 4 --backends cpu,torch --csv /tmp/b.csv

Writes a CSV (default ``benchmarks/out/bench_codecs.csv``) and prints a table.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastml_strategy.kernels import (  # noqa: E402
    available_backends,
    dequantize,
    num_blocks,
    packed_nbytes,
    quantize,
)

OPS = ("encode", "encode_ef", "decode", "decode_acc")


def traffic_per_elem(op: str, bits: int) -> float:
    return {"clone": 8.0, "copy": 8.0, "encode": 4 + bits / 8, "encode_ef": 12 + bits / 8,
            "decode": 4 + bits / 8, "decode_acc": 8 + bits / 8}[op]


class Timer:
    def __init__(self, device: torch.device, reps: int, budget_s: float):
        self.cuda = device.type == "cuda"
        self.reps = reps
        self.budget_s = budget_s

    def __call__(self, fn) -> tuple[float, float]:
        """(median, best) seconds per call: one warm-up, then up to ``reps`` calls (at least 3) within
        the budget."""
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
        return statistics.median(times), min(times)


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cpus)"


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
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(n, generator=g).to(device)
    residual = (torch.randn(n, generator=g) * 0.01).to(device)
    out = torch.zeros(n, device=device)
    dst = torch.empty_like(x)
    stamp = _dt.datetime.now().isoformat(timespec="seconds")
    common = dict(date=stamp, device=device.type, machine=machine(device), numel=n, block_size=bs,
                  threads=args.threads if device.type == "cpu" else "")
    rows: list[dict] = []

    def add(backend, op, bits, times):
        rows.append(make_row(common, backend, op, bits, n, times))

    add("-", "copy", 0, timer(lambda: dst.copy_(x)))
    add("-", "clone", 0, timer(lambda: x.clone()))
    for backend in backends:
        for bits in args.bits:
            nbytes, nb = packed_nbytes(n, bits), num_blocks(n, bs)
            packed = torch.empty(nbytes, dtype=torch.uint8, device=device)
            meta = torch.empty(nb, 2, device=device)
            enc = lambda: quantize(x, bits, bs, backend=backend, packed_out=packed, meta_out=meta)  # noqa: E731
            add(backend, "encode", bits, timer(enc))
            add(backend, "encode_ef", bits, timer(
                lambda: quantize(x, bits, bs, residual=residual, backend=backend, packed_out=packed, meta_out=meta)))
            add(backend, "decode", bits, timer(
                lambda: dequantize(packed, meta, n, bits, bs, out=out, backend=backend)))
            add(backend, "decode_acc", bits, timer(
                lambda: dequantize(packed, meta, n, bits, bs, out=out, accumulate=True, backend=backend)))
            print(f"  {backend} bits={bits} done", file=sys.stderr, flush=True)
    add("-", "copy", 0, timer(lambda: dst.copy_(x)))  # again: on a shared machine, keep the best
    if args.verify:
        verify(x, residual, bs, args.bits, [b for b in backends if b != "torch"])
    if args.sweep and device.type == "cuda":
        rows += sweep(args, x, residual, out, timer, common)
    copies = [r for r in rows if r["op"] == "copy"]
    best = max(copies, key=lambda r: r["traffic_gbps"])
    rows = [r for r in rows if r["op"] != "copy"] + [best]
    for r in rows:
        r["pct_of_copy"] = round(100 * r["traffic_gbps"] / best["traffic_gbps"], 1)
    return rows


def verify(x, residual, bs, bits_list, backends) -> None:
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
            print(f"  verify {be} bits={bits} n={n}: {status}", flush=True)
        del ref_r, ref, ref_y


def make_row(common: dict, backend: str, op: str, bits: int, n: int, times: tuple[float, float]) -> dict:
    med, best = times
    per = traffic_per_elem(op, bits)
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
                rows.append(make_row(common, f"triton[{elems}x{warps}w]", op, bits, n, timer(fn)))
            print(f"  sweep {elems}x{warps} done", file=sys.stderr, flush=True)
    finally:
        qt._CUDA_ELEMS_PER_PROGRAM, qt._CUDA_NUM_WARPS = saved
    return rows


def print_table(rows: list[dict]) -> None:
    unit = "GB/s"
    print(f"\n{rows[0]['machine']}, {rows[0]['device']}, {rows[0]['numel'] * 4 / 1e6:.0f} MB fp32, "
          f"block {rows[0]['block_size']}, threads {rows[0]['threads'] or '-'}; {unit} of fp32 input, best "
          "of the timed calls (its memory traffic as % of the copy's)")
    for r in sorted((r for r in rows if r["op"] in ("clone", "copy")), key=lambda r: r["op"], reverse=True):
        print(f"  {r['op']:>6}: {r['gbps_input']:8.2f} {unit}  ({r['traffic_gbps']:.2f} {unit} moved; "
              f"median {r['gbps_input_median']:.2f})")
    backends = list(dict.fromkeys(r["backend"] for r in rows if r["op"] not in ("clone", "copy")))
    for be in backends:
        sub = [r for r in rows if r["backend"] == be]
        bits = sorted({r["bits"] for r in sub})
        print(f"\n  backend {be}")
        print("  " + f"{'op':<11}" + "".join(f"{'int' + str(b):>15}" for b in bits))
        for op in OPS:
            cells = []
            for b in bits:
                hit = [r for r in sub if r["op"] == op and r["bits"] == b]
                cells.append(f"{hit[0]['gbps_input']:8.2f} ({hit[0]['pct_of_copy']:3.0f}%)" if hit else " " * 15)
            if any(c.strip() for c in cells):
                print("  " + f"{op:<11}" + "".join(f"{c:>15}" for c in cells))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--size-mb", type=float, default=100.0, help="fp32 input size in MB (default 100)")
    p.add_argument("--bits", type=lambda s: [int(b) for b in s.split(",")], default=list(range(1, 9)),
                   help="comma-separated bit-widths (default 1-8)")
    p.add_argument("--block-size", type=int, default=512)
    p.add_argument("--backends", default="", help="comma-separated (default: every available one)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    p.add_argument("--reps", type=int, default=5, help="timed calls per case, at most (CUDA: use ~20)")
    p.add_argument("--budget-s", type=float, default=2.0, help="stop repeating a case after this long")
    p.add_argument("--sweep", action="store_true", help="CUDA: also time Triton launch shapes (int4)")
    p.add_argument("--verify", action="store_true",
                   help="also check each backend bit-exactly against the torch reference at this size")
    p.add_argument("--csv", default=str(Path(__file__).resolve().parent / "out" / "bench_codecs.csv"))
    args = p.parse_args(argv)
    rows = run(args)
    print_table(rows)
    path = Path(args.csv)
    path.parent.mkdir(parents=True, exist_ok=True)
    cols = ["date", "device", "machine", "backend", "op", "bits", "block_size", "numel", "threads", "median_s",
            "best_s", "gbps_input", "gbps_input_median", "bytes_per_elem", "traffic_gbps", "pct_of_copy"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
