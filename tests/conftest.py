"""Test-wide setup.

TRITON_INTERPRET=1 must be set before any Triton kernel module is imported: with it, the Triton
kernels run on CPU tensors through Triton's interpreter, so CI (no GPU) compares them bit-exactly with
the torch reference.

The suite runs on two pytest-xdist workers, a test file at a time per worker (``-n 2 --dist
loadfile`` in pyproject.toml: a file's module fixtures, such as one shared training launch, run
once). Files that start training processes (a ``slow`` test) go first, the longest timeouts first,
so the last minutes are not one worker finishing a launch while the other idles. ``-n 0`` runs
everything in one process (for ``--pdb``).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


def _file_weight(items) -> tuple:
    slow = [it for it in items if it.get_closest_marker("slow")]
    longest = max((m.args[0] for it in slow for m in [it.get_closest_marker("timeout")] if m and m.args),
                  default=0)
    return (not slow, -longest)


def pytest_collection_modifyitems(session, config, items):
    by_file: dict = {}
    for it in items:
        by_file.setdefault(it.path, []).append(it)
    order = sorted(by_file, key=lambda p: _file_weight(by_file[p]))  # stable: collection order otherwise
    items[:] = [it for p in order for it in by_file[p]]
