"""Atomic writes: a process killed in the middle of writing a plan or a checkpoint leaves the previous
file intact and loadable; an exception inside the write leaves no temporary file behind."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fastml_strategy import Plan
from fastml_strategy._io import atomic_open, atomic_write_text

ROOT = Path(__file__).resolve().parents[2]

# The child opens the target through atomic_open, writes part of a new version, says so on stdout,
# then keeps writing slowly until the parent SIGKILLs it.
WRITER = textwrap.dedent("""
    import sys, time
    import torch
    from fastml_strategy._io import atomic_open

    path, kind = sys.argv[1], sys.argv[2]

    class Slow:  # a file that announces its first write, then takes its time
        def __init__(self, f):
            self.f, self.n = f, 0
        def write(self, b):
            self.f.write(b)
            self.f.flush()
            self.n += 1
            if self.n == 1:
                print("writing", flush=True)
            time.sleep(0.05)
            return len(b)
        def flush(self):
            self.f.flush()

    if kind == "plan":
        with atomic_open(path, "w") as f:
            w = Slow(f)
            w.write('{"format_version": 1, "name": "half-written", "layers": {')
            for i in range(100000):
                w.write('"layer%d": {"codec": "int4"}, ' % i)
    else:
        with atomic_open(path, "wb") as f:
            torch.save({"step": 999, "model": torch.randn(4_000_000)}, Slow(f))
""")


def _kill_mid_write(path: Path, kind: str) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), kind], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "writing", proc.stderr.read()
        # The new version is partly on disk, beside the target, when the writer dies.
        tmps = list(path.parent.glob(f".{path.name}.*.tmp"))
        assert tmps and tmps[0].stat().st_size > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL


def test_plan_survives_a_writer_killed_mid_write(tmp_path):
    path = tmp_path / "plan.json"
    before = Plan.from_recipe("int4").with_layers({"0.weight": Plan.from_recipe("int8").default})
    before.save(path)
    _kill_mid_write(path, "plan")
    assert Plan.load(path) == before


def test_checkpoint_survives_a_writer_killed_mid_write(tmp_path):
    path = tmp_path / "checkpoint.pt"
    with atomic_open(path, "wb") as f:
        torch.save({"step": 4, "model": torch.arange(10.0)}, f)
    _kill_mid_write(path, "checkpoint")
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["step"] == 4 and torch.equal(ckpt["model"], torch.arange(10.0))


def test_exception_inside_the_write_keeps_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "report.json"
    atomic_write_text(path, "old")
    with pytest.raises(RuntimeError, match="disk full"):
        with atomic_open(path, "w") as f:
            f.write("new, half")
            raise RuntimeError("disk full")
    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_atomic_files_get_ordinary_permissions(tmp_path):
    # mkstemp creates 0600 files; a plan or checkpoint must be readable like any file the user writes.
    path = tmp_path / "plan.json"
    Plan.from_recipe("int4").save(path)
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~mask
    os.chmod(path, 0o640)  # and an existing file keeps its own
    Plan.from_recipe("int8").save(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_atomic_open_rejects_other_modes(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(tmp_path / "x", "a"):
            pass
