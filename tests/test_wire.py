"""fastml_strategy.wire: every collective's layout, tensor-free, and the one the runtime and the cost
model are both built from."""

import ast
import subprocess
import sys
from pathlib import Path

import torch

from fastml_strategy import codecs, wire
from fastml_strategy.comm._layouts import BucketLayout, ShardedTensor, ShardLayout
from fastml_strategy.config import RECIPES, Plan

PKG = Path(__file__).resolve().parents[1] / "fastml_strategy"


def test_wire_imports_without_torch():
    """The wire package, loaded without the package root (whose engines import torch) and with torch
    made unimportable, imports and computes layouts; only the codec registry passed in would need
    torch."""
    code = f"""
import sys, types
sys.modules["torch"] = None  # any import of torch now raises
pkg = types.ModuleType("fastml_strategy")
pkg.__path__ = [{str(PKG)!r}]
sys.modules["fastml_strategy"] = pkg
import fastml_strategy.wire as w
assert w.shard_chunks((5, 3), 2) == ((9, 6), 9)
assert w.split_fragments([1, 2, 3, 4], 2) == [[0, 1, 2], [3]]
assert w.chunk_bounds(100, 16, 3) == [0, 32, 64, 100]
assert w.schedule.halving_rounds([80, 80, 80, 80]) == [160, 80, 80, 160]
loaded = sorted(m for m in sys.modules if m.startswith("fastml_strategy"))
assert all(m.startswith("fastml_strategy.wire") or m == "fastml_strategy" for m in loaded), loaded
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(module, at module level) of every fastml_strategy import in ``path``."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("fastml_strategy"):
            mods = [n.module] + [f"{n.module}.{a.name}" for a in n.names]
            out += [(m, id(n) in top) for m in mods]
        elif isinstance(n, ast.Import):
            out += [(a.name, id(n) in top) for a in n.names if a.name.startswith("fastml_strategy")]
        elif isinstance(n, ast.ImportFrom) and n.module is None:
            continue
    return out


def test_wire_imports_neither_the_codecs_nor_the_runtime():
    """Codec sizes are passed in (``codecs``); config only inside the two functions that build a
    setting, never at module level (it imports the codecs, and so torch)."""
    for path in (PKG / "wire").glob("*.py"):
        for mod, top in _imports(path):
            assert mod.startswith("fastml_strategy.wire") or (mod.startswith("fastml_strategy.config") and not top), \
                (path.name, mod)


def test_cost_model_imports_no_private_runtime_module():
    runtime = ("fastml_strategy.comm", "fastml_strategy.integrations", "fastml_strategy.fsdp",
               "fastml_strategy.localsgd", "fastml_strategy.hook",
               # the old paths of comm's public modules
               "fastml_strategy.topology", "fastml_strategy.hierarchical", "fastml_strategy.collective")
    for path in (PKG / "autotune" / "costmodel").glob("*.py"):
        for mod, _ in _imports(path):
            assert not mod.startswith("fastml_strategy._"), (path.name, mod)
            assert not mod.startswith(runtime), (path.name, mod)


def test_bucket_layout_is_the_wire_layout():
    """BucketLayout's groups, pipeline pieces and message offsets are bucket_wire's (pieces cut in a
    long layer, a top-k layer in the last piece's all_gather, a batched uncompressed group)."""
    names = ("a", "b", "c", "d")
    numels = (5000, 70000, 300, 4096)
    plan = Plan(default=RECIPES["int4"], layers=(("c", RECIPES["none"]), ("d", RECIPES["topk1"])), min_numel=0)
    lay = BucketLayout(names, [0, 5000, 75000, 75300], numels, plan, 3, 1, torch.device("cpu"), piece_numel=16384)
    w = wire.bucket_wire(codecs, numels, tuple(plan.for_parameter(n, k) for n, k in zip(names, numels)), 3,
                         torch.float32, 16384)
    assert len(lay.pieces) == len(w.pieces) > 2
    for piece, pw in zip(lay.pieces, w.pieces):
        assert piece.split_sizes == list(pw.split_sizes) and piece.gather_size == pw.gather_size
        for g, s, off in zip(piece.dense, pw.segments, pw.offsets):
            assert g.bounds == list(w.segments[s].bounds) and g.nbytes == list(w.segments[s].nbytes)
            assert g.gather_off == list(off)
            assert g.send_off == [sum(pw.split_sizes[:j]) + off[j] for j in range(3)]
    assert [t.gather_off for t in lay.pieces[-1].topk] == list(w.pieces[-1].topk_offsets)
    sent = sum(p.all_to_all_bytes(1) + p.all_gather_bytes() for p in w.pieces)
    assert w.bytes_sent(1) == sent


def test_shard_layout_is_the_wire_layout():
    tensors = [ShardedTensor("w", (60, 40), 60), ShardedTensor("b", (3, 2), 3), ShardedTensor("v", (64, 64), 64)]
    plan = Plan(default=RECIPES["int4"], min_numel=100)
    for rank in range(2):
        lay = ShardLayout(tensors, plan, 2, rank, torch.device("cpu"))
        w = wire.shard_wire(codecs, [t.chunk_numels for t in tensors], [t.padded for t in tensors],
                            [plan.for_parameter(t.name, t.numel) for t in tensors], 2, torch.float32)
        assert lay.split_sizes == list(w.split_sizes)
        assert [g.recv_off for g in lay.dense] == [off[rank] for off in w.offsets_in]
        assert lay.padding == w.padding(rank) == ([] if rank == 0 else [(40, 20), (62, 1)])
        assert sum(lay.split_sizes) - lay.split_sizes[rank] == w.bytes_sent(rank)
    assert [g.batched for g in w.groups] == [False, False, True]
