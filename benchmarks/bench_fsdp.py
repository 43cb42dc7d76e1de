"""Step time of FSDP2 / HSDP with and without FastML's compressed gradient reduction, side by side, on
emulated slow links between nodes.

    sudo python benchmarks/bench_fsdp.py                  # both scenarios, shaped links and no limit
    sudo python benchmarks/bench_fsdp.py --quick          # smoke test: small model, few steps (~1-2 min)
    python benchmarks/bench_fsdp.py                       # no root: "no link limit" figures only
    sudo python benchmarks/bench_fsdp.py --scenarios hsdp --methods hsdp-bf16 fastml-int4 --steps 5

Model: a GPT-like decoder (token + position embedding, ``--layers`` pre-LN blocks of causal attention and
a 4x GELU MLP, final layer norm, untied head; 33.6M parameters by default, 2.1M with ``--quick``),
trained with fused AdamW on a synthetic bigram language (512 of the vocabulary's ids, each followed by
one of 4 fixed successors, so the loss falls from ln(V) towards ln 4). Each block is one FSDP unit
(``fully_shard`` per block, then the root); every rank uses 1 thread, gloo.

Scenarios (each method is one ``torchrun`` job, so its peak RSS is its own; ``--shared-process``, the
default of ``--quick``, runs all methods of a link in one job. As root each method gets the link below,
and then again with no limit, so the table shows how far each method is from its own compute floor):

- ``hsdp``: 4 ranks as 2 nodes x 2, HSDP on a ``("replicate", "shard")`` mesh. Each node is a network
  namespace; the two are joined by a veth pair whose ends are both shaped with
  ``tc qdisc add dev VETH root tbf rate 250mbit burst 512kb latency 100ms`` (250 Mbit/s each way). In
  each namespace ``GLOO_SOCKET_IFNAME=VETH torchrun --nnodes 2 --node-rank K --nproc-per-node 2
  --master-addr 10.77.0.1 ...``: gloo binds the veth address, so the two ranks of a node reach each
  other over the namespace's own (unshaped) loopback and only cross-node traffic - HSDP's
  cross-replica all-reduce - crosses the shaped link. Methods: FSDP's fp32 reduction, FSDP's
  ``MixedPrecisionPolicy(reduce_dtype=bfloat16)``, FastML int4 (``fastml_strategy.fsdp.register``
  compresses the cross-replica all-reduce; the intra-node reduce-scatter stays FSDP's fp32), FastML
  int8 / int2, and FastML int4 with ``reduce_dtype=bfloat16`` (the bf16 row's intra-node
  reduce-scatter, FastML across nodes; its codec then reads bf16).
- ``fsdp``: 2 ranks, 1-D FSDP, both in one namespace whose loopback is shaped to 1 Gbit/s (as in
  ``bench_allreduce.py``): all of FSDP's traffic (parameter all-gathers and gradient reduce-scatters of
  both ranks) shares one 1 Gbit/s link. Methods: fp32 FSDP, FSDP with
  ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=bfloat16)``, and FastML int4
  reduce-scatter with the same bf16 parameters (its reduce-scatter input is then bf16).

Per row: median ms per step over ``--steps`` steps after ``--warmup`` (a step's time is the slowest
rank's, every step starts at a barrier); the bytes that crossed the link per step (the interface's
own counter in the namespace, headers included) and that divided by the link rate ("wire ms": the
physical bound of the communication), next to the same method's step with no limit (its compute plus
codec time); gradient bytes sent per rank per step (FastML's ``state.stats()``, or computed from
FSDP's shard sizes for FSDP's own reduction, as an ideal ring would send them: gloo's reduce_scatter
is an all-reduce plus a slice and sends twice that, which the 1-D table derives from the wire); time
spent in the collectives and in FastML's codecs; peak RSS per rank; FastML's error-feedback memory;
the evaluation loss on a fixed batch after the same number of steps from the same seed and data (every
rank evaluates it; replicas must agree).

Without root the links cannot be shaped: the script then runs every rank on the host's loopback and
labels the figures "no link limit". The namespaces (and anything started in them) are removed at the
end, on failure and on SIGINT/SIGTERM too. Prints markdown tables and writes CSV (``--csv``; by default
``benchmarks/results/bench_fsdp_cpu.csv`` for the full run as root with every default, ``benchmarks/out/``
otherwise: a partial run passes ``--csv`` to land in ``benchmarks/results/``), atomically,
every row with the machine (CPU model, SIMD flags, cores), Python, torch and the load average before and
after (``benchmarks/_bench.py``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

# -- what can be measured -----------------------------------------------------------------------------------
# method -> (label, MixedPrecisionPolicy kind, FastML plan or None)
#   mp kinds: "fp32" (no policy), "reduce-bf16" (reduce_dtype=bf16), "bf16" (param and reduce dtype bf16)
METHODS = {
    "hsdp": {
        "hsdp-fp32": ("HSDP fp32 reduce", "fp32", None),
        "hsdp-bf16": ("HSDP bf16 reduce", "reduce-bf16", None),
        "fastml-int8": ("FastML int8 cross-node", "fp32", "int8"),
        "fastml-int4": ("FastML int4 cross-node", "fp32", "int4"),
        "fastml-int2": ("FastML int2 cross-node", "fp32", "int2"),
        # the same intra-node reduce-scatter as "hsdp-bf16" (bf16 on the loopback), FastML across nodes
        "fastml-int4-bf16": ("FastML int4 cross-node, bf16 reduce", "reduce-bf16", "int4"),
    },
    "fsdp": {
        "fsdp-fp32": ("FSDP fp32", "fp32", None),
        "fsdp-bf16": ("FSDP bf16 params + reduce", "bf16", None),
        "fastml-int4": ("FastML int4 reduce-scatter (bf16 params)", "bf16", "int4"),
        # opt-in: the parameter all-gathers quantized to int8 too (register(all_gather_bits=8))
        "fastml-int4-ag8": ("FastML int4 reduce-scatter + int8 all-gather (bf16 params)", "bf16", "int4+ag8"),
    },
}
BASELINES = {"hsdp": ("hsdp-fp32", "hsdp-bf16"), "fsdp": ("fsdp-fp32", "fsdp-bf16")}
LINKS = {"hsdp": "250mbit", "fsdp": "1gbit"}
NPROC = {"hsdp": (2, 2), "fsdp": (1, 2)}  # (nodes, ranks per node)

# The model (GPT-like, 8 blocks) and batch: HSDP with bf16 reduce should be communication-bound
# (step >= 5x its step with no limit) at 250 Mbit/s. On a 2-core machine (4 ranks, under load) the
# HSDP bf16 step with no limit hardly depended on the tokens (2.6 s at 1 x 128, 2.2 s at 1 x 32 and
# at 1 x 16): the per-parameter work (intra-node all-gathers and reduce-scatters on the loopback,
# copies, optimizer) dominates, and it grows with the model as the link's traffic does. So 1 x 32.
FULL = dict(layers=8, d_model=512, heads=8, vocab=8192, seq=32, batch=1, steps=6, warmup=2)
QUICK = dict(layers=8, d_model=128, heads=4, vocab=2048, seq=32, batch=1, steps=3, warmup=1)


# ======================================================================================================
# The worker: one rank of one method (runs under torchrun, inside a namespace when shaped)
# ======================================================================================================
def _model(cfg: dict):
    """The GPT-style decoder of ``gpt_workload.py`` at this benchmark's size (head without bias)."""
    from gpt_workload import GPT

    return GPT(cfg["layers"], cfg["d_model"], cfg["heads"], cfg["vocab"], cfg["seq"], head_bias=False)


ACTIVE_TOKENS = 512  # the language uses this many of the vocabulary's ids: in the few steps a benchmark
#                      runs, the loss falls visibly (9.0 -> 7.2 in 8 steps of the full model, lr 1e-3)


def _bigram_batch(vocab: int, batch: int, seq: int, seed: int, step: int):
    """Tokens of the synthetic language: ``ACTIVE_TOKENS`` ids, each followed by one of 4 fixed random
    successors (so the loss can fall from ln(vocab) towards ln 4)."""
    import torch
    from gpt_workload import language_batch

    active = min(vocab, ACTIVE_TOKENS)
    succ = torch.randint(active, (active, 4), generator=torch.Generator().manual_seed(1234))
    return language_batch(succ, torch.Generator().manual_seed(seed * 1_000_003 + step), batch, seq)


def _net_bytes(iface: str | None) -> int | None:
    """Transmitted bytes of ``iface`` in this process's network namespace (/proc/net/dev)."""
    if not iface:
        return None
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == iface:
                return int(rest.split()[8])
    return None


def _mem_kb(key: str) -> int:
    """VmRSS / VmHWM (peak RSS) of this process, in kB."""
    with open("/proc/self/status") as f:
        m = re.search(rf"^{key}:\s+(\d+)", f.read(), re.M)
    return int(m.group(1)) if m else 0


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0), so each method's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _worker(a: argparse.Namespace) -> None:
    import gc
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fastml_strategy.codecs as fm_codecs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(minutes=15))
    world = dist.get_world_size()
    nodes, per_node = NPROC[a.scenario]
    if world != nodes * per_node:
        raise SystemExit(f"bench_fsdp worker: {a.scenario} needs {nodes * per_node} ranks, got {world}")
    if a.scenario == "hsdp":
        mesh = init_device_mesh("cpu", (nodes, per_node), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))

    # -- timers: the collectives FSDP calls, FastML's compressed ones and FastML's codecs -------------
    acc = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": 0.0, "fastml": 0.0, "codec": 0.0,
           "fastml_wire": 0.0}

    def timed(fn, key):
        def f(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] += time.perf_counter() - t
        return f

    for name, key in (("all_gather_single", "all_gather"), ("reduce_scatter_single", "reduce_scatter"),
                      ("all_reduce", "all_reduce"),
                      # FastML's own collectives (FSDP calls neither)
                      ("all_to_all_single", "fastml_wire"), ("all_gather", "fastml_wire")):
        setattr(dist, name, timed(getattr(dist, name), key))
    for name in ("encode_chunk", "decode_chunk", "encode_dense", "decode_dense", "chunk_finite"):
        setattr(fm_codecs, name, timed(getattr(fm_codecs, name), "codec"))

    results = []
    for method in a.methods_csv.split(","):
        gc.collect()
        dist.barrier()
        results.append(_run_method(a, method, mesh, json.loads(a.cfg), acc, timed))
        gc.collect()
    if dist.get_rank() == 0:
        with open(a._out, "w") as f:
            json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def _run_method(a: argparse.Namespace, method: str, mesh, cfg: dict, acc: dict, timed) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    nodes, per_node = NPROC[a.scenario]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    hwm_ok = _reset_peak_rss()
    rss_start = _mem_kb("VmRSS")
    label, mp_kind, plan = METHODS[a.scenario][method]

    torch.manual_seed(cfg["seed"])  # the same initial model on every rank (FSDP2 shards what it is given)
    model = _model(cfg)
    nparams = sum(p.numel() for p in model.parameters())
    mp = {"fp32": MixedPrecisionPolicy(),
          "reduce-bf16": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
          "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}[mp_kind]
    # FSDP's default (the argument left out): blocks reshard after forward, the root does not (passing
    # True would reshard the root too: one more all-gather of the embeddings and head per step)
    reshard = bool(cfg["reshard_after_forward"])
    kw = {} if reshard else {"reshard_after_forward": False}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp, **kw)
    fully_shard(model, mesh=mesh, mp_policy=mp, **kw)

    # FSDP's own bytes per rank per step from its shard sizes (ideal ring algorithms; the interface
    # counters say what really crossed the link)
    S = per_node if a.scenario == "hsdp" else world
    R = nodes if a.scenario == "hsdp" else 1
    shard_numel = gather_numel = 0
    for i, u in enumerate([model] + list(model.blocks)):
        n = sum(fp.padded_sharded_param_size.numel()
                for g in u._get_fsdp_state()._fsdp_param_groups for fp in g.fsdp_params)
        shard_numel += n
        # the root stays unsharded from forward to backward; blocks are gathered again for backward
        # unless reshard_after_forward=False
        gather_numel += n * (2 if i > 0 and reshard else 1)
    red_size = 2 if mp_kind in ("reduce-bf16", "bf16") else 4
    par_size = 2 if mp_kind == "bf16" else 4
    computed = {
        "all_reduce": 2.0 * (R - 1) / R * shard_numel * red_size,  # HSDP: cross-replica ring all-reduce
        "reduce_scatter": (S - 1) * shard_numel * red_size,
        "all_gather": (S - 1) * gather_numel * par_size,
    }

    state = None
    if plan is not None:
        import fastml_strategy.fsdp as ff

        plan, _, ag_bits = plan.partition("+ag")  # "int4+ag8": all_gather_bits=8
        state = ff.register(model, plan=plan, layer_stats_every=0,
                            all_gather_bits=int(ag_bits) if ag_bits else None)
        state._reduce_scatter = timed(state._reduce_scatter, "fastml")
        state._all_reduce = timed(state._all_reduce, "fastml")

    # fused: one pass over each shard (the foreach AdamW makes ~10 on CPU)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0, fused=True)
    iface = os.environ.get("FASTML_BENCH_IFACE") if local_rank == 0 else None
    times, net0, prof = [], None, None
    for step in range(a.warmup + a.steps):
        x, y = _bigram_batch(cfg["vocab"], cfg["batch"], cfg["seq"], seed=cfg["seed"] + 1 + rank, step=step)
        dist.barrier()
        if step == a.warmup:
            net0 = _net_bytes(iface)
            for k in acc:
                acc[k] = 0.0
            if a.profile and rank == 0:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append((time.perf_counter() - t0) * 1000)
    timers = {k: v * 1000 / a.steps for k, v in acc.items()}
    profile_text = None
    if prof is not None:
        import io
        import pstats

        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        profile_text = buf.getvalue()
    dist.barrier()
    net1 = _net_bytes(iface)

    xe, ye = _bigram_batch(cfg["vocab"], 8, cfg["seq"], seed=999_999, step=0)
    with torch.no_grad():
        eval_loss = float(F.cross_entropy(model(xe).float().flatten(0, 1), ye.flatten()))
    me = {
        "rank": rank,
        "ms": times[a.warmup:],
        "eval_loss": eval_loss,
        "last_train_loss": float(loss),
        "rss_start_mb": rss_start / 1024,
        "peak_rss_mb": _mem_kb("VmHWM") / 1024 if hwm_ok else float("nan"),
        "timers_ms": timers,
        "net_bytes": (net1 - net0) if net0 is not None and net1 is not None else None,
        "computed_bytes": computed,
        "stats": None,
        "profile": profile_text,
    }
    if state is not None:
        s = state.stats()
        me["stats"] = {k: s[k] for k in ("steps", "bytes_sent", "bytes_uncompressed", "compression_ratio",
                                         "residual_bytes", "nonfinite_steps")}
        # gradient bytes only (the all-gather's, with all_gather_bits, are counted on the wire)
        me["stats"]["bytes_sent"] -= s.get("all_gather", {}).get("bytes_sent", 0)
        state.close()
    gathered = [None] * world
    dist.all_gather_object(gathered, me)
    return {"method": method, "scenario": a.scenario, "params": nparams, "world": world, "ranks": gathered}


# ======================================================================================================
# The driver: namespaces, links, launches, the table
# ======================================================================================================
_NAMESPACES: list[str] = []
_CHILDREN: list[subprocess.Popen] = []


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {r.stderr.strip()}")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stop(p: subprocess.Popen) -> None:
    """Stop one launcher and its workers: torchrun starts each worker in a session of its own, so
    killing the launcher's process group would leave them behind, blocked in a collective."""
    if p.poll() is not None:
        return
    tree = _descendants(p.pid)
    try:
        os.killpg(p.pid, signal.SIGTERM)  # torchrun passes it on to its workers
        p.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in [p.pid] + tree:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                mine = os.path.basename(sys.argv[0]).encode() in f.read()  # this script's, not a reused pid
            if mine:
                os.kill(pid, signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass
    p.wait()



def wait_then_stop(procs, timeout: float) -> None:
    """Wait up to ``timeout`` seconds for every launched process, then stop any left and forget them."""
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            _stop(p)
            _CHILDREN.remove(p)

def _cleanup() -> None:
    """Stop what this script started and remove its namespaces (their veth ends go with them)."""
    for p in _CHILDREN:
        _stop(p)
    _CHILDREN.clear()
    for ns in _NAMESPACES:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
    _NAMESPACES.clear()


def _on_signal(signum, frame):  # noqa: ARG001
    raise SystemExit(f"bench_fsdp: signal {signum}, cleaning up")


def _tbf(ns: str, dev: str, rate: str) -> None:
    _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate, "burst", "512kb",
        "latency", "100ms")


class Topology:
    """Where the ranks of one (scenario, link) run, and how to start them there."""

    def __init__(self, scenario: str, link: str | None, root: bool, shape: tuple[int, int] | None = None,
                 prefix: str = "fmb", script: str | None = None) -> None:
        # shape: (nodes, ranks per node), else the scenario's; prefix: of the namespaces' names;
        # script: what torchrun runs (benchmarks/bench_topology.py reuses this class)
        self.scenario, self.link = scenario, link
        self.nodes, self.per_node = shape or NPROC[scenario]
        self.script = os.path.abspath(script or __file__)
        # (netns prefix, environment, torchrun arguments) of each node's launcher
        self.launches: list[tuple[list[str] | None, dict, list[str]]] = []
        tag = f"{prefix}{os.getpid() % 100000}{scenario[0]}{'s' if link else 'n'}"
        if not root:
            assert link is None
            port = _free_port()
            self.launches.append((None, {"GLOO_SOCKET_IFNAME": "lo"},
                                  ["--nnodes", "1", "--nproc-per-node", str(self.nodes * self.per_node),
                                   "--master-addr", "127.0.0.1", "--master-port", str(port)]))
            return
        if scenario == "fsdp":
            ns = tag
            _NAMESPACES.append(ns)
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
            _sh("ip", "netns", "add", ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if link:
                _tbf(ns, "lo", link)
            self.launches.append((["ip", "netns", "exec", ns], {"GLOO_SOCKET_IFNAME": "lo",
                                                               "FASTML_BENCH_IFACE": "lo"},
                                  ["--nnodes", "1", "--nproc-per-node", str(self.per_node),
                                   "--master-addr", "127.0.0.1", "--master-port", "29500"]))
            return
        names = [f"{tag}{k}" for k in "ab"]
        for ns in names:
            _NAMESPACES.append(ns)
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
            _sh("ip", "netns", "add", ns)
        devs = [f"v{tag}{k}" for k in "ab"]
        _sh("ip", "link", "add", devs[0], "netns", names[0], "type", "veth", "peer", "name", devs[1],
            "netns", names[1])
        for k, (ns, dev) in enumerate(zip(names, devs)):
            _sh("ip", "-n", ns, "addr", "add", f"10.77.0.{k + 1}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            if link:
                _tbf(ns, dev, link)
            self.launches.append((["ip", "netns", "exec", ns], {"GLOO_SOCKET_IFNAME": dev,
                                                               "FASTML_BENCH_IFACE": dev},
                                  ["--nnodes", str(self.nodes), "--node-rank", str(k), "--nproc-per-node",
                                   str(self.per_node), "--master-addr", "10.77.0.1",
                                   "--master-port", "29500"]))

    def run(self, worker_args: list[str], out: str, timeout: float, log_path: str) -> dict:
        procs = []
        with open(log_path, "w") as log:
            for prefix, env_extra, targs in self.launches:
                env = dict(os.environ, OMP_NUM_THREADS="1", **env_extra)
                cmd = (prefix or []) + [sys.executable, "-m", "torch.distributed.run", *targs,
                                        self.script, *worker_args, "--_out", out]
                p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
                _CHILDREN.append(p)
                procs.append(p)
            wait_then_stop(procs, timeout)
        # torchrun agents may report an exit-barrier error at teardown: the result file is what counts
        if not os.path.exists(out) or os.path.getsize(out) == 0:
            with open(log_path) as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"bench_fsdp: {self.scenario} {worker_args} gave no result "
                               f"(exit codes {[p.returncode for p in procs]}); log {log_path}:\n{tail}")
        with open(out) as f:
            return json.load(f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rate_bits(rate: str) -> float:
    m = re.fullmatch(r"([\d.]+)\s*([kmg]?)bit", rate.lower())
    if not m:
        raise ValueError(f"link rate {rate!r}: use tc's form, e.g. 250mbit or 1gbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _machine() -> str:
    """The machine and software in one line (``_bench.machine_line``) and the codec's build."""
    import _bench

    march = os.environ.get("FASTML_CPU_MARCH", "native")
    return f"{_bench.machine_line()}; FastML's CPU codec built with -march={march}"


def _summarise(res: dict, link: str | None, cfg: dict) -> dict:
    ranks = res["ranks"]
    per_step = [max(r["ms"][i] for r in ranks) for i in range(len(ranks[0]["ms"]))]
    scen, method = res["scenario"], res["method"]
    label, _mp, plan = METHODS[scen][method]
    losses = [r["eval_loss"] for r in ranks]
    net = [r["net_bytes"] for r in ranks if r["net_bytes"] is not None]
    steps = len(per_step)
    # bytes per step per link direction: HSDP, the busier direction of the veth pair; FSDP, the loopback
    wire = max(net) / steps if net else None
    computed = ranks[0]["computed_bytes"]
    if plan is not None:
        sent = statistics.mean(r["stats"]["bytes_sent"] / r["stats"]["steps"] for r in ranks)
        src = "stats"
    else:
        sent = computed["all_reduce"] if scen == "hsdp" else computed["reduce_scatter"]
        src = "computed"
    timers = {k: statistics.mean(r["timers_ms"][k] for r in ranks) for k in ranks[0]["timers_ms"]}
    return {
        "scenario": scen, "link": link or "none", "method": method, "label": label, "plan": plan or "",
        "ms_per_step": statistics.median(per_step), "ms_min": min(per_step), "ms_max": max(per_step),
        "wire_bytes_per_step_link": wire,
        "wire_ms": wire * 8 / _rate_bits(link) * 1000 if (wire is not None and link) else None,
        "grad_bytes_sent_per_step_rank": sent, "grad_bytes_source": src,
        "computed_all_gather_bytes_rank": computed["all_gather"],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in ranks),
        "rss_at_start_mb": max(r["rss_start_mb"] for r in ranks),
        "residual_bytes": max(r["stats"]["residual_bytes"] for r in ranks) if plan else 0,
        "compression_ratio": (statistics.mean(r["stats"]["compression_ratio"] for r in ranks)
                              if plan else None),
        "final_loss": losses[0], "loss_spread_across_ranks": max(losses) - min(losses),
        "last_train_loss": statistics.mean(r["last_train_loss"] for r in ranks),
        "all_gather_ms": timers["all_gather"], "reduce_scatter_ms": timers["reduce_scatter"],
        "all_reduce_ms": timers["all_reduce"], "fastml_ms": timers["fastml"], "codec_ms": timers["codec"],
        "fastml_wire_ms": timers["fastml_wire"],
        "nonfinite_steps": max(r["stats"]["nonfinite_steps"] for r in ranks) if plan else 0,
        "params": res["params"], "world": res["world"], "batch": cfg["batch"], "seq": cfg["seq"],
        "steps": steps,
    }


def _fmt(v, spec: str = ".1f", none: str = "-") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return none
    return format(v, spec)


def _tables(rows: list[dict], scenarios: list[str], root: bool) -> str:
    out = []
    for scen in scenarios:
        rs = [r for r in rows if r["scenario"] == scen]
        if not rs:
            continue
        link = LINKS[scen] if root else None
        main = [r for r in rs if r["link"] == (link or "none")]
        nolim = {r["method"]: r for r in rs if r["link"] == "none"}
        fp32_m, bf16_m = BASELINES[scen]
        base = {r["method"]: r for r in main}
        where = (f"{LINKS[scen]} link" if root else "no link limit")
        if scen == "hsdp":
            out.append(f"\n### HSDP, 4 ranks as 2 nodes x 2, {where} between nodes")
        else:
            out.append(f"\n### FSDP (1-D), 2 ranks sharing a {where}" if root else
                       "\n### FSDP (1-D), 2 ranks, no link limit")
        r0 = main[0] if main else rs[0]
        out.append(f"GPT-like decoder, {r0['params'] / 1e6:.1f}M parameters, batch {r0['batch']} x "
                   f"{r0['seq']} tokens per rank, median of {r0['steps']} steps (ms/step; a step is the "
                   f"slowest rank's).\n")
        hdr = ["method", f"ms/step ({where})", "no limit", "wire MB/step/link", "wire ms",
               "no limit + wire", "grad MB sent/step/rank", "peak RSS MB/rank", "residual MB/rank",
               "final loss", "loss vs fp32", "x vs bf16", "x vs fp32"]
        if not root:
            hdr = ["method", "ms/step (no link limit)", "grad MB sent/step/rank", "peak RSS MB/rank",
                   "residual MB/rank", "final loss", "loss vs fp32", "x vs bf16", "x vs fp32"]
        out.append("| " + " | ".join(hdr) + " |")
        out.append("|" + "---|" * len(hdr))
        for r in main:
            nl = nolim.get(r["method"])
            fp32 = base.get(fp32_m)
            bf16 = base.get(bf16_m)
            src = "" if r["grad_bytes_source"] == "stats" else " (computed)"
            loss_rel = (r["final_loss"] / fp32["final_loss"] - 1) * 100 if fp32 else None
            cells = [r["label"]]
            if root:
                both = (nl["ms_per_step"] + r["wire_ms"]) if (nl and r["wire_ms"] is not None) else None
                cells += [_fmt(r["ms_per_step"]), _fmt(nl["ms_per_step"] if nl else None),
                          _fmt(wire / 1e6 if (wire := r["wire_bytes_per_step_link"]) else None, ".2f"),
                          _fmt(r["wire_ms"]), _fmt(both)]
            else:
                cells += [_fmt(r["ms_per_step"])]
            cells += [_fmt(r["grad_bytes_sent_per_step_rank"] / 1e6, ".2f") + src,
                      _fmt(r["peak_rss_mb"], ".0f"),
                      _fmt(r["residual_bytes"] / 1e6, ".1f"), _fmt(r["final_loss"], ".4f"),
                      _fmt(loss_rel, "+.2f") + "%" if loss_rel is not None else "-",
                      _fmt(bf16["ms_per_step"] / r["ms_per_step"] if bf16 else None, ".2f"),
                      _fmt(fp32["ms_per_step"] / r["ms_per_step"] if fp32 else None, ".2f")]
            out.append("| " + " | ".join(cells) + " |")
        if root and scen == "fsdp":
            # what FSDP's own reduce-scatter really sent: the link's bytes less the all-gathers' (computed)
            for r in main:
                if r["plan"] or not r["wire_bytes_per_step_link"]:
                    continue
                W = r["world"]
                rs = (r["wire_bytes_per_step_link"] - W * r["computed_all_gather_bytes_rank"]) / W
                out.append(f"\n{r['label']}: its reduce-scatter sent {rs / 1e6:.2f} MB per rank per step on "
                           f"the wire, {rs / r['grad_bytes_sent_per_step_rank']:.2f}x the ideal (W-1)/W of "
                           f"the gradients (gloo's reduce_scatter is an all-reduce plus a slice, "
                           f"pytorch/pytorch#118911; NCCL's is not).")
        if root and bf16_m in base and bf16_m in nolim:
            ratio = base[bf16_m]["ms_per_step"] / nolim[bf16_m]["ms_per_step"]
            verdict = ""
            if scen == "hsdp":
                verdict = (" (communication-bound by the issue's test: >= 5x)" if ratio >= 5 else
                           " (NOT communication-bound by the issue's test: < 5x)")
            out.append(f"\n{base[bf16_m]['label']}: {ratio:.2f}x its step with no link limit{verdict}.")
        if root:  # the targets are about the shaped links
            out.append(_targets(scen, base))
        # where the time goes
        out.append(f"\nWhere the time goes ({where}; ms per step, slowest rank; collectives are synchronous "
                   f"on CPU, so they add to compute):\n")
        hdr2 = ["method", "ms/step", "all-gather", "reduce-scatter", "all-reduce (FSDP)", "FastML collective",
                "of which codec", "of which all_to_all + all_gather", "rest (compute, optimizer)"]
        out.append("| " + " | ".join(hdr2) + " |")
        out.append("|" + "---|" * len(hdr2))
        for r in main:
            comm = r["all_gather_ms"] + r["reduce_scatter_ms"] + r["all_reduce_ms"] + r["fastml_ms"]
            out.append("| " + " | ".join([r["label"], _fmt(r["ms_per_step"]), _fmt(r["all_gather_ms"]),
                                          _fmt(r["reduce_scatter_ms"]), _fmt(r["all_reduce_ms"]),
                                          _fmt(r["fastml_ms"]), _fmt(r["codec_ms"]),
                                          _fmt(r["fastml_wire_ms"]),
                                          _fmt(r["ms_per_step"] - comm)]) + " |")
    return "\n".join(out)


def _targets(scen: str, base: dict) -> str:
    """The issue's targets, checked on this run's rows (the shaped link, or no limit without root)."""
    fp32_m, bf16_m = BASELINES[scen]
    f4 = base.get("fastml-int4")
    if f4 is None:
        return ""
    lines = []

    def check(name: str, got: float | None, need: float, better: str = ">=") -> None:
        if got is None:
            return
        ok = got >= need if better == ">=" else got <= need
        lines.append(f"{name}: {got:.2f} (target {better} {need:g}: {'met' if ok else 'MISSED'})")

    sp = lambda m: base[m]["ms_per_step"] / f4["ms_per_step"] if m in base else None  # noqa: E731
    if scen == "hsdp":
        check("FastML int4 x vs HSDP bf16 reduce", sp(bf16_m), 2.5)
        check("FastML int4 x vs HSDP fp32", sp(fp32_m), 4.0)
    else:
        check("FastML int4 x vs FSDP bf16", sp(bf16_m), 1.2)
    if fp32_m in base:
        check("FastML int4 loss vs fp32, |%|", abs(f4["final_loss"] / base[fp32_m]["final_loss"] - 1) * 100,
              1.0, "<=")
    return "\nTargets: " + "; ".join(lines) + "." if lines else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", nargs="+", default=["hsdp", "fsdp"], choices=["hsdp", "fsdp"])
    ap.add_argument("--methods", nargs="+", default=None,
                    help="subset of methods (names from both scenarios; default: all of each scenario)")
    ap.add_argument("--quick", action="store_true", help="small model, few steps: a smoke test of ~1-2 min")
    ap.add_argument("--shared-process", action="store_true",
                    help="run all methods of a link in one torchrun job (faster; the default with --quick). "
                         "Peak RSS is then reset per method (/proc/self/clear_refs) but memory the allocator "
                         "kept from an earlier method can hide part of a later one's")
    ap.add_argument("--no-limit-only", action="store_true",
                    help="skip the shaped links (what runs without root anyway)")
    for k in FULL:
        ap.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {FULL[k]} "
                        f"(--quick: {QUICK[k]})")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--reshard-after-forward", type=int, choices=[0, 1], default=1,
                    help="1 (FSDP's default): each block's parameters are gathered again for backward (the "
                         "root's are kept); 0: reshard_after_forward=False everywhere, one all-gather per "
                         "unit per step")
    ap.add_argument("--hsdp-link", default=LINKS["hsdp"],
                    help=f"rate of the link between the two nodes (tc's form; default {LINKS['hsdp']})")
    ap.add_argument("--fsdp-link", default=LINKS["fsdp"],
                    help=f"rate of the link the 1-D FSDP ranks share (default {LINKS['fsdp']})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true",
                    help="cProfile rank 0's timed steps; the top functions go to the log and the output")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per torchrun job")
    ap.add_argument("--csv", default=None, help="default benchmarks/results/bench_fsdp_cpu.csv for the full "
                    "run as root (every default), benchmarks/out/bench_fsdp_{quick,root,nolimit}.csv otherwise")
    # the worker's arguments (torchrun starts this file again with them)
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--_scenario", dest="scenario", help=argparse.SUPPRESS)
    ap.add_argument("--_methods", dest="methods_csv", help=argparse.SUPPRESS)
    ap.add_argument("--_cfg", dest="cfg", help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        _worker(a)
        return

    for scen, rate in (("hsdp", a.hsdp_link), ("fsdp", a.fsdp_link)):
        _rate_bits(rate)  # a clear error for a malformed rate, before anything starts
        LINKS[scen] = rate
    preset = QUICK if a.quick else FULL
    a.shared_process = a.shared_process or a.quick
    cfg = {k: (getattr(a, k) if getattr(a, k) is not None else preset[k]) for k in FULL}
    cfg.update(lr=a.lr, seed=a.seed, reshard_after_forward=a.reshard_after_forward)
    root = os.geteuid() == 0 and not a.no_limit_only
    if os.geteuid() != 0 and not a.no_limit_only:
        print("bench_fsdp: not root, so the links cannot be shaped (ip netns + tc need root): every rank "
              "runs on this host's loopback and the figures are labelled 'no link limit'. Run with sudo for "
              "the emulated 250 Mbit/s and 1 Gbit/s links.", file=sys.stderr)
    # benchmarks/results/ only for the run the docs quote (every default); a partial run as root must not
    # overwrite its CSV
    full = (root and not a.quick and sorted(a.scenarios) == ["fsdp", "hsdp"] and a.methods is None
            and LINKS == {"hsdp": "250mbit", "fsdp": "1gbit"} and all(getattr(a, k) is None for k in FULL))
    csv_path = a.csv or ("benchmarks/out/bench_fsdp_quick.csv" if a.quick else
                         "benchmarks/results/bench_fsdp_cpu.csv" if full else
                         "benchmarks/out/bench_fsdp_root.csv" if root else
                         "benchmarks/out/bench_fsdp_nolimit.csv")
    machine = _machine()
    load0 = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"bench_fsdp: {started:%Y-%m-%d %H:%M} UTC; {machine}; load average {load0[0]:.2f} {load0[1]:.2f} "
          f"{load0[2]:.2f}", flush=True)

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_signal)
    rows: list[dict] = []
    failed: list[str] = []
    logdir = tempfile.mkdtemp(prefix="bench_fsdp_")
    try:
        for scen in a.scenarios:
            methods = [m for m in METHODS[scen] if a.methods is None or m in a.methods]
            for link in ([LINKS[scen], None] if root else [None]):
                topo = Topology(scen, link, os.geteuid() == 0)
                try:
                    # one torchrun job per method (clean process, exact peak RSS), or, with
                    # --shared-process (--quick), one job for all methods of this link
                    jobs = [methods] if a.shared_process else [[m] for m in methods]
                    for job in jobs:
                        tag = f"{scen}-{link or 'none'}-{'+'.join(job)}"
                        out = os.path.join(logdir, tag + ".json")
                        wargs = ["--_worker", "--_scenario", scen, "--_methods", ",".join(job),
                                 "--_cfg", json.dumps(cfg), "--steps", str(cfg["steps"]),
                                 "--warmup", str(cfg["warmup"])] + (["--profile"] if a.profile else [])
                        t = time.monotonic()
                        try:
                            results = topo.run(wargs, out, a.timeout, os.path.join(logdir, tag + ".log"))
                        except RuntimeError as e:  # the other rows still run; the exit status says it
                            print(e, file=sys.stderr, flush=True)
                            failed.append(tag)
                            continue
                        for res in results:
                            row = _summarise(res, link, cfg)
                            rows.append(row)
                            prof = res["ranks"][0].get("profile")
                            if prof:
                                print(f"--- profile of rank 0, {scen} {link or 'no limit'} "
                                      f"{res['method']}:\n{prof}")
                            print(f"{scen:4s} {link or 'no limit':8s} {res['method']:16s} "
                                  f"{row['ms_per_step']:9.1f} ms/step  loss {row['final_loss']:.4f}  "
                                  f"wire {_fmt(row['wire_ms'])} ms  grad "
                                  f"{row['grad_bytes_sent_per_step_rank'] / 1e6:.2f} MB/rank  "
                                  f"peak RSS {row['peak_rss_mb']:.0f} MB  ({time.monotonic() - t:.0f} s)",
                                  flush=True)
                finally:
                    _cleanup()
    finally:
        _cleanup()

    load1 = os.getloadavg()
    if not rows:
        raise SystemExit(f"bench_fsdp: every job failed ({', '.join(failed)}); logs in {logdir}")
    import _bench

    _bench.write_csv(csv_path, [dict(r, date_utc=f"{started:%Y-%m-%d %H:%M}", machine=machine,
                                     load_before=f"{load0[0]:.2f}", load_after=f"{load1[0]:.2f}")
                                for r in rows])
    cmd = " ".join(["sudo" if root else "", "python", "benchmarks/bench_fsdp.py", *sys.argv[1:]]).strip()
    print(f"\n## FSDP2 / HSDP step time with FastML (`benchmarks/bench_fsdp.py`)\n")
    print(f"`{cmd}` ({started:%Y-%m-%d}, {machine}; load average {load0[0]:.2f} before, {load1[0]:.2f} "
          f"after; 1 thread per rank, gloo; AdamW lr {cfg['lr']:g}, {cfg['warmup']} warm-up + {cfg['steps']} "
          f"timed steps; " + ("FSDP's default reshard_after_forward (blocks gathered again for backward)"
                              if cfg["reshard_after_forward"] else "reshard_after_forward=False") + "). "
          + ("Links emulated with tc tbf (burst 512kb, latency 100ms); 'wire' is what the interface counted "
             "per step (headers included), 'wire ms' that divided by the link rate; 'no limit' is the same "
             "method with the link unshaped." if root else
             "**No link limit**: links not shaped (that needs root), so these are not the issue's figures."))
    print(_tables(rows, a.scenarios, root))
    print(f"\nCSV: {csv_path}")
    if failed:
        raise SystemExit(f"bench_fsdp: {len(failed)} job(s) failed: {', '.join(failed)}; logs in {logdir}")
    shutil.rmtree(logdir, ignore_errors=True)


if __name__ == "__main__":
    main()
