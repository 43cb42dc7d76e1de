"""Start real training processes for the integration tests: free ports, hard timeouts, no orphans.

Every launch runs in its own session; on a timeout the whole process group (the launcher and the ranks
it started) is killed, and the test fails with the tail of the output, so a hang costs one timeout and
never blocks the suite.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
JOBS = Path(__file__).resolve().parent / "jobs"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(ROOT) + (os.pathsep + e["PYTHONPATH"] if e.get("PYTHONPATH") else "")
    e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1",
             PYTHONUNBUFFERED="1", TQDM_DISABLE="1", GLOO_SOCKET_IFNAME=e.get("GLOO_SOCKET_IFNAME", "lo"))
    for k in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "FASTML_PLAN", "FASTML_CHECK_REPLICAS_EVERY"):
        e.pop(k, None)
    e.update(extra)
    return e


def torchrun(nproc: int = 2, *extra: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "--master_addr", "127.0.0.1", "--master_port", str(free_port()), *extra]


class Result:
    def __init__(self, cmd: list[str], returncode: int, output: str, seconds: float) -> None:
        self.cmd, self.returncode, self.output, self.seconds = cmd, returncode, output, seconds

    def tail(self, n: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-n:])

    def check(self) -> "Result":
        assert self.returncode == 0, f"{' '.join(self.cmd)} exited {self.returncode}:\n{self.tail()}"
        return self


def run(cmd: list[str], timeout: float, cwd: str | Path | None = None, **env_extra: str) -> Result:
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=env(**env_extra), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd))} still running after {timeout}s (hang?); "
                             f"output:\n{out[-6000:]}") from None
    finally:
        try:  # ranks started by the launcher must not outlive it
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Result([str(c) for c in cmd], proc.returncode, out, time.monotonic() - start)


def rank_files(prefix: str | Path, world: int = 2) -> list[dict]:
    """The per-rank JSON files a job or a recipe's ``--summary`` wrote, by rank."""
    out = []
    for r in range(world):
        p = Path(f"{prefix}.rank{r}.json")
        assert p.exists(), f"rank {r} wrote no {p.name}"
        out.append(json.loads(p.read_text()))
    return out


def run_ranks(cmd: list[str], world: int, timeout: float, **env_extra: str) -> list[Result]:
    """Start ``world`` copies of ``cmd`` as ranks, the way torchrun would (RANK, LOCAL_RANK,
    WORLD_SIZE, MASTER_*), but with no agent that kills the others when one fails: so a test can see
    what EVERY rank does on its own, and that none of them hangs."""
    port = str(free_port())
    procs, start = [], time.monotonic()
    for r in range(world):
        e = dict(env_extra, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                 GROUP_RANK="0", MASTER_PORT=port)
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env(**e), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    results = []
    for p in procs:
        left = max(1.0, timeout - (time.monotonic() - start))
        try:
            out, _ = p.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            out, _ = p.communicate()
            raise AssertionError(f"rank {len(results)} still running after {timeout}s (hang); output:\n"
                                 f"{out[-4000:]}") from None
        results.append(Result([str(c) for c in cmd], p.returncode, out, time.monotonic() - start))
    return results
