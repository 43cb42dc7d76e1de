"""Pipelined buckets (collective.BucketLayout.pieces): a bucket cut into pieces gives the same values
as one piece, keeps replicas bit-identical, and fails every rank alike when one rank's codec raises."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers

pytestmark = pytest.mark.timeout(240)


def _bucket_results(rank, world_size, recipe, dtype):
    # One bucket of odd-sized layers (a slice boundary inside a layer, a tail block, small tensors
    # batched): the all-reduced values with pieces of 8192 elements against one piece, 3 steps of
    # error feedback.
    from fastml_strategy import Plan
    from fastml_strategy.comm.collective import CompressedAllReduce

    numels = [50000, 37, 123457, 90000, 3, 41000]
    names = [f"l{i}" for i in range(len(numels))]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    plan = Plan.from_recipe(recipe)
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(sum(numels), generator=gen).to(dtype) for _ in range(3)]
    out = {}
    for piece_numel in (1 << 30, 8192):
        eng = CompressedAllReduce(plan, dist.group.WORLD, rank, world_size, piece_numel=piece_numel)
        lay = eng.layout_for(names, offsets, numels, torch.device("cpu"), dtype)
        results = []
        for step, g in enumerate(grads):
            buf = g.clone()
            assert eng.run(lay, buf, step)
            results.append(buf)
        out[piece_numel] = (len(lay.pieces), results, eng.bytes_sent)
    one, many = out[1 << 30], out[8192]
    flat = torch.cat([t.float() for t in many[1]])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    return {
        "pieces": (one[0], many[0]),
        "same_values": all(torch.equal(a, b) for a, b in zip(one[1], many[1])),
        "replicas": all(torch.equal(gathered[0], t) for t in gathered[1:]),
        "bytes": (one[2], many[2]),
    }


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("recipe,dtype", [("int4", torch.float32), ("int2", torch.float32),
                                          ("int4", torch.bfloat16), ("fp16", torch.float32)])
def test_pieces_give_the_values_of_one_piece(world_size, recipe, dtype):
    for res in run_workers(_bucket_results, world_size, recipe, dtype):
        assert res["pieces"][0] == 1 and res["pieces"][1] >= 8, res["pieces"]
        assert res["same_values"], "a deterministic codec must give the same values in pieces"
        assert res["replicas"]
        # more headers, and each piece's all_gather is padded to its largest chunk (small pieces here)
        one, many = res["bytes"]
        assert one < many <= 1.2 * one, (one, many)


def _train(rank, world_size, plan, piece_numel, steps=12):
    import fastml_strategy as fm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = DDP(model, bucket_cap_mb=0.3)
    state = fm.register_hook(ddp, plan=plan, check_replicas_every=4)
    state._engine.piece_numel = piece_numel
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        x = torch.randn(16, 64, generator=gen)
        y = torch.randint(0, 10, (16,), generator=gen)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(gathered, flat)
    pieces = max(len(lay.pieces) for lay in state._engine.layouts.values())
    return all(torch.equal(gathered[0], t) for t in gathered[1:]), pieces, flat


@pytest.mark.parametrize("plan", ["int4", "topk1", "int4-sr"])
def test_ddp_training_in_pieces(plan):
    piped = run_workers(_train, 3, plan, 4096)
    for identical, pieces, _ in piped:
        assert identical, f"{plan}: replicas diverged with pipelined buckets"
        assert pieces >= (1 if plan == "topk1" else 4)  # top-k: its all_gather, in the last piece
    if plan == "int4":  # deterministic: the same training as without pieces, bit for bit
        whole = run_workers(_train, 3, plan, 1 << 30)
        assert whole[0][1] == 1
        assert torch.equal(whole[0][2], piped[0][2])


def _fails_mid_bucket(rank, world_size, stage):
    import fastml_strategy as fm
    import fastml_strategy.codecs as codecs
    from fastml_strategy import CompressionError

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64))
    ddp = DDP(model)
    state = fm.register_hook(ddp, plan="int4")
    state._engine.piece_numel = 4096
    # the encoding stage encodes with encode_chunk; the reduction stage decodes, sums and re-encodes
    # with reduce_chunk (its message is the 4th argument)
    name, out_arg = ("encode_chunk", 2) if stage == "encoding" else ("reduce_chunk", 3)
    real = getattr(codecs, name)
    calls = {"n": 0}

    def boom(*a, **k):
        out = a[out_arg]
        lays = list(state._engine.layouts.values())
        msgs = [lay.send if stage == "encoding" else lay.gsend for lay in lays]
        if any(out.untyped_storage().data_ptr() == m.untyped_storage().data_ptr() for m in msgs):
            calls["n"] += 1
            if calls["n"] == 5:  # a piece in the middle of the bucket
                raise RuntimeError("injected codec failure")
        return real(*a, **k)

    for step in range(3):
        if step == 2 and rank == 1:
            setattr(codecs, name, boom)
        try:
            ddp(torch.randn(8, 64)).square().mean().backward()
        except CompressionError as e:
            pieces = max(len(lay.pieces) for lay in state._engine.layouts.values())
            return {"step": step, "msg": str(e), "cause": repr(e.__cause__), "pieces": pieces}
    return {"step": None}


@pytest.mark.parametrize("stage", ["encoding", "reduction"])
def test_error_in_a_middle_piece_fails_every_rank_alike(stage):
    res = run_workers(_fails_mid_bucket, 2, stage, timeout=90)
    assert res[0]["step"] == res[1]["step"] == 2, res
    assert res[0]["pieces"] >= 4
    assert res[0]["msg"] == res[1]["msg"]
    assert f"compression failed on rank 1 during {stage}" in res[0]["msg"], res[0]["msg"]
    assert "injected codec failure" in res[1]["cause"]


def test_suggest_bucket_cap_mb():
    from fastml_strategy.hook import suggest_bucket_cap_mb

    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    model[1].bias.requires_grad_(False)  # frozen: no gradient, no bucket space
    nbytes = 4 * (2 * 1024 * 1024 + 1024)
    assert suggest_bucket_cap_mb(model) == round(nbytes / 4 / (1 << 20), 2)
    assert suggest_bucket_cap_mb(model, buckets=8) == round(nbytes / 8 / (1 << 20), 2)
    with pytest.raises(ValueError, match="buckets"):
        suggest_bucket_cap_mb(model, buckets=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_plain_all_reduce_finiteness_check(dtype):
    # the plain (`none`) bucket's check reads the sum first: NaN/inf must still be caught, and finite
    # values whose sum overflows must not be taken for non-finite ones
    from fastml_strategy.comm.collective import _finite

    big = torch.finfo(dtype).max
    t = torch.full((1000,), big, dtype=dtype)
    assert _finite(t)
    for bad in (float("nan"), float("inf"), -float("inf")):
        u = torch.zeros(1001, dtype=dtype)
        u[500] = bad
        assert not _finite(u)
        t[999] = bad
        assert not _finite(t)
        t[999] = big
