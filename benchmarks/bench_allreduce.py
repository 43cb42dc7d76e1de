"""Step time of DDP with and without gradient compression, side by side, on an emulated 1 Gbit/s link.

    sudo python benchmarks/bench_allreduce.py                 # 1 Gbit/s link and no limit, all methods
    python benchmarks/bench_allreduce.py --links none         # no root: only the unlimited loopback
    python benchmarks/bench_allreduce.py --methods ddp-fp32 fastml-int4 --steps 5
    # before/after: this checkout against another one (e.g. `git worktree add /tmp/before HEAD~1`),
    # interleaved over 3 rounds on a shared machine
    sudo python benchmarks/bench_allreduce.py --methods fastml-int4@before fastml-int4 \
        --before /tmp/before --rounds 3

Model: a 25.2M-parameter MLP, Linear(1024, 4096) - ReLU - Linear(4096, 4096) - ReLU - Linear(4096, 1024)
(100.7 MB of fp32 gradient per step, in DDP's default 25 MB buckets), trained on a fixed random batch of
8 per rank (loss: mean square of the output), 2 ranks x 1 thread, gloo. Large layers and little compute per
byte: the step time is dominated by the all-reduce, the case gradient compression is for. Methods: DDP's fp32 all-reduce, torch's fp16 hook, torch's PowerSGD (rank 4, one bucket:
with two buckets it aborts on gloo), and FastML int8 / int4 / int2 / topk1.

The link: as root, each link setting gets a private network namespace whose loopback is rate-limited
with ``tc qdisc add dev lo root tbf rate 1gbit burst 512kb latency 100ms``; all ranks run inside it,
so they share one 1 Gbit/s link, like nodes behind a commodity switch port. Without root the link
cannot be shaped and only ``--links none`` runs. Prints a table and writes CSV (``--csv``): by default
``benchmarks/results/bench_allreduce_cpu.csv`` for the full run as root (every method, both links, one
round: the README's table), ``benchmarks/out/bench_allreduce.csv`` (git-ignored) for any other run; with
``--rounds`` > 1 every round's rows go to ``..._rounds.csv`` beside it. Every row carries the machine
(CPU model, family, SIMD flags, cores), Python and torch, and the load average when it ran
(``benchmarks/_bench.py``): ``load_avg_1m`` is each row's own (the median over its rounds),
``load_1m``/``load_5m``/``load_15m`` the load when the run started.

"compression" is measured, never typed in: the gradient bytes of a step over the bytes the method hands
to the all-reduce per timed step. DDP fp32: the sum of DDP's bucket buffers (its reducer all-reduces each
once per step); torch's fp16 and PowerSGD hooks: the tensors they pass to ``torch.distributed.all_reduce``,
counted by a wrapper during the timed steps (``_bench.CollectiveBytes``); FastML: ``state.stats()``
(the fp32 ring all-reduce's bytes over the bytes FastML sent). ``ratio_source`` names which.

Every row carries two bounds. The physical bound, max(compute, wire bytes / link rate): "compute" is the same
training step without any communication (forward, backward, SGD step, zero_grad; both ranks at once,
measured in the same process just before), "wire bytes" what the namespace's loopback counted per
step (/proc/net/dev: both ranks' traffic, TCP/IP headers included). No step can beat it; "/ bound"
says how far a method is from it. It assumes the link busy from the step's first microsecond, which
no data-parallel step can do: a gradient exists only once backward has computed it, and on this MLP 83%
of the bytes (the 4096x4096 layer and the first) come in the last third of backward. The schedule
bound adds that dependency (``_schedule_bound``): the latest t of [t + the wire time of the bytes of
the gradients ready at or after t] plus SGD's step and zero_grad, with each gradient's ready time
measured in the same compute-only steps; "/ schedule bound" says how far a method is from the best
any overlap of communication with backward could do. The machine's load average is printed and written with each row:
on a shared machine compare rows of one run, not figures of different runs.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _bench  # noqa: E402

METHODS = ["ddp-fp32", "torch-fp16", "torch-powersgd-r4", "fastml-none", "fastml-int8", "fastml-int4",
           "fastml-int2", "fastml-topk1"]
# Not in the default run: "fastml-RECIPE-rbf16" is RECIPE with its error-feedback residual kept in bf16
# (CodecConfig(residual_dtype="bf16")), which moves 8.5 bytes per element through memory, not 12.5.
EXTRA_METHODS = ["fastml-int4-rbf16", "fastml-int2-rbf16"]
# "METHOD@before": the same method with the fastml_strategy of another checkout (--before DIR, e.g. a
# `git worktree` of the previous commit), run in the same invocation so the two compare side by side.
BEFORE = "@before"


def _plan(name: str):
    """A recipe name, or RECIPE-rbf16: the recipe with a bf16 error-feedback residual."""
    import dataclasses

    import fastml_strategy as fm

    if name.endswith("-rbf16"):
        recipe = name[: -len("-rbf16")]
        codec = dataclasses.replace(fm.Plan.from_recipe(recipe).default, residual_dtype="bf16")
        return fm.Plan(default=codec, name=name)
    return name


def _lo_tx_bytes() -> int:
    """Bytes sent on the loopback of this process's network namespace (/proc/net/dev): every rank's
    traffic, headers included, since all ranks share the namespace's one (shaped) loopback."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == "lo":
                return int(rest.split()[8])
    return 0


def _rate_bits(link: str) -> float | None:
    """A tc rate ("1gbit", "250mbit", "100kbit") in bits per second; None for "none"."""
    if link == "none":
        return None
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0)):
        if link.endswith(unit):
            return float(link[: -len(unit)]) * mult
    raise ValueError(f"link {link!r}: give a tc rate such as 1gbit or 250mbit, or none")


# -- one method, 2 ranks (runs inside the namespace) ---------------------------------------------------
def _schedule_bound(grads_ready: list, wire_ms: float, post_ms: float) -> float:
    """A lower bound on the step that respects the training loop's dependencies, which
    max(compute, wire) does not: a gradient can go on the wire only once backward has computed it,
    and SGD's step (then zero_grad) starts only once the last byte has arrived. ``grads_ready``:
    (ms after the step's start, elements) of every parameter, measured without communication;
    ``wire_ms``: the whole step's bytes over the link rate, of which the parameters ready at or after
    t carry their share by elements (exact for the benchmark's plans, whose layers all share one codec;
    small tensors travelling uncompressed make it a little low). Then no schedule can finish before
    max over t of [t + wire_ms x (share of elements ready at or after t)] + post_ms."""
    total = sum(n for _, n in grads_ready)
    worst = 0.0
    for t, _ in grads_ready:
        later = sum(n for u, n in grads_ready if u >= t)
        worst = max(worst, t + wire_ms * later / total)
    return worst + post_ms


def _worker(rank: int, world: int, method: str, steps: int, warmup: int, port: int, out: str,
            bucket_view: bool = False) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                torch.nn.ReLU(), torch.nn.Linear(4096, 1024))
    nparams = sum(p.numel() for p in model.parameters())
    x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(rank))
    # The compute of one step (forward, backward, SGD step, zero_grad) without any communication, both
    # ranks at once as in the measured steps: the lower bound of a step when the link is fast.
    # Also when each gradient is ready (post-accumulate-grad hooks) and how long SGD's step and
    # zero_grad take after backward: the schedule bound (see main()).
    plain = torch.optim.SGD(model.parameters(), lr=0.0)
    compute, ready, post = [], {n: [] for n, _ in model.named_parameters()}, []
    clock = {"t0": 0.0}

    def mark(name):
        return lambda p: ready[name].append((time.perf_counter() - clock["t0"]) * 1000)

    marks = [p.register_post_accumulate_grad_hook(mark(n)) for n, p in model.named_parameters()]
    for i in range(warmup + steps):
        dist.barrier()
        clock["t0"] = t0 = time.perf_counter()
        model(x).square().mean().backward()
        t1 = time.perf_counter()
        plain.step()
        plain.zero_grad(set_to_none=False)
        compute.append(time.perf_counter() - t0)
        post.append((time.perf_counter() - t1) * 1000)
    for m in marks:
        m.remove()
    plain.zero_grad(set_to_none=True)
    del plain
    grads_ready = [(statistics.median(ready[n][warmup:]), p.numel()) for n, p in model.named_parameters()]
    method = method.removesuffix(BEFORE)  # the other checkout is on sys.path (PYTHONPATH): same method
    state = None
    if method == "torch-powersgd-r4":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

        # one bucket: PowerSGD aborts on gloo with more
        ddp = DDP(model, bucket_cap_mb=1024, gradient_as_bucket_view=bucket_view)
        ps_state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=2)
        ddp.register_comm_hook(ps_state, ps.powerSGD_hook)
    else:
        ddp = DDP(model, gradient_as_bucket_view=bucket_view)
        if method == "torch-fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif method.startswith("fastml-"):
            import fastml_strategy as fm

            state = fm.register_hook(ddp, plan=_plan(method[len("fastml-"):]), layer_stats_every=0)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    times = []
    # torch's hooks call torch.distributed.all_reduce: count what they hand it (timed steps only)
    counter = _bench.CollectiveBytes() if method.startswith("torch-") else None
    if counter is not None:
        counter.__enter__()
    try:
        for i in range(warmup + steps):
            dist.barrier()
            if i == warmup:
                tx0 = _lo_tx_bytes()
                if counter is not None:
                    counter.reset()
            t0 = time.perf_counter()
            loss = ddp(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            times.append(time.perf_counter() - t0)
    finally:
        if counter is not None:
            counter.__exit__(None, None, None)
    # the barriers' few bytes are counted too
    wire = (_lo_tx_bytes() - tx0) / steps
    res = {"method": method, "ms": [t * 1000 for t in times[warmup:]], "params": nparams,
           "compute_ms": [t * 1000 for t in compute[warmup:]], "wire_bytes": wire,
           "grads_ready": grads_ready, "post_ms": statistics.median(post[warmup:])}
    grad = _bench.grad_bytes(model)
    handed = None
    if state is not None:
        s = state.stats()
        res["ratio"] = s["compression_ratio"]
        res["ratio_source"] = "FastML state.stats(): fp32 ring bytes / bytes sent"
        res["mb_per_step"] = s["bytes_sent"] / 1e6 / s["steps"]
    elif counter is not None:
        handed = counter.bytes / steps
        res["ratio_source"] = "grad bytes / bytes passed to torch.distributed.all_reduce per step"
    else:  # DDP's own all-reduce (C++): once per step over each bucket's flat buffer
        handed = _bench.ddp_bucket_bytes(ddp)
        res["ratio_source"] = "grad bytes / DDP bucket buffer bytes per step"
    if state is None:
        res["ratio"] = grad / handed if handed else float("nan")
        res["collective_bytes_per_step"] = handed if handed else float("nan")
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()


def _run_method(method: str, steps: int, warmup: int, out: str, bucket_view: bool = False) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, method, steps, warmup, port, out, bucket_view), nprocs=2, join=True)


# -- the driver ------------------------------------------------------------------------------------------------
# What torch's c10d prints inside a fresh network namespace, once per rank and method (it cannot
# resolve the client address's name there; the connection itself is fine): 28 lines of a full run.
_NOISE = ("[c10d] The hostname of the client socket cannot be retrieved",)


def _run_quietly(cmd: list[str], timeout: float, env: dict | None = None) -> None:
    """Run one method's ranks, passing their stderr through except the lines in ``_NOISE``."""
    import threading

    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, errors="replace", env=env)
    watchdog = threading.Timer(timeout, proc.kill)  # a hung method: killed, as subprocess.run(timeout=) did
    watchdog.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if not any(n in line for n in _NOISE):
                sys.stderr.write(line)
        proc.wait()
    except BaseException:
        proc.kill()
        raise
    finally:
        watchdog.cancel()
    if proc.returncode:
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _setup_ns(name: str, rate: str | None) -> None:
    subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)
    _sh("ip", "netns", "add", name)
    _sh("ip", "-n", name, "link", "set", "lo", "up")
    if rate:
        _sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
            "burst", "512kb", "latency", "100ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", nargs="+", default=METHODS,
                    choices=METHODS + EXTRA_METHODS
                    + [m + BEFORE for m in METHODS + EXTRA_METHODS if m.startswith("fastml-")],
                    help=f"METHOD{BEFORE} runs METHOD with the fastml_strategy of --before")
    ap.add_argument("--before", help=f"a checkout (e.g. a git worktree of an earlier commit) whose "
                                     f"fastml_strategy the METHOD{BEFORE} methods import")
    ap.add_argument("--links", nargs="+", default=["1gbit", "none"],
                    help="tc rates to emulate ('none': no limit); anything but 'none' needs root")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the list of methods this many times, interleaved, and report the median "
                         "over every round's steps (a shared machine's load drifts between methods)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--csv", default=None,
                    help="default benchmarks/results/bench_allreduce_cpu.csv for the full run as root (every "
                         "method, both default links, one round), benchmarks/out/bench_allreduce.csv otherwise")
    ap.add_argument("--bucket-view", action="store_true",
                    help="DDP(..., gradient_as_bucket_view=True) for every method (DDP's own rows too): the "
                         "gradients are views into DDP's buckets, which saves a copy of every gradient into "
                         "its bucket during backward and one back after the all-reduce")
    ap.add_argument("--_run", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._run:
        _run_method(args._run, args.steps, args.warmup, args._out, args.bucket_view)
        return

    root = os.geteuid() == 0
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    full = (root and args.methods == METHODS and args.links == ["1gbit", "none"] and args.rounds == 1
            and args.steps == 8 and args.warmup == 3 and not args.bucket_view)
    args.csv = args.csv or _bench.default_csv("bench_allreduce_cpu.csv" if full else "bench_allreduce.csv", full)
    env0 = _bench.environment()
    print(f"bench_allreduce: {_bench.machine_line(env=env0)}; {_bench.load_line()}", flush=True)
    rows = []
    for link in args.links:
        ns = None
        if root:
            ns = f"fastml-bench-{os.getpid()}"
            _setup_ns(ns, None if link == "none" else link)
        elif link != "none":
            print(f"skipping link {link}: shaping the loopback needs root (ip netns + tc); run as root, "
                  f"or pass --links none", file=sys.stderr)
            continue
        try:
            for method in [m for _ in range(args.rounds) for m in args.methods]:
                with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
                    out = f.name
                cmd = [sys.executable, os.path.abspath(__file__), "--_run", method, "--_out", out,
                       "--steps", str(args.steps), "--warmup", str(args.warmup)] + \
                    (["--bucket-view"] if args.bucket_view else [])
                if ns:
                    cmd = ["ip", "netns", "exec", ns] + cmd
                if method.endswith(BEFORE) and not args.before:
                    ap.error(f"{method}: pass --before DIR (the checkout to compare against)")
                # the workers import this checkout's package, or --before's, installed or not
                code = os.path.abspath(args.before) if method.endswith(BEFORE) else repo
                env = {**os.environ, "PYTHONPATH": os.pathsep.join(
                    [code] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
                _run_quietly(cmd, timeout=900, env=env)
                with open(out) as f:
                    res = json.load(f)
                os.unlink(out)
                med = statistics.median(res["ms"])
                compute = statistics.median(res["compute_ms"])
                rate = _rate_bits(link)
                wire_ms = res["wire_bytes"] * 8 / rate * 1000 if (rate and ns) else float("nan")
                bound = max(compute, wire_ms) if rate and ns else compute
                sched = max(compute, _schedule_bound(res["grads_ready"], wire_ms, res["post_ms"])) \
                    if rate and ns else compute
                rows.append({"link": link, "method": method, "ms_per_step": med,
                             "ms_min": min(res["ms"]), "ms_max": max(res["ms"]),
                             "compute_ms": compute, "wire_mb_per_step": res["wire_bytes"] / 1e6 if ns else float("nan"),
                             "wire_ms": wire_ms, "bound_ms": bound, "x_bound": med / bound,
                             "sched_bound_ms": sched, "x_sched_bound": med / sched,
                             "compression_ratio": res["ratio"], "ratio_source": res["ratio_source"],
                             "collective_bytes_per_step": res.get("collective_bytes_per_step", float("nan")),
                             "params": res["params"], "load_avg_1m": os.getloadavg()[0],
                             "gradient_as_bucket_view": args.bucket_view,
                             "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())})
                print(f"{link:6s} {method:26s} {med:9.1f} ms/step  bound {bound:7.1f} ms "
                      f"(compute {compute:.1f}, wire {wire_ms:.1f})  x bound {med / bound:.2f}  "
                      f"schedule bound {sched:7.1f} ms  x {med / sched:.2f}  "
                      f"(ratio {res['ratio']:.2f}, load {os.getloadavg()[0]:.1f})", flush=True)
        finally:
            if ns:
                subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)

    import pandas as pd

    raw = pd.DataFrame(rows)
    if args.rounds > 1:
        _bench.write_csv(args.csv.replace(".csv", "_rounds.csv"), raw.to_dict("records"), env0)
    # one row per link and method: medians over the rounds (each round's figure is a median of steps)
    df = raw.groupby(["link", "method"], sort=False).agg(
        ms_per_step=("ms_per_step", "median"), ms_min=("ms_min", "min"), ms_max=("ms_max", "max"),
        compute_ms=("compute_ms", "median"), wire_mb_per_step=("wire_mb_per_step", "median"),
        wire_ms=("wire_ms", "median"), bound_ms=("bound_ms", "median"),
        sched_bound_ms=("sched_bound_ms", "median"),
        compression_ratio=("compression_ratio", "first"), ratio_source=("ratio_source", "first"),
        collective_bytes_per_step=("collective_bytes_per_step", "first"), params=("params", "first"),
        gradient_as_bucket_view=("gradient_as_bucket_view", "first"),
        load_avg_1m=("load_avg_1m", "median"), rounds=("ms_per_step", "size"),
        date_utc=("date_utc", "first")).reset_index()
    df["x_bound"] = df.ms_per_step / df.bound_ms
    df["x_sched_bound"] = df.ms_per_step / df.sched_bound_ms
    # the machine and software of the run; load_avg_1m above is each row's own (median over its rounds)
    _bench.write_csv(args.csv, df.to_dict("records"), env0)
    table = df.pivot(index="method", columns="link", values="ms_per_step").reindex(args.methods)
    links = list(table.columns)
    for link in links:
        table[f"bound ({link})"] = df[df.link == link].set_index("method")["bound_ms"]
        table[f"/ bound ({link})"] = table[link] / table[f"bound ({link})"]
        if link != "none":
            table[f"schedule bound ({link})"] = df[df.link == link].set_index("method")["sched_bound_ms"]
            table[f"/ schedule bound ({link})"] = table[link] / table[f"schedule bound ({link})"]
    for link in links:
        base = table.loc["ddp-fp32", link] if "ddp-fp32" in table.index else float("nan")
        table[f"x vs fp32 ({link})"] = base / table[link]
        if "torch-fp16" in table.index:
            table[f"x vs fp16 ({link})"] = table.loc["torch-fp16", link] / table[link]
    if "none" in table.columns and "ddp-fp32" in table.index:
        floor = table.loc["ddp-fp32", "none"]
        for link in [c for c in args.links if c != "none" and c in table.columns]:
            table[f"/ floor ({link})"] = table[link] / floor
    print(f"\n{_bench.machine_line(env=env0)}; {_bench.load_line()} at the end")
    print(f"2 ranks x 1 thread, gloo, MLP of {rows[0]['params'] / 1e6:.1f}M parameters, batch 8, "
          f"median of {args.steps} steps (ms/step); floor = ddp-fp32 with no rate limit; bound = "
          f"max(compute, wire bytes / link rate), compute = the same step without communication; "
          f"schedule bound = the latest gradient-ready time plus the wire time of the bytes not yet "
          f"computed then, plus SGD's step and zero_grad (see _schedule_bound)")
    print(table.to_markdown(floatfmt=".2f"))
    print(f"\nCSV: {args.csv}")


if __name__ == "__main__":
    main()
