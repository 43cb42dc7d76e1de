"""The recursive halving/doubling schedule (fastml_strategy.comm._halving) on real gloo ranks: its result on
3, 4, 5 and 8 ranks (non-powers of two fold in), bit-identical replicas, error feedback as in the ring
schedule, `none` through it equal to DDP within 1e-6, the bytes it counts against the cost model's
function, and the choice between the schedules (unit tests: no process).

Small tensors and one call per world size: 8 ranks share the machine's 2 cores.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from _dist import run_workers

# parameters of one bucket: two compressed layers (one cut into two pipeline pieces) and two small
# ones (batched, uncompressed), at odd sizes
_NUMELS = (5000, 700, 3001, 64)
_NAMES = ("a.weight", "a.bias", "b.weight", "b.bias")
_PIECE = 4096


def _grads(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(sum(_NUMELS), generator=g) * (1 + rank)


def _engine(plan, rank, W, schedule):
    from fastml_strategy.comm.collective import CompressedAllReduce

    eng = CompressedAllReduce(dataclasses.replace(plan, schedule=schedule), dist.group.WORLD, rank, W,
                              piece_numel=_PIECE)
    offsets = [sum(_NUMELS[:i]) for i in range(len(_NUMELS))]
    return eng, eng.layout_for(_NAMES, offsets, _NUMELS, torch.device("cpu"))


def _one_step(eng, lay, x, step):
    old = {k: v.clone() for k, v in eng.residuals().items()}
    buf = x.clone()
    assert eng.run(lay, buf, step)
    return buf, old, {k: v.clone() for k, v in eng.residuals().items()}


def _schedule_case(rank, W, recipe):
    """Two steps of one bucket through each schedule (forced), on the same inputs."""
    import fastml_strategy as fm
    from fastml_strategy import codecs

    plan = fm.Plan.from_recipe(recipe)
    out = {}
    for schedule in ("ring", "halving"):
        eng, lay = _engine(plan, rank, W, schedule)
        res = []
        for step in range(2):
            x = _grads(rank, step)
            buf, old, new = _one_step(eng, lay, x, step)
            # the error-feedback invariant, per compressed layer: the residual is the rank's own
            # first-stage encoding error, decode(enc) + new residual == grad + old residual
            inv = 0.0
            for name, n in zip(_NAMES, _NUMELS):
                if name not in new:
                    continue
                cfg = lay.configs[name]
                off = sum(_NUMELS[:_NAMES.index(name)])
                v = x[off: off + n] + old[name]
                enc = torch.empty(codecs.chunk_nbytes(n, cfg), dtype=torch.uint8)
                codecs.encode_chunk(x[off: off + n].clone(), cfg, enc, old[name].clone(), None)
                dec = torch.empty(n)
                codecs.decode_chunk(enc, n, cfg, dec)
                inv = max(inv, float((dec + new[name] - v).abs().max()))
            res.append({"buf": buf, "inv": inv, "residuals": new})
        out[schedule] = {"steps": res, "bytes": eng.bytes_sent, "schedules": eng.schedule_counts(),
                         "pieces": len(lay.pieces)}
    # the exact fp32 mean of the inputs, for the error bound
    exact = []
    for step in range(2):
        t = _grads(rank, step).clone()
        dist.all_reduce(t)
        exact.append(t / W)
    out["exact"] = exact
    # `none` forced through halving against DDP's own all-reduce (divide, then all_reduce)
    eng, lay = _engine(fm.Plan.from_recipe("none"), rank, W, "halving")
    x = _grads(rank, 5)
    buf = x.clone()
    assert eng.run(lay, buf, 0)
    ref = x / W
    dist.all_reduce(ref)
    out["none_err"] = float((buf - ref).abs().max())
    out["none_schedules"] = eng.schedule_counts()
    out["failure"] = _one_rank_fails(plan, rank, W)
    return out


def _one_rank_fails(plan, rank, W):
    """Rank 0's first-stage encoding raises (a folded rank where N is not a power of two): every rank
    completes the bucket's messages and raises the same CompressionError, naming rank 0."""
    from fastml_strategy.comm.collective import CompressionError

    eng, lay = _engine(plan, rank, W, "halving")
    if rank == 0:
        def boom(*a, **k):
            raise RuntimeError("injected encoder failure")

        eng._encode_group = boom
    try:
        eng.run(lay, _grads(rank, 0), 0)
    except CompressionError as e:
        return str(e)
    return None


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world_size", [3, 4, 5, 8])
def test_halving_schedule_result(world_size):
    """Forced through halving, every rank holds the same bytes; the residuals are the ring schedule's
    (the same first-stage encoding) and satisfy the error-feedback invariant; the result is within the
    documented bound of the ring schedule's error; `none` equals DDP's all-reduce within 1e-6."""
    from fastml_strategy.comm._halving import halving_bytes_sent

    W = world_size
    res = run_workers(_schedule_case, W, "int4", timeout=220)
    for r in range(W):
        h, ring = res[r]["halving"], res[r]["ring"]
        assert h["schedules"] == {"halving": {"buckets": 2, "pieces": 2 * h["pieces"]}}, h["schedules"]
        assert ring["schedules"] == {"ring": {"buckets": 2, "pieces": 2 * ring["pieces"]}}
        assert h["pieces"] >= 2  # pipelined: several pieces, each its own rounds
        for step in range(2):
            hs, rs = h["steps"][step], ring["steps"][step]
            # replicas bit-identical
            assert torch.equal(hs["buf"], res[0]["halving"]["steps"][step]["buf"]), (r, step)
            assert hs["inv"] <= 1e-5, hs["inv"]
            # the same first-stage encoding: the same residuals as the ring schedule, bit for bit
            for k, v in rs["residuals"].items():
                assert torch.equal(hs["residuals"][k], v), (r, step, k)
            exact = res[r]["exact"][step]
            e_h = float((hs["buf"] - exact).norm() / exact.norm())
            e_r = float((rs["buf"] - exact).norm() / exact.norm())
            assert e_h <= 2.5 * e_r + 1e-6, (W, step, e_h, e_r)
            assert not torch.equal(hs["buf"], exact)  # it did compress
        assert res[r]["none_err"] <= 1e-6, res[r]["none_err"]
        assert res[r]["failure"] == res[0]["failure"] and "rank 0" in res[0]["failure"], res[r]["failure"]
        assert "injected encoder failure" in res[0]["failure"]
        assert list(res[r]["none_schedules"]) == ["halving"] and res[r]["none_schedules"]["halving"]["buckets"] == 1
    # bytes: what the runtime counted is the tensor-free function's (headers included), per rank
    from fastml_strategy import Plan
    from fastml_strategy.comm._layouts import bucket_wire

    plan = Plan.from_recipe("int4")
    cfgs = tuple(plan.for_parameter(n, k) for n, k in zip(_NAMES, _NUMELS))
    wire = bucket_wire(_NUMELS, cfgs, W, piece_numel=_PIECE)
    for r in range(W):
        want = sum(halving_bytes_sent(p.split_sizes, r) for p in wire.pieces)
        assert res[r]["halving"]["bytes"] == 2 * want, (r, res[r]["halving"]["bytes"], want)
        assert res[r]["ring"]["bytes"] == 2 * wire.bytes_sent(r)
    mean = sum(res[r]["halving"]["bytes"] for r in range(W)) / W
    # the ring's mean, less its all_gather's padding to the largest chunk (halving sends chunks as they are)
    assert mean <= 2 * wire.bytes_sent(), mean


def _ddp_case(rank, W, steps=3):
    """DDP with the hook: int4 ("auto" on a 5 ms link: halving) and `none` forced through halving
    against plain DDP, on one small multi-bucket MLP."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastml_strategy as fm

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.ReLU(), torch.nn.Linear(96, 96),
                                   torch.nn.ReLU(), torch.nn.Linear(96, 10))

    def train(plan):
        m = model()
        ddp = DDP(m, bucket_cap_mb=0.02)
        state = fm.register_hook(ddp, plan=plan) if plan is not None else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + rank)
            ddp(torch.randn(8, 32, generator=g)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        stats = state.stats() if state is not None else None
        if state is not None:
            state.close()
        return flat, stats

    int4, s4 = train(fm.Plan.from_recipe("int4", link_latency_us=5000.0, link_gbps=0.1))  # a far link
    none, sn = train(fm.Plan.from_recipe("none", schedule="halving"))
    ddp, _ = train(None)
    every = [torch.zeros_like(int4) for _ in range(W)]
    dist.all_gather(every, int4)
    return {"identical": all(torch.equal(e, int4) for e in every), "s4": s4["schedules"],
            "none_err": float((none - ddp).abs().max()), "sn": sn["schedules"],
            "moved": float((int4 - ddp).abs().max())}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [4, 8])
def test_ddp_hook_runs_halving(world_size):
    """Through DDP's hook: "auto" on a far link runs halving (stats() says so), replicas stay
    bit-identical, `none` forced through halving trains as plain DDP does within 1e-6."""
    for r in run_workers(_ddp_case, world_size, timeout=280):
        assert r["identical"]
        assert set(r["s4"]) == {"halving", "plain"} and r["s4"]["halving"]["buckets"] > 0, r["s4"]
        assert set(r["sn"]) == {"halving"}, r["sn"]
        assert r["none_err"] <= 1e-6, r["none_err"]
        assert r["moved"] > 0
