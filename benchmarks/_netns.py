"""N emulated machines on one Linux host: a star of veth pairs around a bridge, every machine's link
shaped to a rate and a one-way delay.

    hub namespace                     machine k's namespace
    br0 --- m0 <====== veth ======> eth0  10.88.0.1/16  (ranks 0..R-1)
        --- m1 <====== veth ======> eth0  10.88.0.2/16  (ranks R..2R-1)
        ...

- Each machine is a network namespace holding one end of a veth pair (``eth0``, address
  ``10.88.0.(k+1)/16`` by default); the other end (``m<k>``) sits in a hub namespace, enslaved to a
  bridge: a switch with one port per machine. Nothing is added to the host's own namespace.
- Rate: ``tbf rate RATE`` on the machine's uplink (``eth0`` egress) and on its downlink (the hub
  port's egress), so each machine sends and receives at most RATE (full duplex, as a switch port).
- Delay: every packet one machine sends another is held DELAY, so a message between two machines
  takes DELAY one way (a round trip 2 x DELAY) plus its serialisation. ``tc ... netem delay`` on the
  uplink does it where the kernel has ``sch_netem``; this machine's kernel has neither netem nor fq,
  so there the packets a machine *receives* (``INPUT -i eth0``) go to an NFQUEUE (``iptables-legacy``'s
  xt target) and a small C program (``benchmarks/_delayd.c``, built with gcc on first use) accepts
  each one DELAY after it arrived, without copying its payload. On the receiving side, not the
  sending one: a packet held before the sender's device still counts against its socket's TCP Small
  Queues budget (netem orphans it for this reason), which measured 1.1 MB/s at 5 ms, not 12.5.
- ``net.ipv4.tcp_slow_start_after_idle=0`` in every machine: a cluster's training traffic does not
  restart TCP's window after each step's compute pause (the Linux default would charge every step a
  slow start at 5 ms delay). Recorded in the benchmark's docstring, since it changes the figures.
- Ranks of one machine reach each other over its namespace's loopback (gloo binds ``eth0``'s address,
  and a packet to a local address never leaves the namespace), so ``eth0``'s own counters
  (``/sys/class/net/eth0/statistics/tx_bytes``; TCP/IP headers included) count exactly what crosses
  machines.
- Workers are started directly (``ip netns exec NS python SCRIPT --_worker``) with torchrun's
  environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
  ``MASTER_ADDR`` / ``MASTER_PORT``): no launcher agent per machine, which 16 machines on 2 cores
  cannot spare.

Cleanup reuses :mod:`bench_fsdp`'s registry (``_NAMESPACES``, ``_CHILDREN``, ``_cleanup``,
``_stop``): deleting a namespace deletes its veth end and the bridge with it. Call
:func:`install_signal_handlers` once, and ``bench_fsdp._cleanup()`` in a ``finally``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import bench_fsdp as bf  # the namespace/child registry, _sh, _stop, _rate_bits

IFACE = "eth0"
HERE = os.path.dirname(os.path.abspath(__file__))


def delay_us(delay: str) -> int:
    """netem's form (``0.5ms``, ``5ms``, ``200us``) in microseconds."""
    import re

    m = re.fullmatch(r"([\d.]+)\s*(us|ms|s)", delay.strip().lower())
    if not m:
        raise ValueError(f"delay {delay!r}: use netem's form, e.g. 0.5ms or 200us")
    return int(round(float(m.group(1)) * {"us": 1, "ms": 1e3, "s": 1e6}[m.group(2)]))


def _has_netem() -> bool:
    ns = f"scalechk{os.getpid() % 10000}"
    subprocess.run(["ip", "netns", "add", ns], stderr=subprocess.DEVNULL)
    try:
        r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"],
                           capture_output=True)
        return r.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)


def _delayd() -> str:
    """The delay program, built once per source version into benchmarks/out/ (git-ignored)."""
    import hashlib

    src = os.path.join(HERE, "_delayd.c")
    with open(src, "rb") as f:
        tag = hashlib.sha1(f.read()).hexdigest()[:10]
    exe = os.path.join(HERE, "out", f"_delayd-{tag}")
    if not os.path.exists(exe):
        os.makedirs(os.path.dirname(exe), exist_ok=True)
        bf._sh("gcc", "-O2", "-o", exe + ".tmp", src)
        os.replace(exe + ".tmp", exe)
    return exe


def install_signal_handlers(name: str) -> None:
    """SIGTERM/SIGHUP raise SystemExit and SIGINT KeyboardInterrupt, so the caller's ``finally`` runs
    ``bench_fsdp._cleanup()`` (namespaces, veths, bridge and workers removed)."""
    def handler(signum, frame):  # noqa: ARG001
        raise SystemExit(f"{name}: signal {signum}, cleaning up")

    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def burst_bytes(rate_bits: float) -> int:
    """tbf's bucket: 1 ms at the rate, at least 128 KB (two 64 KB GSO segments: tbf would split a
    larger-than-burst segment, at CPU cost)."""
    return max(128 * 1024, int(rate_bits / 8 * 1e-3))


class Star:
    """``machines`` namespaces on one bridge, each link shaped to ``rate`` (tc's form, e.g. ``1gbit``;
    None: unshaped) and ``delay`` (netem's form, e.g. ``0.5ms``; None: none)."""

    def __init__(self, machines: int, rate: str | None, delay: str | None, prefix: str = "scale",
                 subnet: str = "10.88") -> None:
        self.machines, self.rate, self.delay = machines, rate, delay
        tag = f"{prefix}{os.getpid() % 10000}"
        self.hub = f"{tag}h"
        self.names = [f"{tag}m{k}" for k in range(machines)]
        self.addrs = [f"{subnet}.{k // 250}.{k % 250 + 1}" for k in range(machines)]
        for ns in [self.hub] + self.names:
            bf._NAMESPACES.append(ns)  # registered first: a failure below still removes it
            subprocess.run(["ip", "netns", "del", ns], stderr=subprocess.DEVNULL)
            bf._sh("ip", "netns", "add", ns)
            bf._sh("ip", "-n", ns, "link", "set", "lo", "up")
        self.daemons: list[subprocess.Popen] = []
        bf._sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        bf._sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for k, ns in enumerate(self.names):
            port = f"m{k}"
            bf._sh("ip", "-n", ns, "link", "add", IFACE, "type", "veth", "peer", "name", port, "netns", self.hub)
            bf._sh("ip", "-n", ns, "addr", "add", f"{self.addrs[k]}/16", "dev", IFACE)
            bf._sh("ip", "-n", ns, "link", "set", IFACE, "up")
            bf._sh("ip", "-n", self.hub, "link", "set", port, "master", "br0")
            bf._sh("ip", "-n", self.hub, "link", "set", port, "up")
            bf._sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.tcp_slow_start_after_idle=0")
        subprocess.run(["ip", "netns", "exec", self.hub, "sysctl", "-q", "-w", "net.bridge.bridge-nf-call-iptables=0"],
                       stderr=subprocess.DEVNULL)  # bridged frames skip the hub's netfilter
        netem = bool(delay) and _has_netem()
        self.delay_by = "netem" if netem else "nfqueue" if delay else "none"
        for k, ns in enumerate(self.names):
            self._shape(ns, IFACE, delay if netem else None)
            self._shape(self.hub, f"m{k}", None)
            if delay and not netem:
                self._nfqueue_delay(ns)

    def _shape(self, ns: str, dev: str, delay: str | None) -> None:
        """tbf at the rate (root), netem's delay below it where given."""
        if self.rate:
            burst = burst_bytes(bf._rate_bits(self.rate))
            bf._sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", self.rate,
                   "burst", str(burst), "latency", "200ms")
            if delay:
                bf._sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                       "delay", delay, "limit", "100000")
        elif delay:
            bf._sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", delay, "limit", "100000")

    def _nfqueue_delay(self, ns: str) -> None:
        """The machine's outgoing packets to an NFQUEUE that :file:`_delayd.c` releases DELAY later."""
        if not shutil.which("iptables-legacy"):
            raise RuntimeError("this kernel has no sch_netem, and the delay's fallback needs iptables-legacy "
                               "(apt-get install iptables), whose NFQUEUE target the kernel has")
        p = subprocess.Popen(["ip", "netns", "exec", ns, _delayd(), "0", str(delay_us(self.delay))],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        bf._CHILDREN.append(p)
        self.daemons.append(p)
        time.sleep(0.05)  # bound before the rule sends packets its way (--queue-bypass covers the gap)
        bf._sh("ip", "netns", "exec", ns, "iptables-legacy", "-A", "INPUT", "-i", IFACE, "-j", "NFQUEUE",
               "--queue-num", "0", "--queue-bypass")

    def run(self, script: str, worker_args: list[str], ranks_per_machine: int, out: str, timeout: float,
            log_path: str, port: int = 29500) -> None:
        """Start ``ranks_per_machine`` workers in every machine, wait (at most ``timeout`` s), stop
        whatever is left; raise with the log's tail when ``out`` was not written."""
        R, world = ranks_per_machine, self.machines * ranks_per_machine
        procs = []
        with open(log_path, "w") as log:
            for k, ns in enumerate(self.names):
                for l in range(R):
                    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=IFACE,
                               FASTML_BENCH_IFACE=IFACE, RANK=str(k * R + l), WORLD_SIZE=str(world),
                               LOCAL_RANK=str(l), LOCAL_WORLD_SIZE=str(R), GROUP_RANK=str(k),
                               MASTER_ADDR=self.addrs[0], MASTER_PORT=str(port))
                    cmd = ["ip", "netns", "exec", ns, sys.executable, script, *worker_args, "--_out", out]
                    p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
                    bf._CHILDREN.append(p)
                    procs.append(p)
            bf.wait_then_stop(procs, timeout)
        if not os.path.exists(out) or os.path.getsize(out) == 0:
            with open(log_path) as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"{os.path.basename(script)}: {self.machines} machines x {R} gave no result "
                               f"(exit codes {[p.returncode for p in procs]}); log {log_path}:\n{tail}")


def tx_bytes(iface: str = IFACE) -> int | None:
    """Bytes ``iface`` has sent (its own counter, headers included), in this process's namespace."""
    try:
        with open(f"/sys/class/net/{iface}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return bf._net_bytes(iface)
