"""Pipelined buckets against one piece per bucket, paired inside one run (how PIECE_NUMEL was chosen).

    sudo python benchmarks/bench_pieces.py                          # 1 Gbit/s and no limit, 4M elements
    sudo python benchmarks/bench_pieces.py --pieces 2097152 4194304 --steps 44

The README MLP of ``bench_allreduce.py`` (2 ranks x 1 thread, gloo, int4, batch 8), with its steps
alternating between buckets cut into pieces of ``--pieces`` elements and buckets sent as one piece:
both settings see the same load of a shared machine, which separate runs do not (there, one run can
differ from the next by 30%). Prints the median step of each and their ratio (> 1: pieces faster).
The link: as root, a network namespace whose loopback is shaped as in ``bench_allreduce.py``.

Writes CSV (``--csv``; by default ``benchmarks/results/bench_pieces_cpu.csv`` for the full run as root
with the default settings, ``benchmarks/out/bench_pieces.csv`` otherwise): per link and piece size the
median and the best step of each setting, their ratio, the steps each, the load average when the row
ran, and the machine (CPU model, SIMD flags, cores), Python and torch (``benchmarks/_bench.py``).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402
from bench_allreduce import _setup_ns  # noqa: E402

ONE_PIECE = 1 << 40


def _worker(rank: int, world: int, port: int, plan: str, steps: int, piece: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import fastml_strategy as fm
    from fastml_strategy.comm.collective import BucketLayout

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
    ddp = DDP(model)
    state = fm.register_hook(ddp, plan=plan, layer_stats_every=0)
    eng = state._engine
    layouts: dict = {}
    mode = {"piece": piece}

    def layout_for(names, offsets, numels, device, dtype=torch.float32, **_):
        # one layout per bucket and setting (residuals apart: only the time matters here)
        key = (tuple(names), tuple(offsets), tuple(numels), dtype, mode["piece"])
        if key not in layouts:
            layouts[key] = BucketLayout(names, offsets, numels, eng.plan, eng.world_size, eng.rank,
                                        device, dtype, piece_numel=mode["piece"])
        return layouts[key]

    eng.layout_for = layout_for
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))
    times: dict = {piece: [], ONE_PIECE: []}
    for i in range(steps):
        mode["piece"] = piece if i % 2 else ONE_PIECE
        dist.barrier()
        t0 = time.perf_counter()
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if i >= 4:  # warm-up: DDP's bucket rebuild, first layouts
            times[mode["piece"]].append((time.perf_counter() - t0) * 1000)
    if rank == 0:
        a, b = statistics.median(times[piece]), statistics.median(times[ONE_PIECE])
        with open(out, "w") as f:
            f.write(f"{a} {b} {len(times[piece])} {min(times[piece])} {min(times[ONE_PIECE])}\n")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", nargs="+", default=["1gbit", "none"])
    ap.add_argument("--pieces", nargs="+", type=int, default=[1 << 22])
    ap.add_argument("--plan", default="int4")
    ap.add_argument("--steps", type=int, default=44)
    ap.add_argument("--csv", default=None, help="default benchmarks/results/bench_pieces_cpu.csv for the full "
                    "run as root with the default settings, benchmarks/out/bench_pieces.csv otherwise")
    ap.add_argument("--_run", nargs=2, type=int, help=argparse.SUPPRESS)  # piece, port
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._run:
        import torch.multiprocessing as mp

        piece, port = args._run
        mp.spawn(_worker, args=(2, port, args.plan, args.steps, piece, args._out), nprocs=2, join=True)
        return
    root = os.geteuid() == 0
    full = (root and args.links == ["1gbit", "none"] and args.pieces == [1 << 22] and args.plan == "int4"
            and args.steps == 44)
    csv_path = args.csv or _bench.default_csv("bench_pieces_cpu.csv" if full else "bench_pieces.csv", full)
    env0 = _bench.environment()
    print(f"bench_pieces: {_bench.machine_line(env=env0)}; {_bench.load_line()}", flush=True)
    rows = []
    for link in args.links:
        if link != "none" and not root:
            print(f"skipping link {link}: shaping the loopback needs root", file=sys.stderr)
            continue
        ns = f"fastml-pieces-{os.getpid()}" if root else None
        if ns:
            _setup_ns(ns, None if link == "none" else link)
        try:
            for piece in args.pieces:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
                out = f"/tmp/fastml-pieces-{os.getpid()}.txt"
                cmd = [sys.executable, os.path.abspath(__file__), "--_run", str(piece), str(port),
                       "--_out", out, "--plan", args.plan, "--steps", str(args.steps)]
                if ns:
                    cmd = ["ip", "netns", "exec", ns] + cmd
                repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
                env = {**os.environ, "PYTHONPATH": repo}
                subprocess.run(cmd, check=True, env=env, stderr=subprocess.DEVNULL)
                with open(out) as f:
                    a, b, n, best_a, best_b = f.read().split()
                os.unlink(out)
                rows.append({"link": link, "plan": args.plan, "piece_numel": piece,
                             "ms_pieces_median": float(a), "ms_one_piece_median": float(b),
                             "x_pieces_faster": float(b) / float(a), "ms_pieces_best": float(best_a),
                             "ms_one_piece_best": float(best_b), "steps_each": int(n),
                             "load_avg_1m": round(os.getloadavg()[0], 2),
                             "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
                print(f"{link:6s} {args.plan} pieces of {piece:>9,d}: {float(a):7.1f} ms, one piece "
                      f"{float(b):7.1f} ms, x {float(b) / float(a):.3f} ({n} steps each, load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
        finally:
            if ns:
                subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
    if rows:
        _bench.write_csv(csv_path, rows, env0)
        print(f"CSV: {csv_path}")


if __name__ == "__main__":
    main()
