"""N machines, measured: plain DDP, torch's fp16 hook and FastML's compressed all-reduce on N = 2, 4, 8
and 16 emulated machines, each row beside the cost model's prediction and the physical bound.

    sudo python benchmarks/bench_scale.py                          # every default: the RESULTS.md table
    sudo python benchmarks/bench_scale.py --shapes 16x1 --links 1gbit:0.5ms --methods ddp int4

Machines: network namespaces on one Linux bridge (:class:`_netns.Star`: names ``scale<pid>m<k>``,
addresses 10.88.0.0/16), every machine's link shaped to a rate (``tbf``, both directions) and a
one-way delay (netem, or where the kernel has no ``sch_netem`` an NFQUEUE delay program; see
``benchmarks/_netns.py``; TCP's slow start after idle is off, as on a tuned cluster). ``--shapes NxR``:
N machines of R ranks (default 1 rank at N = 2..16, 2 ranks at N = 2..8); ``--links RATE:DELAY``
(default 1 Gbit/s with 0.5 ms, 100 Mbit/s with 5 ms). Each (shape, link) is one job: every rank is
its own process (1 thread, gloo), started directly in its machine's namespace with torchrun's
environment, so FastML sees R from ``LOCAL_WORLD_SIZE`` as under torchrun.

Model: ``--layers`` Linear(WIDTH, WIDTH) + ReLU and a Linear(WIDTH, 10) head (3 x 2048: 12.6M
parameters, 50 MB of fp32 gradient), batch ``--batch`` (2), SGD, DDP's default buckets. Realistic
gradient sizes with little compute, so that 16 processes fit on 2 cores and the wire, not the cores,
sets the pace wherever it can.

Per job, first a *profile under contention*: every rank at once runs the autotuner's own profiler
(:func:`fastml_strategy.autotune.profile.profile_workload`: forward, backward and optimizer time,
when each gradient is ready, each codec's round trip per layer), so compute and codec are timed with
as many processes sharing the cores as in the measured steps (16 processes on 2 cores take about 8x
one process's time; on a machine of its own a rank would not). The cost model's inputs are that
profile (the median over ranks), N, R and the link's nominal rate and delay; its output is
``costmodel.step_time`` for the plan the method runs (plain DDP: ``hook=False``; torch's fp16 hook:
``hook=False, ring_element_bytes=2``).

Methods (``--methods``): ``ddp`` (gloo's ring all-reduce, fp32), ``fp16-hook``
(``default_hooks.fp16_compress_hook``), FastML ``none``, ``int4``, ``int4-ring``, ``int4-halving``,
``topk1`` (``register_hook(ddp, plan=Plan.from_recipe(recipe, schedule=...))`` as a user writes it,
hierarchical where R > 1; ``int4`` is ``Plan.schedule="auto"`` with the emulated link as the plan's
link hint, as the autotuner writes it, the others force ``"ring"`` (today's all_to_all + all_gather)
or ``"halving"`` (recursive halving / doubling)). The schedule column is what ``stats()["schedules"]``
says ran; ``predicted_schedule`` what the cost model priced. ``floor``: the same DDP steps with a
comm hook that hands its bucket back and sends nothing, priced as the profile's compute: what the
shared cores need before any communication (with ``--links 100gbit``, no delay, a link no step comes
near, it is the emulation's floor at that N).

Codec scales: the hook's codec work costs more than the profiled round trips (flattening, residual
updates, its thread competing with backward). As the autotuner does on the cluster it profiles,
``costmodel.fit_codec_scale`` fits one multiplier per codec family to the measured int4 and topk1
steps of the 2-machine job of each link, and ``predicted_cal_ms`` / ``step_error_cal_pct`` apply it at
every N (out of sample at N > 2); ``predicted_ms`` is the model with no fit at all.
``--from-json DIR[,DIR]`` prices saved jobs again (each with its own profile) without running them.

Per row: median ms per step over ``--steps`` after ``--warmup`` (a step is the slowest rank's; every
step starts at a barrier); bytes that left each machine per step (its ``eth0``'s ``tx_bytes``: TCP/IP
headers and ACKs included; the mean over machines); the cost model's step and bytes and their errors;
the physical bound ``max(compute + codec, bytes x 8 / rate + rounds x delay)`` (compute and codec from
the profile under contention and the model's codec count, bytes as measured, ``rounds`` the latency
rounds the model counts for the schedule: its step time on an infinitely fast link of the same delay,
over the delay) and the step over it; the loss on a fixed batch after the steps (replicas must agree).
CSV (``--csv``; default ``benchmarks/results/bench_scale_cpu.csv`` for the run with every default,
``benchmarks/out/`` otherwise), every row with the machine and the load average. Namespaces, the
bridge, the veths and every process started are removed on exit, on failure, on Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _netns  # noqa: E402  the N-machine star
import bench_fsdp as bf  # noqa: E402  cleanup registry, rate parsing, machine line

METHODS = {
    "ddp": "plain DDP (gloo's ring all-reduce, fp32)",
    "fp16-hook": "torch's fp16_compress_hook",
    "none": "FastML, plan none",
    "int4": "FastML, plan int4, Plan.schedule 'auto' with the link as hint (its choice per bucket)",
    "int4-ring": "FastML, plan int4, Plan.schedule 'ring' (all_to_all + all_gather: today's)",
    "int4-halving": "FastML, plan int4, Plan.schedule 'halving' (recursive halving / doubling)",
    "topk1": "FastML, plan topk1",
    "floor": "no communication: DDP with a hook that hands its bucket back (the emulation's CPU floor)",
}
# method -> (recipe, Plan.schedule) for register_hook(plan=Plan.from_recipe(recipe, schedule=...))
PLANS = {"none": ("none", "auto"), "int4": ("int4", "auto"), "int4-ring": ("int4", "ring"),
         "int4-halving": ("int4", "halving"), "topk1": ("topk1", "auto")}
SHAPES = ["2x1", "4x1", "8x1", "16x1", "2x2", "4x2", "8x2"]
LINKS = ["1gbit:0.5ms", "100mbit:5ms"]
DEFAULTS = dict(layers=3, width=2048, batch=2, steps=4, warmup=2)
PROFILE_OPTIONS = ["none", "fp16", "int4", "topk1"]


# -- the model: bench_topology's MLP and teacher-labelled batches ----------------------------------------
from bench_topology import _batch, _model  # noqa: E402


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=0.05)


# -- the workers -------------------------------------------------------------------------------------------
def _profile(a, rank: int, world: int) -> dict:
    """The autotuner's profile of this rank's training, taken while every rank takes its own."""
    import torch

    from fastml_strategy.autotune.profile import profile_workload
    from fastml_strategy.autotune.workload import Workload

    def batches():
        step = 0
        while True:
            yield _batch(a, rank, step)
            step += 1

    wl = Workload(model=_model(a), batches=batches,
                  loss_fn=lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), optimizer=_sgd)
    return profile_workload(wl, steps=3, warmup=1, options=PROFILE_OPTIONS, world_size=world).to_dict()


def _no_communication(state, bucket):  # unannotated: DDP checks a hook's annotations
    """DDP's bucketing and copies with nothing sent: what every rank's cores do besides communicating."""
    import torch

    fut = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _hooked(a, method: str, model):
    """DDP over ``model`` with ``method``'s communication; (ddp, FastML state or None). The plan's
    link hint is the emulated link (as the autotuner writes it), for the "auto" schedule's choice."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastml_strategy as fm

    ddp = DDP(model)
    if method == "floor":
        ddp.register_comm_hook(None, _no_communication)
    elif method == "fp16-hook":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method in PLANS:
        recipe, schedule = PLANS[method]
        plan = fm.Plan.from_recipe(recipe, schedule=schedule, link_latency_us=a.link_us, link_gbps=a.link_gbps)
        return ddp, fm.register_hook(ddp, plan=plan)
    return ddp, None


def _run_method(a, method: str, rank: int, local0: bool, machines: int) -> dict:
    """Time ``--steps`` steps of ``method`` (after ``--warmup``) and count what left the machines."""
    import torch
    import torch.distributed as dist

    model = _model(a)
    ddp, state = _hooked(a, method, model)
    opt = _sgd(ddp.parameters())
    times, cpus, tx0, tx1 = [], [], None, None
    for step in range(a.warmup + a.steps):
        x, y = _batch(a, rank, step)
        dist.barrier()
        if step == a.warmup:
            tx0 = _netns.tx_bytes()
        t0, c0 = time.perf_counter(), time.process_time()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()
        dt = torch.tensor([time.perf_counter() - t0])
        cpu = time.process_time() - c0  # every thread of this rank, user + system (its share of TCP)
        dist.barrier()
        if step == a.warmup + a.steps - 1:
            tx1 = _netns.tx_bytes()
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if step >= a.warmup:
            times.append(float(dt))
            cpus.append(cpu)
    cpu_all = torch.tensor([statistics.median(cpus)])
    dist.all_reduce(cpu_all)  # CPU seconds per step, all ranks together
    node = torch.tensor([float(tx1 - tx0) / a.steps if local0 and tx0 is not None and tx1 is not None else 0.0])
    dist.all_reduce(node)  # the sum over machines: each machine's local rank 0 adds its eth0's bytes
    with torch.no_grad():
        x, y = _batch(a, 10 ** 6, 0)
        loss = float(torch.nn.functional.cross_entropy(model(x), y))
    res = {"ms": 1e3 * statistics.median(times), "node_bytes": float(node) / machines, "loss": loss,
           "cpu_all_ms": 1e3 * float(cpu_all),
           "schedule": "none" if method == "floor" else "ring"}
    if state is not None:
        st = state.stats()
        ran = "+".join(k for k, v in st.get("schedules", {}).items() if v.get("buckets")) or "ring"
        res["schedule"] = ("hierarchical/" if state.hierarchical else "") + ran
        res["hook_bytes_per_step"] = st["bytes_sent"] / max(1, st.get("steps", a.warmup + a.steps))
        state.close()
    return res


def _worker(a) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=a.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    R = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local0 = int(os.environ.get("LOCAL_RANK", "0")) == 0
    dist.barrier()
    prof = _profile(a, rank, world)
    profiles = [None] * world
    dist.all_gather_object(profiles, prof)
    out = {"profiles": profiles, "methods": {}, "load_start": list(os.getloadavg())}
    for method in a.methods_csv.split(","):
        out["methods"][method] = _run_method(a, method, rank, local0, world // R)
        if rank == 0:  # after every method: a job that fails later (a rank killed) keeps these
            print(f"  {method}: {out['methods'][method]['ms']:.0f} ms", flush=True)
            out["load_end"] = list(os.getloadavg())
            from fastml_strategy._io import atomic_open

            with atomic_open(a._out, "w") as f:
                json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


# -- the cost model and the bound (pure: tests/test_bench_scale.py) -------------------------------------
def combined_profile(dicts: list[dict]):
    """One :class:`~fastml_strategy.autotune.costmodel.Profile` from every rank's: the median over
    ranks of each time (compute, ready times, codec round trips); errors and sizes from rank 0."""
    from fastml_strategy.autotune.costmodel import Profile

    profs = [Profile.from_dict(d) for d in dicts]
    p = profs[0]
    med = statistics.median
    p.forward_s, p.backward_s, p.optimizer_s = (med(getattr(q, k) for q in profs)
                                                 for k in ("forward_s", "backward_s", "optimizer_s"))
    for i, lp in enumerate(p.layers):
        lp.ready_s = med(q.layers[i].ready_s for q in profs)
        lp.codec_s = {o: med(q.layers[i].codec_s[o] for q in profs) for o in lp.codec_s}
    return p


def option_for(machines: int, ranks: int, rate_bits: float, delay_s: float):
    """The emulated cluster as the autotuner's :class:`HardwareOption`: the link's nominal rate and
    delay, its payload rate (``costmodel.tcp_payload_link``: TCP/IP headers take 4.4% at MTU 1500)
    as the link the model prices."""
    from fastml_strategy.autotune.catalog import HardwareOption
    from fastml_strategy.autotune.costmodel import tcp_payload_link

    return HardwareOption(name=f"{machines}x{ranks}", nodes=machines, accelerators_per_node=ranks,
                          price_per_hour=0.0, bandwidth_gbps=rate_bits / 1e9, latency_us=delay_s * 1e6,
                          compute_speed=1.0, measured_link=tcp_payload_link(rate_bits, delay_s))


def predict(profile, method: str, option) -> dict:
    """The cost model's step (s), bytes leaving each machine, codec seconds and latency rounds of
    ``method`` on ``option`` (rounds: the model's step on an infinitely fast link of the same delay,
    less the same with no delay, over the delay)."""
    import dataclasses

    from fastml_strategy.autotune.catalog import Link
    from fastml_strategy.autotune.costmodel import step_time

    tunable = [lp.name for lp in profile.layers if lp.tunable]
    if method == "floor":  # no wire: the profile's compute only
        compute = step_time(profile, {}, option, hook=False).compute_s
        return {"step_s": compute, "node_bytes": 0.0, "codec_s": 0.0, "compute_s": compute, "rounds": 0.0,
                "topology": "flat", "schedules": "none"}
    kw = dict(hook=False) if method in ("ddp", "fp16-hook") else {"schedule": PLANS[method][1]}
    if method == "fp16-hook":
        kw["ring_element_bytes"] = 2
    choice = {n: PLANS[method][0] for n in tunable} if method in PLANS else {}
    br = step_time(profile, choice, option, **kw)
    if kw.get("schedule") == "auto" and br.schedules in ("ring", "halving"):
        kw["schedule"] = br.schedules  # the rounds of the schedule chosen on the real link
    delay = option.link.latency_s
    fast = dataclasses.replace(option, measured_link=Link(1e18, delay))
    lat = step_time(profile, choice, fast, **kw).wire_s
    nolat = step_time(profile, choice, dataclasses.replace(option, measured_link=Link(1e18, 0.0)), **kw).wire_s
    return {"step_s": br.step_s, "node_bytes": br.node_net_bytes, "codec_s": br.codec_s,
            "compute_s": br.compute_s, "rounds": (lat - nolat) / delay if delay > 0 else 0.0,
            "topology": br.topology, "schedules": br.schedules or "ring"}


def physical_bound(compute_s: float, codec_s: float, node_bytes: float, rate_bits: float, rounds: float,
                   delay_s: float) -> float:
    """Seconds a step cannot beat: the cores' work, or the wire's (bytes at the rate plus the
    schedule's latency rounds), whichever is longer (perfect overlap of the two)."""
    return max(compute_s + codec_s, node_bytes * 8.0 / rate_bits + rounds * delay_s)


def build_row(shape: tuple[int, int], link: str, method: str, measured: dict, pred: dict, rate_bits: float,
              delay_s: float) -> dict:
    """One CSV row: measurement, prediction, their errors, and the bound (``rate_bits``: the payload
    rate, ``option.link``'s)."""
    N, R = shape
    ms, node = measured["ms"], measured["node_bytes"]
    bound = physical_bound(pred["compute_s"], pred["codec_s"], node, rate_bits, pred["rounds"], delay_s)
    pct = lambda p, m: round(100.0 * (p - m) / m, 1) if m else None  # noqa: E731
    return {
        "machines": N, "ranks_per_machine": R, "world": N * R, "link": link, "method": method,
        "schedule": measured.get("schedule", "ring"), "predicted_schedule": pred.get("schedules", ""),
        "ms_per_step": round(ms, 1),
        "MB_per_machine_step": round(node / 1e6, 3),
        "predicted_ms": round(1e3 * pred["step_s"], 1), "step_error_pct": pct(1e3 * pred["step_s"], ms),
        "predicted_MB": round(pred["node_bytes"] / 1e6, 3), "bytes_error_pct": pct(pred["node_bytes"], node),
        "compute_ms": round(1e3 * pred["compute_s"], 1), "codec_ms": round(1e3 * pred["codec_s"], 1),
        "wire_ms": round(1e3 * node * 8.0 / rate_bits, 1), "latency_rounds": round(pred["rounds"], 1),
        "bound_ms": round(1e3 * bound, 1), "x_bound": round(ms / (1e3 * bound), 2),
        "loss": round(measured["loss"], 4),
        # CPU seconds per step of all ranks together (user + system: compute, codec, gloo, the ranks'
        # share of TCP), and that over the host's cores: what the shared cores alone need per step
        "cpu_all_ranks_ms": round(measured.get("cpu_all_ms", float("nan")), 1),
        "cpu_bound_ms": round(measured.get("cpu_all_ms", float("nan")) / (os.cpu_count() or 1), 1),
    }


# -- the driver --------------------------------------------------------------------------------------------
def _shape(s: str) -> tuple[int, int]:
    n, _, r = s.partition("x")
    if not (n.isdigit() and r.isdigit() and int(n) >= 2 and int(r) >= 1):
        raise SystemExit(f"bench_scale: shape {s!r}: give MACHINESxRANKS, e.g. 16x1 or 8x2")
    return int(n), int(r)


def _link(s: str) -> tuple[str, str, float, float]:
    rate, _, delay = s.partition(":")
    return rate, delay, bf._rate_bits(rate), _netns.delay_us(delay or "0us") * 1e-6


def _job(a, shape, link, tmp) -> dict:
    rate, delay, _, _ = _link(link)
    N, R = shape
    star = _netns.Star(N, rate, delay or None)
    out = os.path.join(tmp, f"{N}x{R}_{rate}_{delay}.json")
    worker = ["--_worker", "--_methods", ",".join(a.methods), "--timeout", str(a.timeout),
              "--_link_us", str(_netns.delay_us(delay or "0us")), "--_link_gbps", str(bf._rate_bits(rate) / 1e9)] + [
        x for k in DEFAULTS for x in (f"--{k}", str(getattr(a, k)))]
    t0 = time.monotonic()
    try:
        star.run(os.path.abspath(__file__), worker, R, out, a.timeout, out + ".log")
    finally:
        bf._cleanup()
    if a.keep_json:
        os.makedirs(a.keep_json, exist_ok=True)
        shutil.copy(out, a.keep_json)
    print(f"{N}x{R} {link} ({star.delay_by}): {time.monotonic() - t0:.0f} s; {_load()}", flush=True)
    with open(out) as f:
        return json.load(f)


def _load() -> str:
    import _bench

    return _bench.load_line()


def codec_scales(res_2x1: dict, link: str) -> dict[str, float]:
    """The cost model's codec-time scales (``costmodel.fit_codec_scale``, as the autotuner fits them
    on the cluster it profiles) from a 2-machine, 1-rank job's measured int4 and topk1 steps: what
    the hook's codec work costs beyond the profiled round trips. Fitted once per link, at N = 2, and
    applied at every N (so the rows at N > 2 are out of sample)."""
    from fastml_strategy.autotune.costmodel import fit_codec_scale

    _, _, rate_bits, delay_s = _link(link)
    prof = combined_profile(res_2x1["profiles"])
    measured = {PLANS[m][0]: res_2x1["methods"][m]["ms"] / 1e3 for m in ("int4", "topk1") if m in res_2x1["methods"]}
    return fit_codec_scale(prof, option_for(2, 1, rate_bits, delay_s), measured)


def _rows(a, shape, link, res, scales: dict[str, float] | None = None) -> list[dict]:
    import _bench

    _, _, rate_bits, delay_s = _link(link)
    prof = combined_profile(res["profiles"])
    option = option_for(*shape, rate_bits, delay_s)
    env = _bench.environment()
    if "load_start" in res:  # the load while the job ran, not when it is priced
        env.update({"load_1m": round(res["load_start"][0], 2), "load_1m_end": round(res["load_end"][0], 2)})
    rows = []
    for m in a.methods:
        if m not in res["methods"]:
            continue
        row = build_row(shape, link, m, res["methods"][m], predict(prof, m, option), option.link.bandwidth_Bps * 8,
                        delay_s)
        if scales is not None:  # the same with the codec scales fitted at N = 2
            prof.codec_scale = dict(scales)
            cal = predict(prof, m, option)
            prof.codec_scale = {}
            row["predicted_cal_ms"] = round(1e3 * cal["step_s"], 1)
            row["step_error_cal_pct"] = round(100.0 * (1e3 * cal["step_s"] - row["ms_per_step"]) / row["ms_per_step"], 1)
            row["codec_scales"] = " ".join(f"{k}={v:.2f}" for k, v in sorted(scales.items()))
        rows.append({**row, "nominal_rate_bits": rate_bits, **env})
    return rows


def _print(rows: list[dict]) -> None:
    cols = ["machines", "ranks_per_machine", "link", "method", "schedule", "ms_per_step", "predicted_ms",
            "step_error_pct", "MB_per_machine_step", "predicted_MB", "bytes_error_pct", "bound_ms", "x_bound", "cpu_bound_ms"] + (["predicted_cal_ms", "step_error_cal_pct"]
                                                               if rows and "predicted_cal_ms" in rows[0] else [])
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join("-" if r.get(c) is None else str(r[c]) for c in cols) + " |")


def _reprice(a) -> None:
    """Rows again from saved job results (``--from-json``), e.g. after a change to the cost model."""
    import _bench

    jobs = []  # (link, shape, run, result): each run priced with its own profile
    for d in a.from_json.split(","):
        for name in os.listdir(d):
            if name.endswith(".json"):
                shape_s, rate, delay = name[:-5].split("_")
                with open(os.path.join(d, name)) as f:
                    jobs.append((f"{rate}:{delay}", _shape(shape_s), os.path.basename(d.rstrip("/")), json.load(f)))
    scales = {}
    for link, shape, _, res in jobs:
        if shape == (2, 1) and "int4" in res["methods"] and link not in scales:
            scales[link] = codec_scales(res, link)
    rows = []
    for link, shape, run, res in sorted(jobs, key=lambda j: (j[0], j[1][1], j[1][0], j[2])):
        a.methods = [m for m in METHODS if m in res["methods"]]
        rows += [{"run": run, **r} for r in _rows(a, shape, link, res, scales.get(link))]
    csv_path = a.csv or _bench.default_csv("bench_scale_cpu.csv", False)
    _bench.write_csv(csv_path, rows)
    _print(rows)
    print(f"CSV: {csv_path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="MACHINESxRANKS")
    ap.add_argument("--links", nargs="+", default=LINKS, help="RATE:DELAY (tc's and netem's forms)")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    for k, v in DEFAULTS.items():
        ap.add_argument(f"--{k}", type=int, default=v)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per job")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--from-json", default=None, metavar="DIR",
                    help="price the jobs saved in DIR again (no run, no root): NxR_RATE_DELAY.json files; "
                         "several DIRs comma-separated (each job priced with its own profile; column run: "
                         "its DIR); the codec scales are fitted on each link's first 2x1 job")
    ap.add_argument("--keep-json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "scale_jobs"),
                    metavar="DIR", help="where each job's raw result is copied (for --from-json)")
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_methods", dest="methods_csv", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    ap.add_argument("--_link_us", dest="link_us", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--_link_gbps", dest="link_gbps", type=float, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        _worker(a)
        return
    if a.from_json:
        _reprice(a)
        return
    if os.geteuid() != 0:
        raise SystemExit("bench_scale: needs root (ip netns, veth, bridge, tc) for the emulated machines")
    shapes, links = [_shape(s) for s in a.shapes], list(a.links)
    for link in links:
        _link(link)
    import _bench

    defaults = (a.shapes == SHAPES and a.links == LINKS and a.methods == list(METHODS)
                and all(getattr(a, k) == v for k, v in DEFAULTS.items()))
    csv_path = a.csv or _bench.default_csv("bench_scale_cpu.csv", defaults)
    _netns.install_signal_handlers("bench_scale")
    print(f"bench_scale: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {bf._machine()}; "
          f"{_load()}", flush=True)
    rows: list[dict] = []
    tmp = tempfile.mkdtemp(prefix="scale_bench_")
    try:
        for link in links:
            for shape in shapes:
                rows += _rows(a, shape, link, _job(a, shape, link, tmp))
                _bench.write_csv(csv_path, rows)  # after every job: an interrupted run keeps its rows
    finally:
        bf._cleanup()
    _print(rows)
    print(f"CSV: {csv_path}")


if __name__ == "__main__":
    main()
