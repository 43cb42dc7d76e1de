"""The sharded cost model (--sharding fsdp|hsdp): each formula against a hand computation, and the
predicted bytes and residual memory against real FSDP2 / HSDP runs of fastml_strategy.fsdp.register
on gloo ranks."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from fastml_strategy.autotune._state import _plan_from_choice
from fastml_strategy.autotune.catalog import HardwareOption, Link
from fastml_strategy.autotune.costmodel import (
    BASE_OPTIONS, CANDIDATES, Convergence, LayerProfile, Profile, Sharding, allreduce_unit_bytes,
    default_options, evaluate, fit_collective_overhead, fsdp_state_bytes, fsdp_units,
    reduce_scatter_unit_bytes, residual_bytes, sharded_step_time, step_time)
from fastml_strategy.autotune.profile import fsdp_unit_modules, unit_of
from fastml_strategy.fsdp import shard_chunks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _dist import run_workers  # noqa: E402


class Net(torch.nn.Module):
    """A root parameter of its own (the root unit), blocks in a ModuleList (one unit each) and a
    head; dim 0 of 131 and 37 does not split evenly, so FSDP pads."""

    def __init__(self) -> None:
        super().__init__()
        self.mix = torch.nn.Parameter(torch.randn(130, 32) * 0.1)  # 4160 elements: compressible
        self.blocks = torch.nn.ModuleList([torch.nn.Linear(130, 131), torch.nn.Linear(131, 128)])
        self.head = torch.nn.Linear(128, 37)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.mix.t()
        for b in self.blocks:
            h = torch.relu(b(h))
        return self.head(h)


def net_profile(model: torch.nn.Module, min_numel: int = 4096, optimizer_state_bytes=None) -> Profile:
    """A profile of the model's real shapes and units (times made up: bytes and memory only)."""
    units = fsdp_unit_modules(model)
    layers = []
    for i, (n, p) in enumerate(model.named_parameters()):
        lp = LayerProfile(name=n, numel=p.numel(), index=i, ready_s=0.01, grad_sq=1.0,
                          tunable=p.numel() >= min_numel, shape=list(p.shape), unit=unit_of(n, units))
        for o in CANDIDATES:
            lp.rel_error[o] = 0.0 if o == "none" else 0.1
            lp.codec_s[o] = 0.0
        layers.append(lp)
    return Profile(layers=layers, forward_s=0.01, backward_s=0.02, optimizer_s=0.004, world_size=2,
                   min_numel=min_numel, options=list(CANDIDATES),
                   optimizer_state_bytes=optimizer_state_bytes)


def one_layer_profile(rows=1024, cols=256, fwd=0.01, bwd=0.02, opt=0.004, codec_s=0.0):
    lp = LayerProfile(name="w.weight", numel=rows * cols, index=0, ready_s=bwd, grad_sq=1.0, tunable=True,
                      shape=[rows, cols], unit="w")
    for o in CANDIDATES:
        lp.rel_error[o] = 0.0 if o == "none" else 0.1
        lp.codec_s[o] = 0.0 if o == "none" else codec_s
    return Profile(layers=[lp], forward_s=fwd, backward_s=bwd, optimizer_s=opt, world_size=2,
                   min_numel=4096, options=list(CANDIDATES))


def option(nodes=2, per_node=1, gbps=1.0, latency_us=0.0, price=1.0):
    return HardwareOption(name="x", nodes=nodes, accelerators_per_node=per_node, price_per_hour=price,
                          bandwidth_gbps=gbps, latency_us=latency_us, compute_speed=1.0)


FSDP = Sharding(kind="fsdp")
HSDP = Sharding(kind="hsdp")
MIXED = {"mix": "topk1", "blocks.0.weight": "int2-rbf16", "blocks.1.weight": "fp16"}


# -- units, candidates -----------------------------------------------------------------------------------
def test_units_look_through_containers_and_keep_the_root():
    model = Net()
    assert fsdp_unit_modules(model) == ["blocks.0", "blocks.1", "head"]
    prof = net_profile(model)
    units = fsdp_units(prof)
    assert [u for u, _ in units] == ["", "blocks.0", "blocks.1", "head"]  # the root's own first
    assert [lp.name for lp in units[0][1]] == ["mix"]
    assert [lp.name for lp in units[3][1]] == ["head.weight", "head.bias"]


def test_sharded_runs_also_search_bf16_residuals():
    assert default_options("ddp") == list(BASE_OPTIONS)
    opts = default_options(FSDP)
    for base in BASE_OPTIONS:
        cfg = CANDIDATES[base]
        twin = f"{base}-rbf16"
        if not cfg.wire.sharded:  # low-rank: DDP only (FSDP refuses it: a shard is no matrix)
            assert base not in opts and twin not in opts
            continue
        assert (twin in opts) == cfg.uses_residual
        if cfg.uses_residual:
            assert CANDIDATES[twin].residual_dtype == "bf16"
            assert CANDIDATES[twin].describe().endswith("-rbf16")
            assert dataclasses.replace(CANDIDATES[twin], residual_dtype=cfg.residual_dtype) == cfg


def test_ddp_is_untouched_by_the_sharding_argument():
    prof = one_layer_profile(codec_s=1e-3)
    choice = {"w.weight": "int4"}
    assert step_time(prof, choice, option(), sharding=Sharding()) == step_time(prof, choice, option())


@pytest.mark.parametrize("bad, needle", [
    (dict(kind="zero"), "--sharding 'zero'"), (dict(kind="fsdp", param_dtype="fp8"), "--param-dtype 'fp8'"),
    (dict(kind="hsdp", reduce_dtype="fp16"), "--reduce-dtype 'fp16'")])
def test_sharding_rejects_what_it_cannot_model(bad, needle):
    with pytest.raises(ValueError, match=needle):
        Sharding(**bad)


# -- bytes ---------------------------------------------------------------------------------------------
def test_fsdp_own_collectives_bytes():
    prof = one_layer_profile(rows=1001, cols=8)  # 1001 rows over 2 ranks: 501 padded rows each
    padded = shard_chunks([1001, 8], 2)[1]
    assert padded == 501 * 8
    own = step_time(prof, {}, option(), hook=False, sharding=FSDP)
    # all-gather in forward and again in backward (resharded), fp32; reduce-scatter fp32
    assert own.allgather_bytes == 2 * (2 - 1) * padded * 4
    assert own.reduce_scatter_bytes == (2 - 1) * padded * 4 and own.allreduce_bytes == 0
    keep = Sharding(kind="fsdp", reshard_after_forward=False)
    assert step_time(prof, {}, option(), hook=False, sharding=keep).allgather_bytes == padded * 4
    bf = Sharding(kind="fsdp", param_dtype="bf16")  # reduce dtype follows the param dtype
    b = step_time(prof, {}, option(), hook=False, sharding=bf)
    assert b.allgather_bytes == own.allgather_bytes // 2
    assert b.reduce_scatter_bytes == own.reduce_scatter_bytes // 2


def test_the_root_unit_is_gathered_once():
    model = Net()
    prof = net_profile(model)
    units = dict(fsdp_units(prof))
    W = 4
    per_unit = {u: (W - 1) * sum(shard_chunks(lp.shape, W)[1] for lp in ls) * 4 for u, ls in units.items()}
    br = step_time(prof, {}, option(nodes=4), hook=False, sharding=FSDP)
    assert br.allgather_bytes == per_unit[""] + 2 * sum(v for u, v in per_unit.items() if u)


def test_fastml_reduce_scatter_bytes_follow_the_codec_helpers():
    from fastml_strategy.codecs import reduce_scatter_bytes

    prof = one_layer_profile(rows=1024, cols=256)
    lp = prof.layers[0]
    for W in (2, 3, 8):
        chunks, _ = shard_chunks(lp.shape, W)
        for name in ("int4", "int2-rbf16", "topk1", "fp16"):
            got = reduce_scatter_unit_bytes([lp], {lp.name: name}, W)
            assert got == reduce_scatter_bytes(list(chunks), CANDIDATES[name]) + (W - 1) * 64
    # uncompressed layers travel in the reduce dtype
    assert reduce_scatter_unit_bytes([lp], {}, 2, "bf16") == 1024 * 256 // 2 * 2 + 64


def test_hsdp_cross_node_bytes():
    from fastml_strategy.codecs import wire_bytes

    prof = one_layer_profile(rows=1024, cols=256)
    lp = prof.layers[0]
    S, R = 4, 8
    shard = lp.numel // S
    own = allreduce_unit_bytes([lp], {}, S, R, hook=False)
    assert own == round(2 * (R - 1) / R * shard * 4)
    got = allreduce_unit_bytes([lp], {lp.name: "int4"}, S, R)
    assert got == wire_bytes(shard, CANDIDATES["int4"], R) + 2 * (R - 1) * 64
    assert got < own / 7
    # top-k falls back to its dense codec where its all_gather would cost more, on the shard
    many = allreduce_unit_bytes([lp], {lp.name: "topk1"}, S, 64)
    assert many == wire_bytes(shard, CANDIDATES["topk1"], 64) + 2 * 63 * 64
    assert many == wire_bytes(shard, CANDIDATES["int8"], 64) + 2 * 63 * 64
    br = step_time(prof, {lp.name: "int4"}, option(nodes=R, per_node=S), sharding=HSDP)
    assert br.allreduce_bytes == got
    # inside the node: FSDP's own all-gathers (forward + backward) and reduce-scatter over S ranks
    assert br.allgather_bytes == 2 * (S - 1) * shard * 4
    assert br.reduce_scatter_bytes == (S - 1) * shard * 4


# -- memory --------------------------------------------------------------------------------------------
def test_residual_memory_per_rank():
    prof = one_layer_profile(rows=1024, cols=256)
    n = prof.layers[0].numel
    c = lambda o: {"w.weight": o}  # noqa: E731
    assert residual_bytes(prof, c("int4"), FSDP, 8, 1) == 4 * n  # the unsharded size, at any W
    assert residual_bytes(prof, c("int4-rbf16"), FSDP, 8, 1) == 2 * n
    assert residual_bytes(prof, c("int4-noef"), FSDP, 8, 1) == 0
    assert residual_bytes(prof, c("fp16"), FSDP, 8, 1) == 0
    assert residual_bytes(prof, c("int4"), HSDP, 4, 8) == 4 * n // 4  # the shard only
    assert residual_bytes(prof, c("topk1-rbf16"), HSDP, 4, 2) == 2 * n // 4
    br = step_time(prof, c("int4"), option(nodes=4), sharding=FSDP)
    assert br.residual_bytes == 4 * n
    assert step_time(prof, c("int4"), option(nodes=4), hook=False, sharding=FSDP).residual_bytes == 0


def test_fsdp_state_is_sharded_params_grads_and_measured_optimizer_state():
    prof = one_layer_profile(rows=1024, cols=256)
    n = prof.layers[0].numel
    assert fsdp_state_bytes(prof, 4) == n // 4 * (4 + 4 + 8)  # not measured: Adam's 8 assumed
    prof.optimizer_state_bytes = 0  # plain SGD
    assert fsdp_state_bytes(prof, 4) == n // 4 * 8
    prof.optimizer_state_bytes = 8 * n
    assert step_time(prof, {}, option(nodes=2, per_node=4), hook=False, sharding=HSDP).state_bytes == \
        n // 4 * 16


def test_a_residual_limit_makes_plans_infeasible():
    prof = one_layer_profile(rows=1024, cols=256)
    conv = Convergence(k=1.0, gamma=1.0, e_max=1.0)
    n = prof.layers[0].numel
    full = evaluate(prof, {"w.weight": "int4"}, option(), conv, 100, sharding=FSDP,
                    max_residual_bytes=3 * n)
    half = evaluate(prof, {"w.weight": "int4-rbf16"}, option(), conv, 100, sharding=FSDP,
                    max_residual_bytes=3 * n)
    assert not full["feasible"] and not full["memory_ok"] and full["residual_bytes"] == 4 * n
    assert half["feasible"] and half["memory_ok"]


def test_search_respects_the_residual_limit():
    from fastml_strategy.autotune.search import best_row, group_layers, run_search

    prof = one_layer_profile(rows=1024, cols=256, codec_s=1e-5)
    conv = Convergence(k=0.0, gamma=1.0, e_max=1.0)
    groups = group_layers(prof)
    n = prof.layers[0].numel
    rows = run_search(prof, groups, option(gbps=0.1), conv, 100, storage=None, study_name="t",
                      trials=len(CANDIDATES), seed=0, sharding=FSDP, max_residual_bytes=3 * n)
    best = best_row(rows)
    assert best["residual_bytes"] <= 3 * n and best["choice"]["w.weight"] != "none"
    assert all(r["feasible"] == (r["residual_bytes"] <= 3 * n) for r in rows)


# -- time ----------------------------------------------------------------------------------------------
def test_one_unit_without_overlap_is_the_sum_of_its_parts():
    """One unit: nothing to overlap, so the step is all-gather, forward, all-gather, backward,
    codec, reduce-scatter, optimizer on the shard, one after the other."""
    prof = one_layer_profile(rows=1024, cols=256, codec_s=2e-3)
    o = option(nodes=2, gbps=1.0, latency_us=50)
    B, a = 1e9 / 8, 50e-6
    shard = 1024 * 256 // 2
    ag = a + shard * 4 / B
    for hook, choice in ((False, {}), (True, {"w.weight": "int4"})):
        br = sharded_step_time(prof, choice, o, FSDP, hook=hook)
        rs_b = reduce_scatter_unit_bytes(prof.layers, choice, 2, hook=hook)
        codec = 2e-3 if hook else 0.0  # one round trip per step
        expect = ag + 0.01 + ag + 0.02 + codec + (a + rs_b / B) + 0.004 / 2
        assert br.step_s == pytest.approx(expect, rel=1e-12)
        assert br.codec_s == pytest.approx(codec)


def test_all_to_all_loads_the_node_link_with_every_local_rank():
    """FastML's reduce-scatter sends each chunk straight to its owner: with A ranks per node the
    node's link carries A x (W-A)/(W-1) of a rank's bytes, where FSDP's ring carries them once."""
    prof = one_layer_profile(rows=4096, cols=256)
    choice = {"w.weight": "int8"}
    n, A = 4, 8
    W = n * A
    o = option(nodes=n, per_node=A, gbps=10.0)
    fast = Sharding(kind="fsdp", intra_link=Link(1e15, 0.0))  # intra-node: free
    B = 10e9 / 8
    br = sharded_step_time(prof, choice, o, fast)
    rs_b = reduce_scatter_unit_bytes(prof.layers, choice, W)
    ag = (W - 1) * shard_chunks([4096, 256], W)[1] * 4 / B
    assert br.wire_s == pytest.approx(2 * ag + A * rs_b * (W - A) / (W - 1) / B, rel=1e-9)


def test_overhead_fit_recovers_a_known_value():
    prof = one_layer_profile()
    o = option(nodes=2, gbps=1.0)
    prof.collective_overhead_s = 3e-3
    measured = sharded_step_time(prof, {}, o, FSDP, hook=False).step_s
    prof.collective_overhead_s = 0.0
    assert fit_collective_overhead(prof, o, measured, FSDP) == pytest.approx(3e-3, rel=1e-6)
    assert prof.collective_overhead_s == 0.0
    assert fit_collective_overhead(prof, o, 1e-6, FSDP) == 0.0  # the model is already slower


# -- against real runs -----------------------------------------------------------------------------------
def _train_two_steps(model, rank):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x, y = torch.randn(8, 32, generator=g), torch.randint(0, 37, (8,), generator=g)
        torch.nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()


def _fsdp_worker(rank, world, configs, replicas):
    """Train 2 steps per config with FSDP2 (HSDP on a (replicas, world/replicas) mesh when
    replicas > 1) and fastml_strategy.fsdp.register; return what FastML counted."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fastml_strategy.fsdp as ffsdp
    from fastml_strategy.autotune.profile import fsdp_unit_modules

    out = []
    for plan, bf16 in configs:
        torch.manual_seed(0)
        model = Net()
        kw = {}
        if bf16:
            kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        if replicas > 1:
            from torch.distributed.device_mesh import init_device_mesh

            kw["mesh"] = init_device_mesh("cpu", (replicas, world // replicas),
                                          mesh_dim_names=("replicate", "shard"))
        for path in fsdp_unit_modules(model):
            fully_shard(model.get_submodule(path), **kw)
        fully_shard(model, **kw)
        state = ffsdp.register(model, plan=plan)
        _train_two_steps(model, rank)
        st = state.stats()
        out.append({"steps": st["steps"], "residual": st["residual_bytes"],
                    "rs": st.get("reduce_scatter", {}).get("bytes_sent", 0),
                    "ar": st.get("all_reduce", {}).get("bytes_sent", 0)})
        state.close()
    return out


CHOICES = [({n: "int4" for n in ("mix", "blocks.0.weight", "blocks.1.weight", "head.weight")}, False),
           (MIXED, False), (MIXED, True), ({}, True)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_fsdp_bytes_and_residuals_match_a_real_two_rank_run():
    prof = net_profile(Net())
    configs = [(_plan_from_choice(prof, c, "t")[1], bf16) for c, bf16 in CHOICES]
    results = run_workers(_fsdp_worker, 2, configs, 1, timeout=100)
    units = fsdp_units(prof)
    for (choice, bf16), *per_rank in zip(CHOICES, *results):
        for rank, got in enumerate(per_rank):
            assert got["steps"] == 2
            want = sum(reduce_scatter_unit_bytes(ls, choice, 2, "bf16" if bf16 else "fp32", rank=rank)
                       for _, ls in units)
            assert got["rs"] == 2 * want, (choice, bf16, rank)  # exact, every step
            assert got["residual"] == residual_bytes(prof, choice, FSDP, 2, 1)


def _all_gather_worker(rank, world, configs):
    """Train 2 steps per (plan, all_gather_bits, bf16) with FSDP2 and register(all_gather_bits=...);
    return the quantized all-gather's counters."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import fastml_strategy.fsdp as ffsdp
    from fastml_strategy.autotune.profile import fsdp_unit_modules

    out = []
    for plan, bits, bf16 in configs:
        torch.manual_seed(0)
        model = Net()
        kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)} if bf16 else {}
        for path in fsdp_unit_modules(model):
            fully_shard(model.get_submodule(path), **kw)
        fully_shard(model, **kw)
        state = ffsdp.register(model, plan=plan, all_gather_bits=bits)
        _train_two_steps(model, rank)
        ag = state.stats()["all_gather"]
        out.append({"sent": ag["bytes_sent"], "unc": ag["bytes_uncompressed"],
                    "rs": state.stats()["reduce_scatter"]["bytes_sent"]})
        state.close()
    return out


def test_all_gather_bytes_follow_the_wire_layout():
    """The quantized all-gather's prediction is its wire layout: one segment per parameter's padded
    shard, each encoded on its own, sent to the W - 1 others; FSDP's own without bits."""
    from fastml_strategy import codecs
    from fastml_strategy.autotune.costmodel import all_gather_unit_bytes
    from fastml_strategy.wire import all_gather_config

    prof = net_profile(Net())
    for _, ls in fsdp_units(prof):
        padded = [shard_chunks(lp.shape, 4)[1] for lp in ls]
        assert all_gather_unit_bytes(ls, 4, "bf16") == 3 * sum(padded) * 2
        for bits in (8, 3):
            cfg = all_gather_config(bits)
            assert all_gather_unit_bytes(ls, 4, "fp32", bits) == 3 * sum(codecs.chunk_nbytes(p, cfg) for p in padded)
            assert all_gather_unit_bytes(ls, 4, "fp32", bits) < 3 * sum(padded) * 4 * bits / 16
    assert all_gather_unit_bytes(ls, 1, "fp32", 8) == 0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_quantized_all_gather_bytes_match_a_real_two_rank_run():
    """Predicted against sent, exactly, for the quantized parameter all-gather: sharded_step_time's
    all-gather bytes (every unit once in forward, the resharded ones again in backward) with
    Sharding(all_gather_bits=...) are what FSDPState counts per step, and without bits they are what
    FSDP's own all-gather of the same shards would send."""
    prof = net_profile(Net())
    cases = [(CHOICES[0][0], 8, False), (MIXED, 4, True)]
    configs = [(_plan_from_choice(prof, c, "t")[1], bits, bf16) for c, bits, bf16 in cases]
    results = run_workers(_all_gather_worker, 2, configs, timeout=100)
    o = option(nodes=2)
    for i, (choice, bits, bf16) in enumerate(cases):
        dt = "bf16" if bf16 else "fp32"
        quant = sharded_step_time(prof, choice, o, Sharding(kind="fsdp", param_dtype=dt, all_gather_bits=bits))
        own = sharded_step_time(prof, choice, o, Sharding(kind="fsdp", param_dtype=dt))
        for rank in range(2):
            got = results[rank][i]
            assert got["sent"] == 2 * quant.allgather_bytes, (bits, bf16, rank, got, quant.allgather_bytes)
            assert got["unc"] == 2 * own.allgather_bytes, (bits, bf16, rank)
            rs = sum(reduce_scatter_unit_bytes(ls, choice, 2, dt, rank=rank) for _, ls in fsdp_units(prof))
            assert got["rs"] == 2 * rs  # the all-gather changes nothing else
        assert quant.allgather_bytes < own.allgather_bytes


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_hsdp_bytes_and_residuals_match_a_real_four_rank_run():
    """HSDP on 2 replicas x 2 shards: residuals exactly; the cross-replica all-reduce of each
    shard as codecs.wire_bytes counts it (2(R-1)/R of the encoded shard), up to what the model
    leaves out: the collective cuts each tensor into R chunks on whole codec units (a quantization
    block, 16 elements otherwise) and its all_gather sends the largest chunk, so a rank sends at most
    one unit per tensor and destination more, or less."""
    from fastml_strategy.codecs import chunk_nbytes, chunk_unit

    prof = net_profile(Net())
    chosen = CHOICES[:2]
    configs = [(_plan_from_choice(prof, c, "t")[1], bf16) for c, bf16 in chosen]
    results = run_workers(_fsdp_worker, 4, configs, 2, timeout=140)
    units = fsdp_units(prof)
    R = 2
    for i, (choice, _) in enumerate(chosen):
        slack = 0
        for _, ls in units:
            cfgs = [CANDIDATES[choice.get(lp.name, "none")] if lp.tunable else CANDIDATES["none"]
                    for lp in ls]
            lossy = [c for c in cfgs if c.lossy]
            slack += sum((R - 1) * chunk_nbytes(chunk_unit(c), c) for c in lossy)
            slack += (R - 1) * chunk_nbytes(16, CANDIDATES["none"])  # the batched fp32 group
        for rank in range(4):
            got = results[rank][i]
            shard_rank = rank % 2  # mesh (replicate, shard): rank = r * 2 + s
            want = sum(allreduce_unit_bytes(ls, choice, 2, R, shard_rank=shard_rank) for _, ls in units)
            assert abs(got["ar"] / 2 - want) <= slack, (choice, rank, got["ar"] / 2, want, slack)
            assert slack < 0.15 * want  # tight enough to mean something, even on this small model
        assert max(results[r][i]["residual"] for r in range(4)) == residual_bytes(prof, choice, HSDP, 2, 2)
