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
"""

from __future__ import annotations

import logging
import queue
import secrets
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
        self._published = False
        self._queue: Optional[queue.Queue] = None

    def publish(self, text: str) -> None:
        """Tell every rank that this rank failed (once; a store error is logged, not raised)."""
        if self._published or self.store is None:
            return
        self._published = True
        try:
            self.store.set(self.key, f"rank {self.rank}: {text}"[:2000])
        except Exception as e:  # noqa: BLE001 - the store's host may be the rank that died
            log.debug("FastML: could not publish a failure in the store: %s", e)

    def failure(self) -> Optional[str]:
        """The text a failed rank published, or None."""
        if self.store is None:
            return None
        try:
            if not self.store.check([self.key]):
                return None
            return self.store.get(self.key).decode("utf-8", "replace")
        except Exception as e:  # noqa: BLE001 - a dead store host: the collective fails by itself
            log.debug("FastML: could not read the failure key: %s", e)
            self.store = None
            return None

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
