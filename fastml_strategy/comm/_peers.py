"""Telling every rank that one rank failed, when ranks talk in groups that do not all meet.

Why
---
In DDP every collective holds every rank, so a rank that fails still takes part with an error header
and a dead rank closes its connections: every rank hears of it in the collective it is in. HSDP (and
any path built from subgroups: shard groups inside a node, replica groups across nodes) is different.
When rank 3 of a 2 x 2 mesh dies inside the cross-replica all-reduce, its replica peer (rank 1) sees the
closed connection and raises; but rank 0 next meets rank 1 in the following unit's reduce-scatter, and
rank 1, having raised, never issues it. gloo's ``abort()``/``shutdown()`` do not close the connections
of a live process (measured on torch 2.13: the peer still waited until the process exited), so rank 0
would wait for the whole process-group timeout, and then raise gloo's error, not FastML's.

How
---
The ranks agree on a key at registration. A rank that fails writes its error text under that key in
the job's c10d store (the TCPStore every launcher already runs). Every wait FastML does on a subgroup
collective waits on a thread of its own and, every ``CHECK_EVERY_S`` while it waits, reads the key:
once it is set the wait raises :class:`PeerFailed`, which names the failing rank and its error, and the
caller raises it as a :class:`~fastml_strategy.CompressionError` (and publishes its own failure, so the
news spreads to ranks that wait on it in turn). A collective that completes within ``CHECK_EVERY_S``
never reads the store; handing the wait to the channel's thread costs tens of microseconds. On CUDA tensors (NCCL) ``wait()`` does not block the host, so the channel waits
as usual there (NCCL's watchdog handles a dead peer).

When the store's host dies
--------------------------
The store is a process too: the torchrun agent under torchrun, but rank 0 itself where the job starts
without torchrun's agent (``mp.spawn`` or srun/mpirun with ``init_method="env://"``). When rank 0 dies
there, the channel dies with it: its peers (rank 1 inside the machine, rank 2 across, of two machines
of two) see their closed connections and raise, but cannot publish, and rank 3, which shares no group
with rank 0, waits on ranks 1 and 2, which have raised (measured: the whole process-group timeout, 30 s
in the probe, 30 minutes by torch's default, then gloo's "Timed out waiting", after a page of c10d's
C++ trace from the first failed read of the store). So the channel holds one more connection to the
store's server, a plain TCP socket that sends nothing (:class:`StoreWatch`): the server never writes
to it, so it turns readable only when the server's process is gone and its kernel closed the
connection. Every ``CHECK_EVERY_S`` of a wait, before reading the key, the channel asks the socket
(a zero-timeout ``select``: no traffic, no call into the store client, so none of its C++ traces);
once it is closed the wait raises :class:`PeerFailed` naming the store's host (rank 0, or the agent)
and its address. Any other error reading the store also ends the wait at once, with that error's
first line: a store that cannot be read while a collective hangs means the job is broken (before,
the channel switched itself off and the rank waited for the timeout).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import select
import socket
import threading
from typing import Any, Optional

import torch.distributed as dist

log = logging.getLogger(__name__)

# Seconds between two reads of the failure key while a collective is outstanding (one store round
# trip each): a peer's failure is noticed this long after it is published, at most.
CHECK_EVERY_S = 0.1
_PREFIX = "fastml/failed/"


class PeerFailed(RuntimeError):
    """Another rank published a failure while this rank waited for a collective."""


def default_store() -> Optional[Any]:
    """The default process group's c10d store (``torch.distributed.distributed_c10d._get_default_store``,
    private: tests/test_upstream_internals.py fails if torch renames it), or None (logged) if it cannot
    be read; the channel then stays off and waits behave as before."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception as e:  # noqa: BLE001
        log.warning("FastML: cannot read the default process group's store (%s: %s) in torch's "
                    "distributed_c10d; a rank's failure reaches ranks of other groups only by the "
                    "process-group timeout", type(e).__name__, e)
        return None


def store_address(store: Any) -> Optional[tuple[str, int]]:
    """(host, port) of the TCPStore server behind ``store`` (through its PrefixStores), or None (a
    FileStore, a HashStore, a store of another kind)."""
    for _ in range(16):  # PrefixStores nest (one per process group); never a cycle, but bounded
        if isinstance(store, dist.PrefixStore):
            store = store.underlying_store
            continue
        break
    if isinstance(store, dist.TCPStore):
        return str(store.host), int(store.port)
    return None


def store_host() -> str:
    """Which process hosts the job's store: torchrun's agent (it sets ``TORCHELASTIC_USE_AGENT_STORE``
    for its workers), else rank 0 (``init_method="env://"`` or ``tcp://`` without torchrun's agent:
    ``mp.spawn``, srun, mpirun)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() in ("1", "true"):
        return "the torchrun agent"
    return "rank 0"


class StoreWatch:
    """A TCP connection to the job's store server that sends nothing and so is never answered: it
    becomes readable only when the server closes it, that is when the server's process died (see the
    module docstring). :meth:`closed` costs one zero-timeout ``select``."""

    def __init__(self, host: str, port: int, connect_timeout: float = 5.0) -> None:
        self.host, self.port = host, port
        self.sock = socket.create_connection((host, port), timeout=connect_timeout)
        self.sock.setblocking(False)

    def closed(self) -> bool:
        """Whether the server closed the connection (its process is gone)."""
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
            if not readable:
                return False
            if self.sock.recv(1, socket.MSG_PEEK) == b"":
                return True
            self.sock.recv(4096)  # unexpected bytes from a live server: drop them, still alive
            return False
        except BlockingIOError:
            return False
        except OSError:  # ECONNRESET and the like: the peer's kernel reset the connection
            return True

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def describe(self) -> str:
        return (f"{store_host()}, which hosts the job's c10d store at {self.host}:{self.port}, most likely "
                f"died: the store closed its connection")


def _watch(store: Any) -> Optional[StoreWatch]:
    """A :class:`StoreWatch` on ``store``'s server, or None (logged) when there is none to watch."""
    address = store_address(store) if store is not None else None
    if address is None:
        return None
    try:
        return StoreWatch(*address)
    except OSError as e:
        log.warning("FastML: cannot open a connection to the job's store at %s:%d (%s); if its host dies, "
                    "ranks learn of it from the store's errors", address[0], address[1], e)
        return None


class FailureChannel:
    """One key in the job's store that any rank sets when it fails, read while waiting.

    Build it on every rank of ``group`` at the same point (a collective: rank 0 draws the key and
    broadcasts it, so a restarted job never reads an old attempt's failure)."""

    def __init__(self, group: Any = None, rank: int = 0) -> None:
        self.rank = rank
        self.store = default_store()
        token = [secrets.token_hex(8) if dist.get_rank(group) == 0 else None]
        dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
        self.key = _PREFIX + token[0]
        self.watch = _watch(self.store)  # notices the store's own death (its host: rank 0, or the agent)
        self._published = False
        self._queue: Optional[queue.Queue] = None

    def publish(self, text: str) -> None:
        """Tell every rank that this rank failed (once; a store error is logged, not raised)."""
        if self._published or self.store is None:
            return
        self._published = True
        if self.watch is not None and self.watch.closed():  # nobody to tell (and no C++ trace)
            return
        try:
            self.store.set(self.key, f"rank {self.rank}: {text}"[:2000])
        except Exception as e:  # noqa: BLE001 - the store's host may be the rank that died
            log.debug("FastML: could not publish a failure in the store: %s", e)

    def failure(self) -> Optional[str]:
        """Why this rank should stop waiting: the text a failed rank published, or that the store
        itself failed (its host died: :class:`StoreWatch`; or a read of it raised); None while
        neither."""
        if self.store is None:
            return None
        if self.watch is not None and self.watch.closed():
            return self.watch.describe()
        try:
            if not self.store.check([self.key]):
                return None
            return self.store.get(self.key).decode("utf-8", "replace")
        except Exception as e:  # noqa: BLE001 - the store's host may have died
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return (f"reading the job's c10d store failed ({type(e).__name__}: {first}): its host "
                    f"({store_host()}) most likely died")

    def wait(self, work: Any) -> None:
        """``work.wait()``, but raise :class:`PeerFailed` as soon as another rank has published a
        failure while this one waits. The wait itself runs on a daemon thread of the channel (gloo's
        ``is_completed`` stays False for some collectives until ``wait`` is called, and ``wait``
        ignores its timeout), while this thread reads the key every ``CHECK_EVERY_S``."""
        if work is None:
            return
        if self.store is None:
            work.wait()
            return
        done = threading.Event()
        error: list = []

        def run() -> None:
            try:
                work.wait()
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                error.append(e)
            finally:
                done.set()

        self._waiter().put(run)
        while not done.wait(CHECK_EVERY_S):
            text = self.failure()
            if text is not None:
                raise PeerFailed(f"another rank failed while this one waited ({text})")
        if error:
            raise error[0]

    def _waiter(self) -> "queue.Queue":
        """The queue of the channel's waiting thread (a daemon: a wait abandoned after a failure must
        not keep the process from exiting)."""
        if self._queue is None:
            self._queue = queue.Queue()

            def loop(q: "queue.Queue") -> None:
                while True:
                    q.get()()

            threading.Thread(target=loop, args=(self._queue,), daemon=True, name="fastml-wait").start()
        return self._queue
