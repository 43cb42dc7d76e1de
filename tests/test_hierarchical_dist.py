"""The hierarchical all-reduce (fastml_strategy.hierarchical) in real DDP runs: 4 gloo processes told
``ranks_per_node=2`` (two machines of two ranks; on one host the "machines" share a loopback, which
does not change what is computed). One pool call carries every contract, to keep CI time down (the
fault cases are in tests/faults/test_faults_ranks.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers

pytestmark = pytest.mark.timeout(180)

W, R = 4, 2


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _identical(model, world_size: int) -> bool:
    flat = _flat(model)
    out = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(out, flat)
    return all(torch.equal(out[0], o) for o in out[1:])


def _steps(ddp, opt, rank: int, start: int, stop: int) -> None:
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad()


def _run(plan, rank, steps, ranks_per_node=R, model=None):
    import fastml_strategy as fm

    model = model or _mlp()
    ddp = DDP(model, bucket_cap_mb=0.02)  # several buckets; DDP rebuilds them after step 1
    state = fm.register_hook(ddp, plan=plan, ranks_per_node=ranks_per_node)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    _steps(ddp, opt, rank, 0, steps)
    return model, ddp, state, opt


def _contracts(rank, world_size):
    import fastml_strategy as fm
    from fastml_strategy import RECIPES

    out = {}
    # 1. replicas bit-identical on every rank of both machines after 20 steps; stats split
    mixed = fm.Plan.from_recipe("int4").with_layers({"2.weight": RECIPES["topk1-int4"], "4.weight": RECIPES["int8"]})
    for name, plan in (("int4", "int4"), ("topk1-int4", "topk1-int4"), ("mixed", mixed)):
        model, _, state, _ = _run(plan, rank, 20)
        s = state.stats()
        out[name] = {"identical": _identical(model, world_size), "hierarchical": s["hierarchical"],
                     "split": (s["bytes_sent_inter"], s["bytes_sent_intra"], s["bytes_sent"]),
                     "rows": sorted(s["layers"]), "numel_0": s["layers"]["0.weight"]["numel"],
                     "finite": bool(torch.isfinite(_flat(model)).all()),
                     "ratio": (s["compression_ratio"], s.get("bytes_uncompressed_inter"), s.get("compression_ratio_intra"))}
        state.close()
    model, _, state, _ = _run("int4", rank, 20, ranks_per_node=1)  # flat, for the bytes across machines
    out["flat_int4_bytes"] = state.stats()["bytes_sent"]
    out["flat_int4_ratio"] = state.stats()["compression_ratio"]
    state.close()
    # 1b. the hop inside the machine in bf16 (Plan.intra_node): replicas still bit-identical, the same
    # bytes across machines, half the bytes inside, and close to the exact hop's model
    ref_model, _, ref_state, _ = _run("int4", rank, 20)
    model, _, state, _ = _run(fm.Plan.from_recipe("int4", intra_node="bf16"), rank, 20)
    s, r = state.stats(), ref_state.stats()
    out["intra_bf16"] = {"identical": _identical(model, world_size),
                         "inter": (s["bytes_sent_inter"], r["bytes_sent_inter"]),
                         "intra": (s["bytes_sent_intra"], r["bytes_sent_intra"]),
                         "ratio_intra": s.get("compression_ratio_intra"),
                         "rel_diff": float((_flat(model) - _flat(ref_model)).norm() / _flat(ref_model).norm())}
    state.close()
    ref_state.close()

    # 1c. what the cost model prices (autotune's hier_bucket_wire): this rank's bytes across and inside
    # the machine in the third step (DDP's buckets rebuilt), and the buckets that step reduced
    out["model_bytes"] = {}
    import dataclasses
    for name, plan in (("mixed", mixed), ("mixed_bf16", dataclasses.replace(mixed, intra_node=RECIPES["bf16"]))):
        model = _mlp()
        ddp = DDP(model, bucket_cap_mb=0.02)
        state = fm.register_hook(ddp, plan=plan, ranks_per_node=R)
        eng = state._engine
        used, layout_for = [], eng.layout_for

        def recording(names, *a, _used=used, _layout_for=layout_for, **k):
            _used.append(tuple(names))
            return _layout_for(names, *a, **k)

        eng.layout_for = recording
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(3):
            used.clear()
            before = (eng.bytes_sent_inter, eng.bytes_sent_intra)
            _steps(ddp, opt, rank, step, step + 1)
        out["model_bytes"][name] = {"buckets": list(used), "inter": eng.bytes_sent_inter - before[0],
                                    "intra": eng.bytes_sent_intra - before[1],
                                    "local": eng.topo.local_rank, "node": eng.topo.node_rank}
        state.close()

    # 2. `none` through the hierarchy is DDP's all-reduce (within 1e-6 after 10 steps)
    model, _, state, _ = _run("none", rank, 10)
    ref = _mlp()
    ddp_ref = DDP(ref, bucket_cap_mb=0.02)
    _steps(ddp_ref, torch.optim.SGD(ddp_ref.parameters(), lr=0.05, momentum=0.9), rank, 0, 10)
    out["none_hier"] = state.hierarchical
    out["none_vs_ddp"] = float((_flat(model) - _flat(ref)).abs().max())
    state.close()

    # 3. resume bit-exact: the shard residuals travel in state_dict(all_ranks=True)
    model, ddp, state, opt = _run("int4", rank, 4)
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": __import__("copy").deepcopy(opt.state_dict()), "fastml": state.state_dict(all_ranks=True)}
    saved_stats = state.stats()
    out["residual_sizes"] = sorted(v.numel() for v in saved["fastml"]["per_rank"][rank]["residuals"].values())
    _steps(ddp, opt, rank, 4, 8)
    straight = _flat(model)
    state.close()
    model2 = _mlp()
    model2.load_state_dict(saved["model"])
    ddp2 = DDP(model2, bucket_cap_mb=0.02)
    state2 = fm.register_hook(ddp2, plan="int4", ranks_per_node=R)
    state2.load_state_dict(saved["fastml"])
    loaded = state2.stats()
    out["counters_resumed"] = all(loaded[k] == saved_stats[k] for k in (
        "bytes_sent", "bytes_sent_inter", "bytes_uncompressed_inter", "bytes_uncompressed_intra", "compression_ratio"))
    opt2 = torch.optim.SGD(ddp2.parameters(), lr=0.05, momentum=0.9)
    opt2.load_state_dict(saved["opt"])
    _steps(ddp2, opt2, rank, 4, 8)
    out["resume_exact"] = torch.equal(straight, _flat(model2))
    state2.close()
    # ...and onto another ranks_per_node: refused (strict), with the way out; strict=False starts fresh
    ddp3 = DDP(_mlp(), bucket_cap_mb=0.02)
    state3 = fm.register_hook(ddp3, plan="int4", ranks_per_node=1)
    try:
        state3.load_state_dict(saved["fastml"])
        out["other_R"] = "loaded"
    except ValueError as e:
        out["other_R"] = str(e)
    state3.close()

    # 4. a ranks_per_node that does not divide the world: the same error on every rank, before any step
    try:
        fm.register_hook(DDP(_mlp(), bucket_cap_mb=0.02), plan="int4", ranks_per_node=3)
        out["bad_R"] = "registered"
    except ValueError as e:
        out["bad_R"] = str(e)
    return out


def test_hierarchical_contracts():
    res = run_workers(_contracts, W, timeout=150)
    for name in ("int4", "topk1-int4", "mixed"):
        for r in range(W):
            c = res[r][name]
            assert c["hierarchical"] and c["identical"] and c["finite"], (name, r, c)
            inter, intra, total = c["split"]
            assert inter > 0 and intra > 0 and inter + intra == total, (name, r, c)
            # one row per layer, the whole parameter's size (not the part's)
            assert c["rows"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"], c
            assert c["numel_0"] == 32 * 128
    # the headline ratio is the cross-machine one (old code: 1.3-1.4x, the exact hop inside counted
    # in), about the flat path's; the hop inside the machine is exact (1.0), halved by intra_node bf16
    for r in range(W):
        for name in ("int4", "topk1-int4", "mixed"):
            ratio, unc_inter, ratio_intra = res[r][name]["ratio"]
            inter = res[r][name]["split"][0]
            assert ratio == unc_inter / inter and ratio_intra == 1.0, (name, r, res[r][name])
        assert 0.8 * res[r]["flat_int4_ratio"] < res[r]["int4"]["ratio"][0] <= 1.05 * res[r]["flat_int4_ratio"], res[r]
        assert res[r]["intra_bf16"]["ratio_intra"] == 2.0, res[r]["intra_bf16"]
        assert res[r]["counters_resumed"], r
    # across machines each rank sends about a third of what the flat int4 path sends in all (per rank:
    # 2 (N-1)/N x S_c / R = 0.5 S_c against 2 (W-1)/W x S_c = 1.5 S_c), plus headers and fp32 biases
    inter = sum(res[r]["int4"]["split"][0] for r in range(W))
    flat = sum(res[r]["flat_int4_bytes"] for r in range(W))
    assert inter < 0.45 * flat, (inter, flat)
    for r in range(W):
        c = res[r]["intra_bf16"]
        assert c["identical"] and c["inter"][0] == c["inter"][1] and 2 * c["intra"][0] == c["intra"][1], c
        assert 0 < c["rel_diff"] < 1e-2, c  # one bf16 rounding of each step's gradient apart
    # the cost model's bytes are the counters' (every layer cut on the runtime's part boundaries)
    from fastml_strategy.autotune.costmodel import LayerProfile, hier_bucket_wire

    layers = {n: LayerProfile(name=n, numel=p.numel(), index=i, ready_s=0.0, grad_sq=1.0, tunable=p.numel() >= 4096)
              for i, (n, p) in enumerate(_mlp().named_parameters())}
    choice = {"0.weight": "int4", "2.weight": "topk1-int4", "4.weight": "int8"}
    for name, elem in (("mixed", 4), ("mixed_bf16", 2)):
        for r in range(W):
            got = res[r]["model_bytes"][name]
            assert got["buckets"], got
            want_inter = want_intra = 0
            for names in got["buckets"]:
                hw = hier_bucket_wire([layers[n] for n in names], choice, W // R, R)
                want_inter += hw.inter_bytes(got["local"], got["node"])
                want_intra += hw.intra_bytes(elem)
            assert (got["inter"], got["intra"]) == (want_inter, want_intra), (name, r, got, want_inter, want_intra)
    assert all(res[r]["none_hier"] for r in range(W))
    assert max(res[r]["none_vs_ddp"] for r in range(W)) < 1e-6, [res[r]["none_vs_ddp"] for r in range(W)]
    assert all(res[r]["resume_exact"] for r in range(W)), [res[r]["resume_exact"] for r in range(W)]
    # residuals are parts: 0.weight (4096) and 2.weight (16384) halved; the biases travel uncompressed
    assert res[0]["residual_sizes"] == [2048, 8192], res[0]["residual_sizes"]
    msg = res[0]["other_R"]
    assert "saved with 2 rank(s) per machine" in msg and "ranks_per_node=2" in msg and "strict=False" in msg, msg
    bad = {res[r]["bad_R"] for r in range(W)}
    assert len(bad) == 1, bad  # every rank, the same words
    msg = bad.pop()
    assert "rank(s) [0, 1, 2, 3]" in msg and "does not divide the world size 4" in msg, msg


# -- dtypes: `none` through the hierarchy against DDP, in the model's own dtype on the wire --------------
def _grads(model) -> torch.Tensor:
    return torch.cat([p.grad.detach().reshape(-1) for p in model.parameters()])


def _second_step_grads(ddp, rank: int, dtype) -> torch.Tensor:
    """The gradients of the second backward (DDP's buckets rebuilt after the first); no optimizer step,
    so every way of reducing sees the same parameters and inputs."""
    for step in range(2):
        ddp.zero_grad(set_to_none=True)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 32, generator=g).to(dtype), torch.randint(0, 10, (16,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x).float(), y).backward()
    return _grads(getattr(ddp, "module", ddp))


def _dtype_case(rank, world_size, dtype):
    import math

    import fastml_strategy as fm

    out = {}
    # the ranks' own gradients (no all-reduce), and their exact mean (fsum of the fp64 values)
    local = _mlp().to(dtype)
    mine = _second_step_grads(local, rank, dtype).double()
    every = [torch.zeros_like(mine) for _ in range(world_size)]
    dist.all_gather(every, mine)
    stacked = torch.stack(every).T.tolist()
    exact = torch.tensor([math.fsum(col) / world_size for col in stacked], dtype=torch.float64)
    scale = torch.stack(every).abs().mean(0)  # the mean magnitude of the ranks' values, per element
    ddp_grads = _second_step_grads(DDP(_mlp().to(dtype), bucket_cap_mb=0.02), rank, dtype).double()
    ddp = DDP(_mlp().to(dtype), bucket_cap_mb=0.02)
    state = fm.register_hook(ddp, plan="none", ranks_per_node=R)
    hier = _second_step_grads(ddp, rank, dtype)
    copies = _gathered(hier, world_size)
    out["replicas_equal"] = all(torch.equal(copies[0], c) for c in copies[1:])
    hier = hier.double()
    s = state.stats()
    state.close()
    out["stats"] = {k: s.get(k) for k in ("hierarchical", "bytes_sent_inter", "bytes_sent_intra", "compression_ratio",
                                          "compression_ratio_intra", "bytes_uncompressed_inter")}
    out["err_hier"] = float((hier - exact).norm())
    out["err_ddp"] = float((ddp_grads - exact).norm())
    out["err_floor"] = float((exact.to(dtype).double() - exact).norm())  # the exact mean, rounded once
    # each element against the bound its roundings allow (module docstring of hierarchical.py): the
    # machine's mean rounded once, then one rounding per addition across the N = 2 machines
    fin = torch.finfo(dtype)
    u = fin.eps / 2
    bound = 2 * u * (1 + u) * 2 * scale * 1.001 + fin.tiny * fin.eps
    out["over_bound"] = float(((hier - exact).abs() / bound).max())
    out["ddp_over_bound"] = float(((ddp_grads - exact).abs() / bound).max())
    return out


def _gathered(t: torch.Tensor, world_size: int) -> list:
    out = [torch.zeros_like(t) for _ in range(world_size)]
    dist.all_gather(out, t)
    return out


def _dtypes(rank, world_size):
    return {str(dt): _dtype_case(rank, world_size, dt)
            for dt in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@pytest.mark.timeout(360)
def test_none_through_the_hierarchy_keeps_the_model_dtype_and_matches_ddp():
    res = run_workers(_dtypes, W, timeout=300)
    for r in range(W):
        fp32 = res[r]["torch.float32"]["stats"]
        for name, elem in (("torch.float32", 4), ("torch.bfloat16", 2), ("torch.float16", 2), ("torch.float64", 8)):
            c = res[r][name]
            s = c["stats"]
            assert s["hierarchical"] and c["replicas_equal"], (name, r, c)
            # the bytes of the model's dtype on every hop: a bf16 model sends half an fp32 model's
            # bytes (old code: the same as fp32, twice what DDP sends), an fp64 model twice
            assert s["bytes_sent_inter"] * 4 == fp32["bytes_sent_inter"] * elem, (name, r, s, fp32)
            assert s["bytes_sent_intra"] * 4 == fp32["bytes_sent_intra"] * elem, (name, r, s, fp32)
            # nothing compressed: 1.0 across and inside machines for every dtype (old: fp64 below 1)
            assert s["compression_ratio"] == 1.0 and s["compression_ratio_intra"] == 1.0, (name, r, s)
            # every element within the rounding its schedule allows (two roundings of the dtype at
            # N = 2; measured at most 0.43 of it, DDP 0.50-0.61), and as accurate as DDP overall: both
            # errors sit near the floor of one final rounding into the dtype (measured 1.00x DDP's
            # norm in bf16, 0.96x fp16, 1.03x fp32, 0.95x fp64)
            assert c["over_bound"] <= 1.0, (name, r, c)
            assert c["err_floor"] <= c["err_hier"] <= 1.05 * c["err_ddp"], (name, r, c)
