"""The failure channel when the job's c10d store itself dies (fastml_strategy.comm._peers): its host is rank
0 where no torchrun agent hosts it (mp.spawn, srun or mpirun with init_method="env://").
tests/faults/test_faults_ranks.py kills rank 0 of a real hierarchical run; these check the two
pieces alone: the silent connection that sees the server's process go, and a wait that ends at once
when the store cannot be read (before, the channel switched itself off and the rank waited for the
process-group timeout)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from _fault_helpers import _TESTS  # noqa: F401 - puts tests/ on sys.path
from _dist import free_port

pytestmark = pytest.mark.timeout(120)

_SERVER = """
import sys, time
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, timeout=timedelta(seconds=30),
                      wait_for_workers=False)
print("up", flush=True)
time.sleep(120)
"""


def test_store_watch_sees_its_server_die_and_only_then(tmp_path):
    from datetime import timedelta

    import torch.distributed as dist

    from fastml_strategy.comm._peers import StoreWatch, store_address

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", _SERVER, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "up"
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=30))
        assert store_address(dist.PrefixStore("a/", dist.PrefixStore("b/", client))) == ("127.0.0.1", port)
        watch = StoreWatch("127.0.0.1", port)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # a live server, in use, never closes the silent connection
            client.set("k", "v")
            assert not watch.closed()
            time.sleep(0.05)
        server.kill()
        server.wait()
        deadline = time.monotonic() + 5.0
        while not watch.closed():
            assert time.monotonic() < deadline, "the watch did not see the server's process go"
            time.sleep(0.01)
        assert "rank 0, which hosts the job's c10d store at 127.0.0.1:" in watch.describe()
    finally:
        server.kill()
        server.wait()


class _DeadStore:
    """A store whose every read fails, as a TCPStore client's does once its server is gone."""

    def check(self, keys):
        raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.\nframe #0: ...")

    def set(self, key, value):
        raise RuntimeError("Broken pipe")


class _Hung:
    """A collective that completes only after ``seconds`` (a peer that has raised never sends)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self) -> None:
        threading.Event().wait(self.seconds)


def test_a_store_that_cannot_be_read_ends_the_wait_at_once(monkeypatch):
    import fastml_strategy.comm._peers as peers

    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    channel = peers.FailureChannel.__new__(peers.FailureChannel)  # no process group: the store alone
    channel.rank, channel.store, channel.watch, channel.key = 3, _DeadStore(), None, "fastml/failed/x"
    channel._published, channel._queue = False, None
    channel.publish("RuntimeError: boom")  # the store's error is logged, not raised
    t0 = time.monotonic()
    with pytest.raises(peers.PeerFailed) as info:
        channel.wait(_Hung(20.0))
    assert time.monotonic() - t0 < 5.0  # not when the collective gives up
    msg = str(info.value)
    assert "reading the job's c10d store failed (RuntimeError: Failed to recv" in msg, msg
    assert "its host (rank 0) most likely died" in msg and "frame #" not in msg, msg
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    assert peers.store_host() == "the torchrun agent"
