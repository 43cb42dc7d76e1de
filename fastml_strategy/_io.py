"""Atomic file writes: write a temporary file beside the target, fsync, then rename over it.

A process killed mid-write leaves the previous file intact (rename is atomic on POSIX and Windows).
Plans, reports and checkpoints all go through here.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

__all__ = ["atomic_write_text", "atomic_open"]


def _new_file_mode(target: Path) -> int:
    """The permissions ``open(target, "w")`` would give: the existing file's, else 0o666 less the umask
    (mkstemp's own 0o600 would hide plans and checkpoints from the other users of a shared disk)."""
    try:
        return target.stat().st_mode & 0o7777
    except OSError:
        pass
    try:  # read the umask without changing it (os.umask would, for every thread, for a moment)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return 0o666 & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _fsync_dir(directory: Path) -> None:
    # Makes the rename itself durable (a power cut right after it would otherwise be able to undo it).
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not supported (Windows)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w") -> Iterator[IO]:
    """Open a temporary file beside ``path``; on a clean exit it replaces ``path`` atomically.

    A process killed inside the block leaves ``path`` as it was (and a ``.NAME.*.tmp`` file beside it);
    an exception inside the block also removes the temporary file.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, mode) as f:
            if hasattr(os, "fchmod"):
                os.fchmod(f.fileno(), _new_file_mode(target))
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w") as f:
        f.write(text)
