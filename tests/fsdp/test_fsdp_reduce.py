"""FastML's compressed reduce-scatter inside FSDP2 and its cross-replica all-reduce inside HSDP, in
real gloo runs: exactness of the uncompressed path against FSDP's own, FSDP2's sharding rule, the
layouts FSDP changes (frozen, unused, accumulated, resharded, bf16), and HSDP replicas."""

from __future__ import annotations

import pytest
import torch

from _fsdp_helpers import OddNet, full_params, local_params, max_diff, plan, shard
from _dist import run_workers

pytestmark = pytest.mark.timeout(180)


def _step(model, gen, *, branch=False, sync=True):
    from torch.distributed.fsdp import FSDPModule

    x = torch.randn(8, 13, generator=gen)
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(sync)
    model(x, branch=branch).square().mean().backward()


def _pair(rank, world_size, recipe, steps, options=None):
    """Train FSDP's own and FastML's reduce-scatter side by side from the same start and data."""
    o = {"accumulate": 1, "reshard": True, "freeze_until": 0, "unused": False, "mp": None,
         **(options or {})}
    accumulate, reshard, freeze_until, unused, mp = (o["accumulate"], o["reshard"], o["freeze_until"],
                                                     o["unused"], o["mp"])
    import fastml_strategy.fsdp as ff
    from torch.distributed.fsdp import MixedPrecisionPolicy

    kw = {"reshard_after_forward": reshard}
    if mp is not None:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=mp)
    ref, fm_model = shard(OddNet(), **kw), shard(OddNet(), **kw)
    if unused:  # FSDP's own needs it too when ranks use different parameters (FastML turns it on)
        ref.set_reduce_scatter_unused_params(True)
    if freeze_until:
        for m in (ref, fm_model):
            m.b.weight.requires_grad_(False)
    state = ff.register(fm_model, plan=plan(recipe))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, fm_model)]
    gens = [torch.Generator().manual_seed(100 + rank) for _ in range(2)]
    for step in range(steps):
        if freeze_until and step == freeze_until:
            for m in (ref, fm_model):
                m.b.weight.requires_grad_(True)
        for model, opt, gen in zip((ref, fm_model), opts, gens):
            for micro in range(accumulate):
                # per-rank unused branch: rank 0 uses `skip` on even steps, the others never
                _step(model, gen, branch=unused and rank == 0 and step % 2 == 0,
                      sync=micro == accumulate - 1)
            opt.step()
            opt.zero_grad()
    return full_params(ref), full_params(fm_model), state.stats()


def _sharding_rule(rank, W):
    import fastml_strategy.fsdp as ff
    from torch.distributed.fsdp import fully_shard

    shapes = [(37, 13), (5, 37), (3, 5), (5,), (1,), (2, 3, 4), (7,)]
    mods = torch.nn.ModuleList(torch.nn.Module() for _ in shapes)
    for m, s in zip(mods, shapes):
        m.w = torch.nn.Parameter(torch.randn(*s))
        fully_shard(m)
    out = []
    for m, s in zip(mods, shapes):
        fp = m._get_fsdp_state()._fsdp_param_groups[0].fsdp_params[0]
        chunks, padded = ff.shard_chunks(s, W)
        out.append((chunks[rank], fp.sharded_size.numel(), padded,
                    fp.padded_sharded_param_size.numel(), sum(chunks), torch.Size(s).numel()))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharding_rule_matches_fsdp(world_size):
    for rows in run_workers(_sharding_rule, world_size, timeout=90):
        for mine, fsdp, padded, fsdp_padded, total, numel in rows:
            assert (mine, padded, total) == (fsdp, fsdp_padded, numel)


@pytest.mark.parametrize("world_size", [2, 3])
def test_none_equals_fsdp_own_reduce_scatter(world_size):
    res = run_workers(_pair, world_size, "none", 5, timeout=120)
    for ref, got, stats in res:
        assert max_diff(ref, got) < 1e-6
        assert stats["steps"] == 5 and stats["residual_bytes"] == 0
        # the uncompressed path moves what FSDP moves, plus one 64-byte header per peer and call
        assert stats["bytes_sent"] > 0.9 * stats["bytes_uncompressed"]


def test_layouts_fsdp_changes_between_steps():
    """A frozen layer unfrozen at step 3, a branch only rank 0 uses (FastML turns on
    reduce_scatter_unused_params, so every rank's message has the same layout), two micro-batches
    per step, and reshard_after_forward=False: `none` still equals FSDP's own exactly."""
    res = run_workers(_pair, 2, "none", 6, dict(accumulate=2, reshard=False, freeze_until=3,
                                                 unused=True), timeout=120)
    for ref, got, stats in res:
        assert max_diff(ref, got) < 1e-6
        assert stats["steps"] == 6  # one per synchronised backward, not per micro-batch


def test_accumulation_compresses_only_the_syncing_step():
    one = run_workers(_pair, 2, "int4", 4, timeout=120)
    two = run_workers(_pair, 2, "int4", 4, {"accumulate": 3}, timeout=120)
    for (_, _, s1), (_, _, s3) in zip(one, two):
        assert s1["steps"] == s3["steps"] == 4
        assert s1["bytes_sent"] == s3["bytes_sent"]


def test_bf16_mixed_precision():
    res = run_workers(_pair, 2, "none", 4, {"mp": torch.bfloat16}, timeout=120)
    for ref, got, stats in res:
        # FastML sums in fp32 before rounding to bf16: within bf16's rounding of FSDP's own
        assert max_diff(ref, got) < 2e-2
        # an uncompressed layer travels in the reduce dtype (bf16), as in FSDP's own reduce-scatter
        row = stats["layers"]["a.weight"]
        assert row["codec"] == "bf16" and row["bytes"] <= 2 * row["numel"]
    q = run_workers(_pair, 2, "int4", 4, {"mp": torch.bfloat16}, timeout=120)
    for _, _, stats in q:
        assert stats["compression_ratio"] > 1.5
        assert stats["layers"]["a.weight"]["codec"] == "int4"


_RESIDUAL_CHOICES = [({}, 4), ({"residual_dtype": "bf16"}, 2), ({"error_feedback": False}, 0)]


def _residual_bytes(rank, world_size):
    import fastml_strategy as fm
    import fastml_strategy.fsdp as ff

    out = []
    for kw, _ in _RESIDUAL_CHOICES:
        model = shard(OddNet())
        state = ff.register(model, plan=fm.Plan.uniform(bits=4, min_numel=0, **kw))
        before = state.stats()["residual_bytes"]
        _step(model, torch.Generator().manual_seed(rank))
        numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
        out.append((before, state.stats()["residual_bytes"], numel))
        state.close()
    return out


def test_residual_memory_is_the_unsharded_gradient():
    """FSDP: one residual per rank as large as the unsharded gradient, in the chosen dtype (fp32: 4
    bytes per parameter, bf16: 2, no error feedback: 0), there from registration on."""
    for rows in run_workers(_residual_bytes, 2, timeout=90):
        for (before, after, numel), (_, per_param) in zip(rows, _RESIDUAL_CHOICES):
            assert before == after == per_param * numel


def _hsdp(rank, world_size, recipe, steps, form):
    import fastml_strategy.fsdp as ff
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    ref = shard(OddNet(), mesh=mesh)
    model = shard(OddNet(), mesh=mesh if form == "native" else mesh["shard"])
    group = None if form == "native" else mesh["replicate"].get_group()
    state = ff.register(model, plan=plan(recipe), replicate_group=group)
    # FastML's takeover of native HSDP must not change how FSDP reshards after forward
    post_mesh = [g._use_post_forward_mesh for m in (ref, model) for g in m._get_fsdp_state()._fsdp_param_groups]
    assert post_mesh == [False] * len(post_mesh), post_mesh
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    gens = [torch.Generator().manual_seed(7 + rank) for _ in range(2)]
    for _ in range(steps):
        for m, opt, gen in zip((ref, model), opts, gens):
            _step(m, gen)
            opt.step()
            opt.zero_grad()
    shard_rank = mesh["shard"].get_local_rank()
    own = sum(ff.shard_chunks(p.shape, world_size // 2)[0][shard_rank] for p in model.parameters())
    return local_params(model), full_params(ref), full_params(model), dict(state.stats(), own=own)


@pytest.mark.parametrize("form", ["native", "replicate_group"])
def test_hsdp_replicas_stay_bit_identical(form):
    """4 ranks as 2 replicas x 2 shards, 20 steps of int4 across replicas (error feedback on the
    shard): ranks r and r + 2 hold the same shard, bit for bit."""
    res = run_workers(_hsdp, 4, "int4", 20, form, timeout=170)
    for r in (0, 1):
        mine, other = res[r][0], res[r + 2][0]
        assert all(mine[n] == other[n] for n in mine)
    stats = res[0][3]
    assert stats["replicate_size"] == 2 and stats["shard_size"] == 2 and stats["steps"] == 20
    row = stats["layers"]["a.weight"]  # this rank's shard of it, across the 2 replicas
    assert row["codec"] == "int4" and 4 * row["bytes"] < 4 * row["numel"]
    assert stats["compression_ratio"] > 1.2  # the tiny model's 64-byte headers weigh on the total
    assert "all_reduce" in stats and "reduce_scatter" not in stats  # intra-node: FSDP's own
    # error feedback on this rank's shard only (1/S of the model), in fp32
    for *_, s in res:
        assert s["residual_bytes"] == 4 * s["own"]
    # and the model still trains like HSDP's own (loose: int4 is lossy)
    assert max_diff(res[0][1], res[0][2]) < 0.05


def test_hsdp_none_equals_hsdp_own():
    for local, ref, got, stats in run_workers(_hsdp, 4, "none", 3, "native", timeout=170):
        assert max_diff(ref, got) < 1e-6


def _quantized_all_gather(rank, world_size, bits):
    import fastml_strategy.fsdp as ff

    ref, model = shard(OddNet()), shard(OddNet())
    state = ff.register(model, plan=plan("none"), all_gather_bits=bits)
    seen = []
    # what forward computes with: the unsharded weight, the same on every rank
    model.a.register_forward_pre_hook(lambda mod, args: seen.append(mod.weight.detach().clone().tolist()))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    gens = [torch.Generator().manual_seed(3 + rank) for _ in range(2)]
    for _ in range(4):
        for m, opt, gen in zip((ref, model), opts, gens):
            _step(m, gen)
            opt.step()
            opt.zero_grad()
    exact = ref.a.weight.detach().full_tensor()
    quantized_err = float((torch.tensor(seen[-1]) - model.a.weight.detach().full_tensor()).abs().max())
    return seen[-1], state.stats()["all_gather"], max_diff(full_params(ref), full_params(model)), \
        quantized_err, float(exact.abs().max())


def test_quantized_parameter_all_gather():
    """Opt-in int8 all-gather (ZeRO++ qwZ): every rank computes with the same quantized copy of the
    parameters, within int8's rounding of the exact shards, which the optimizer keeps exact."""
    res = run_workers(_quantized_all_gather, 2, 8, timeout=120)
    assert res[0][0] == res[1][0]  # identical unsharded parameters on every rank
    for _, ag, diff, q_err, scale in res:
        assert ag["codec"] == "int8" and ag["compression_ratio"] > 3
        assert 0 < q_err < scale / 100  # quantized copies, not the exact ones
        assert diff < 1e-2  # trains like FSDP's own
