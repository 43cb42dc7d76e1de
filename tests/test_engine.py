"""The one engine interface (fastml_strategy.engine): the DDP hook, FSDP2 and LocalSGD engines on real
gloo ranks answer the same calls alike, and ``attach`` picks the engine a wrapped model needs."""

from __future__ import annotations

import pytest
import torch

from _dist import run_workers


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))


def _loss(model, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 64, generator=g)
    return torch.nn.functional.mse_loss(model(x), torch.zeros(16, 8))


def _exercise(engine, model, rank, every=1):
    """Two steps, then the interface: its stats, a state round trip, close twice."""
    from fastml_strategy.engine import COMMON_STATS, Engine

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(2 * every):
        _loss(model, rank, step).backward()
        opt.step()
        opt.zero_grad()
        if engine.kind == "localsgd":
            engine.step()
    stats = engine.stats()
    sd = engine.state_dict()
    engine.load_state_dict(sd)
    out = {"protocol": isinstance(engine, Engine), "kind": engine.kind, "engine": stats["engine"],
           "missing": [k for k in COMMON_STATS if k not in stats], "sent": stats["bytes_sent"],
           "unc": stats["bytes_uncompressed"], "failure": engine.failure, "sd_kind": sd.get("kind")}
    engine.close()
    engine.close()  # a second call does nothing
    return out


def _three_engines(rank, world_size):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastml_strategy as fm
    from fastml_strategy.engine import attach

    res = {}
    ddp = DDP(_mlp())
    res["ddp"] = _exercise(attach(ddp, "int4"), ddp, rank)
    try:  # FSDP's settings on a DDP model: the same error on every rank
        attach(ddp, "int4", owner="test", all_gather_bits=8)
    except ValueError as e:
        res["fsdp_only"] = str(e)
    sharded = _mlp()
    for layer in sharded:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(sharded)
    res["fsdp"] = _exercise(attach(sharded, "int4"), sharded, rank)
    plain = _mlp()
    res["plain"] = attach(plain, "int4") is None  # neither DDP nor FSDP2: the caller says so
    res["localsgd"] = _exercise(fm.LocalSGD(plain, every=2, plan="int4"), plain, rank, every=2)
    # LocalSGD's DDP baseline is DDP's all-reduce in the parameters' dtype (bf16: 2 bytes an element)
    half = _mlp().to(torch.bfloat16)
    local = fm.LocalSGD(half, every=1, plan="int4")
    for step in range(2):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(step + rank)).to(torch.bfloat16)
        half(x).float().pow(2).mean().backward()
        torch.optim.SGD(half.parameters(), lr=0.05).step()
        local.step()
    numel = sum(p.numel() for p in half.parameters())
    res["bf16_ddp_bytes"] = (local.stats()["ddp_bytes"], round(2.0 * (world_size - 1) / world_size * 2 * numel * 2))
    local.close()
    res["advice"] = _min_numel_advice()
    dist.barrier()
    return res


def _min_numel_advice():
    """FSDP2 and LocalSGD give the DDP hook's min_numel advice (every tensor of this model is under the
    default min_numel, so int4 compresses nothing): on rank 0, once per engine."""
    import warnings

    from torch.distributed.fsdp import fully_shard

    import fastml_strategy as fm
    from fastml_strategy import _advice

    def small():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))

    out = {}
    for kind in ("fsdp", "localsgd"):
        _advice._GIVEN.clear()
        model = small()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if kind == "fsdp":
                fully_shard(model)
                engine = fm.attach(model, "int4")
            else:
                engine = fm.LocalSGD(model, every=2, plan="int4")
        engine.close()
        out[kind] = [str(w.message) for w in seen if issubclass(w.category, fm.FastMLAdvice)]
    return out


@pytest.mark.timeout(120)
def test_every_engine_offers_the_same_interface():
    for r, res in enumerate(run_workers(_three_engines, 2, timeout=110)):
        for kind in ("ddp", "fsdp", "localsgd"):
            out = res[kind]
            assert out["protocol"] and out["kind"] == out["engine"] == kind, (r, kind, out)
            assert out["missing"] == [], (r, kind, out)
            assert out["sent"] > 0 and out["unc"] > out["sent"], (r, kind, out)  # int4 compressed
            assert out["failure"] is None, (r, kind, out)
        assert res["fsdp"]["sd_kind"] == "fsdp" and res["localsgd"]["sd_kind"] == "localsgd"
        assert res["plain"]
        got, want = res["bf16_ddp_bytes"]
        for kind in ("fsdp", "localsgd"):
            advice = res["advice"][kind]
            if r == 0:
                assert len(advice) == 1 and "min_numel" in advice[0] and "compresses 0.0%" in advice[0], advice
            else:
                assert advice == [], advice
        assert got == want, res["bf16_ddp_bytes"]
        assert "['all_gather_bits'] are for an FSDP2 model" in res["fsdp_only"] and "test:" in res["fsdp_only"]
