"""Run a function on W real gloo processes (spawned), with a hard timeout so a hang fails fast.

Starting W Python processes that import torch costs seconds on a 2-core machine, so calls that need
nothing special run in a pool of W processes kept alive across tests, with one gloo group that stays
initialised (the pool of each world size starts on first use). Before each call a pool worker resets
torch's RNG to a fresh process's seed; a call that fails on any rank, or runs past its timeout,
retires the pool (the next call starts a new one). Calls that let ranks die or fail on purpose
(``allow_errors``, ``allow_deaths``), that set their own process-group timeout, or that ask for it
(``fresh=True``: a test that patches modules in the workers) get processes of their own.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue as _queue
import socket
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, q, pg_timeout):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        result = fn(rank, world_size, *args)
        q.put((rank, "ok", result))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


_DEFAULT_PG_TIMEOUT = 60.0


def _pool_worker(rank, world_size, port, inbox, outbox, pg_timeout):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    seed = torch.initial_seed()
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout))
    try:
        while True:
            msg = inbox.get()
            if msg is None:
                return
            job, path, env, payload = msg
            if env != dict(os.environ):  # the caller's environment, as a freshly spawned process would see it
                master = {k: os.environ[k] for k in ("MASTER_ADDR", "MASTER_PORT")}
                os.environ.clear()
                os.environ.update(env, **master)
            for entry in path:  # test folders pytest added after this process started
                if entry not in sys.path:
                    sys.path.append(entry)
            try:
                torch.manual_seed(seed)
                fn, args = pickle.loads(payload)
                outbox.put((job, rank, "ok", fn(rank, world_size, *args)))
            except BaseException as e:  # noqa: BLE001
                outbox.put((job, rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.inboxes = [ctx.Queue() for _ in range(world_size)]
        self.outbox = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_pool_worker, daemon=True,
                                  args=(r, world_size, port, self.inboxes[r], self.outbox, _DEFAULT_PG_TIMEOUT))
                      for r in range(world_size)]
        for p in self.procs:
            p.start()
        self.job = 0

    def run(self, fn, args, timeout: float) -> list:
        self.job += 1
        payload = pickle.dumps((fn, args))
        env = dict(os.environ)
        for box in self.inboxes:
            box.put((self.job, list(sys.path), env, payload))
        results: dict = {}
        deadline = time.monotonic() + timeout
        while len(results) < self.world_size:
            left = deadline - time.monotonic()
            if left <= 0 or any(not p.is_alive() for p in self.procs):
                break
            try:
                job, rank, status, value = self.outbox.get(timeout=min(left, 1.0))
            except _queue.Empty:
                continue
            if job == self.job:
                results[rank] = (status, value)
        return results

    def close(self) -> None:
        for box in self.inboxes:
            try:
                box.put(None)
            except Exception:  # noqa: BLE001
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()


_POOLS: dict = {}


@atexit.register
def _close_pools() -> None:
    for pool in list(_POOLS.values()):
        pool.close()
    _POOLS.clear()


def _run_in_pool(fn, world_size: int, args: tuple, timeout: float) -> list:
    pool = _POOLS.get(world_size)
    if pool is None or any(not p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = _Pool(world_size)
    results = pool.run(fn, args, timeout)
    ok = len(results) == world_size and all(s == "ok" for s, _ in results.values())
    if not ok:  # a failed or hung call may leave the group mid-collective: retire the pool
        _POOLS.pop(world_size, None)
        for p in pool.procs:
            p.kill()
    if len(results) < world_size:
        missing = [r for r in range(world_size) if r not in results]
        raise AssertionError(f"ranks {missing} gave no result within {timeout}s (hang or death); results: "
                             f"{results}")
    errs = {r: v for r, (s, v) in results.items() if s != "ok"}
    if errs:
        raise AssertionError("worker(s) failed:\n" + "\n".join(f"rank {r}: {v}" for r, v in errs.items()))
    return [results[r][1] for r in range(world_size)]


def run_workers(fn, world_size: int, *args, timeout: float = 120, pg_timeout: float = _DEFAULT_PG_TIMEOUT,
                allow_errors: bool = False, allow_deaths: bool = False, fresh: bool = False):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    Raises if a worker raised (unless ``allow_errors``: then every rank's result comes back as
    ``(status, value)``, status ``"ok"`` or ``"error"``, errors as strings), and fails if the
    processes are not all done within ``timeout`` seconds (they are killed). A rank that exits without
    a result (``os._exit``, a signal) fails the run unless ``allow_deaths`` (implies ``allow_errors``):
    it then comes back as ``("died", exitcode)``.
    """
    allow_errors = allow_errors or allow_deaths
    if not (allow_errors or fresh or pg_timeout != _DEFAULT_PG_TIMEOUT):
        return _run_in_pool(fn, world_size, args, timeout)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, q, pg_timeout))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple[str, object]] = {}
    import queue as _queue
    import time

    deadline = time.monotonic() + timeout
    while len(results) < world_size:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, status, value = q.get(timeout=min(left, 1.0))
            results[rank] = (status, value)
        except _queue.Empty:
            if all(not p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    if hung:
        raise AssertionError(f"ranks {hung} still running after {timeout}s (hang); results: {results}")
    missing = [r for r in range(world_size) if r not in results]
    if missing and allow_deaths:
        for r in missing:
            results[r] = ("died", procs[r].exitcode)
        missing = []
    if missing:
        codes = [p.exitcode for p in procs]
        raise AssertionError(f"ranks {missing} died without a result (exit codes {codes})")
    if not allow_errors:
        errs = {r: v for r, (s, v) in results.items() if s != "ok"}
        if errs:
            raise AssertionError("worker(s) failed:\n" + "\n".join(f"rank {r}: {v}" for r, v in errs.items()))
        return [results[r][1] for r in range(world_size)]
    return [results[r] for r in range(world_size)]
