"""Run a function on W real gloo processes (spawned), with a hard timeout so a hang fails fast."""

from __future__ import annotations

import os
import socket
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


def run_workers(fn, world_size: int, *args, timeout: float = 120, pg_timeout: float = 60,
                allow_errors: bool = False, allow_deaths: bool = False):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank.

    Raises if a worker raised (unless ``allow_errors``: then every rank's result comes back as
    ``(status, value)``, status ``"ok"`` or ``"error"``, errors as strings), and fails if the
    processes are not all done within ``timeout`` seconds (they are killed). A rank that exits without
    a result (``os._exit``, a signal) fails the run unless ``allow_deaths`` (implies ``allow_errors``):
    it then comes back as ``("died", exitcode)``.
    """
    allow_errors = allow_errors or allow_deaths
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
