"""Host reads on the hot path: every read of a tensor's value on the host goes
through ``fastml_strategy.comm._status.host`` (counted by ``collective.host_reads()``), and the DDP hook reads one small
tensor per step (every header's status and every finiteness check), at the step's last bucket. Error
headers, finiteness and this rank's errors are kept on the device until then. On a GPU each such read
is a host synchronisation; tests/integrations/test_gpu.py runs steps under
``torch.cuda.set_sync_debug_mode("error")``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers

pytestmark = pytest.mark.timeout(180)


def _plan(name):
    import fastml_strategy as fm
    from fastml_strategy.config import RECIPES

    if name != "mixed":
        return name
    # int4 / top-k / fp16 / uncompressed layers in one model, several layers per bucket
    return fm.Plan(default=RECIPES["int4"], layers={"0.weight": RECIPES["topk1"], "2.weight": RECIPES["fp16"],
                                                    "4.weight": RECIPES["int2"], "re:.*bias": RECIPES["none"]},
                   min_numel=64, name="mixed")


def _count(rank, world_size, plan, layer_stats_every, steps=6):
    import fastml_strategy as fm
    from fastml_strategy.comm import collective

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 10))
    ddp = DDP(model, bucket_cap_mb=0.3)  # several buckets, several layers per bucket
    state = fm.register_hook(ddp, plan=_plan(plan), layer_stats_every=layer_stats_every)
    state._engine.piece_numel = 8192  # pipelined: several pieces per bucket
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1000 + rank)
    reads = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        before = collective.host_reads()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        reads.append(collective.host_reads() - before)
        opt.step()
        opt.zero_grad()
    before = collective.host_reads()
    stats = state.stats()
    stats_reads = collective.host_reads() - before
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    buckets = len(state._engine.layouts)
    pieces = max(len(lay.pieces) for lay in state._engine.layouts.values())
    state.close()
    return {"reads": reads, "stats_reads": stats_reads, "buckets": buckets, "pieces": pieces,
            "identical": all(torch.equal(gathered[0], g) for g in gathered[1:]),
            "rel_error": [v["rel_error"] for v in stats["layers"].values()]}


@pytest.mark.parametrize("plan", ["int4", "topk1", "mixed"])
def test_one_host_read_per_step(plan):
    for out in run_workers(_count, 2, plan, 0, timeout=150):
        assert out["buckets"] >= 2 and out["pieces"] >= (1 if plan == "topk1" else 2), out
        assert out["reads"] == [1] * len(out["reads"]), out["reads"]  # before: 2 per bucket and piece, + 1
        assert out["identical"]


def test_layer_stats_are_read_when_asked_for():
    # per-layer errors stay on the device: still one read per step; stats() reads them all at once
    for out in run_workers(_count, 2, "mixed", 1, timeout=150):
        assert out["reads"] == [1] * len(out["reads"]), out["reads"]
        assert out["stats_reads"] == 1
        assert all(isinstance(v, float) and v == v for v in out["rel_error"]), out["rel_error"]
