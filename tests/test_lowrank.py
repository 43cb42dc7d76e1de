"""The low-rank codec (PowerSGD, fastml_strategy.comm._lowrank): its settings, its fallback, Gram-Schmidt, the
exactness of the all-reduce on gradients of rank <= r, replicas on 2 and 3 ranks, checkpoints, NaN/inf
and faults, the bytes the cost model predicts, and torch's own PowerSGD hook on the same model."""

from __future__ import annotations

import pytest
import torch

from _dist import run_workers
from fastml_strategy import Codec, CodecConfig, Plan, RECIPES
from fastml_strategy import codecs
from fastml_strategy.comm._lowrank import matrix_shape, orthogonalise_

pytestmark = pytest.mark.timeout(240)


# -- settings, fallback, orthogonalisation (one process) ----------------------------------------------------
def test_plan_json_and_old_plans():
    plan = Plan.from_dict({"format_version": 1, "default": {"codec": "lowrank", "rank": 4, "factors": "int8"}})
    assert plan.default.codec is Codec.LOWRANK and plan.default.rank == 4 and plan.default.factors == "int8"
    assert plan.default.describe() == "lowrank4-int8" and RECIPES["lowrank2"].describe() == "lowrank2"
    assert Plan.from_dict(plan.to_dict()) == plan
    # every other codec's JSON (and so its digest) is what it was: no low-rank fields in it
    for name in ("none", "int4", "topk1", "fp16"):
        assert "rank" not in RECIPES[name].to_dict() and "factors" not in RECIPES[name].to_dict()
    assert Plan.from_recipe("int4").digest() == Plan.from_dict(Plan.from_recipe("int4").to_dict()).digest()
    for bad, field in ((0, "rank"), ("4", "rank"), (True, "rank")):
        with pytest.raises(ValueError, match=f"{field}.*whole number >= 1"):
            CodecConfig(codec="lowrank", rank=bad)
    with pytest.raises(ValueError, match="factors.*'fp32', 'fp16', 'bf16', 'int8'"):
        CodecConfig(codec="lowrank", factors="int4")
    # the warm-up (start): 2 steps by default, written only when not the default (a plan file of a
    # release before it saves to the same text), 0 compresses from the first step
    assert plan.default.start == 2 and "start" not in plan.default.to_dict()
    zero = Plan.from_dict({"format_version": 1, "default": {"codec": "lowrank", "rank": 2, "start": 0}})
    assert zero.default.start == 0 and zero.default.to_dict()["start"] == 0 and zero.default.describe() == "lowrank2-start0"
    assert Plan.from_dict(zero.to_dict()) == zero and zero.digest() != Plan.from_recipe("lowrank2").digest()
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="start.*whole number >= 0"):
            CodecConfig(codec="lowrank", start=bad)
    with pytest.raises(ValueError, match="unknown field.*start"):  # the other codecs have no warm-up
        Plan.from_dict({"format_version": 1, "default": {"codec": "quantize", "bits": 4, "start": 2}})


def test_fallback_is_the_codec_classes():
    """1-D tensors, matrices where (m + n) r >= m n, and tensors of unknown shape travel as fp32."""
    c = codecs.codec_for(RECIPES["lowrank4"])
    assert codecs.effective_config(RECIPES["lowrank4"], 4096, 2, (64, 64)) is RECIPES["lowrank4"]
    for shape in [(4096,), (4, 64), (8, 8), None]:
        assert codecs.effective_config(RECIPES["lowrank4"], 256, 2, shape).codec is Codec.FP32, shape
    assert c.compressible((8, 8)) is False and c.compressible((9, 9)) is True  # 64 >= 64, 72 < 81
    assert matrix_shape((8, 3, 3, 3)) == (8, 27)
    # the bytes of one layer: (m + n) r fp32 numbers, each in a ring all-reduce (2 (W-1)/W)
    assert codecs.wire_bytes(64 * 32, RECIPES["lowrank4"], 2, (64, 32)) == 96 * 4 * 4
    assert codecs.wire_bytes(64 * 32, RECIPES["lowrank4"], 2) == 64 * 32 * 4  # no shape: fp32


def test_orthogonalise_is_orthonormal_and_keeps_zero_columns():
    p = torch.randn(50, 4, generator=torch.Generator().manual_seed(0))
    orthogonalise_(p)
    torch.testing.assert_close(p.t() @ p, torch.eye(4), atol=1e-5, rtol=0)
    z = torch.zeros(20, 3)
    assert torch.equal(orthogonalise_(z), torch.zeros(20, 3))
    a = torch.randn(30, 2, generator=torch.Generator().manual_seed(1))
    assert torch.equal(orthogonalise_(a.clone()), orthogonalise_(a.clone()))  # deterministic


def test_roundtrip_measures_a_matrix_and_is_exact_at_its_rank():
    g = torch.Generator().manual_seed(2)
    low = torch.randn(40, 3, generator=g) @ torch.randn(3, 30, generator=g)  # rank 3
    y, nbytes = codecs.roundtrip(low, RECIPES["lowrank4"])
    assert nbytes == (40 + 30) * 4 * 4
    torch.testing.assert_close(y, low, atol=1e-4 * float(low.abs().max()), rtol=0)
    full = torch.randn(40, 30, generator=g)
    y, _ = codecs.roundtrip(full, RECIPES["lowrank1"])
    err = float((y - full).norm() / full.norm())
    assert 0.5 < err < 1.0  # rank 1 of a random matrix: most of it is dropped, but not more than all


# -- the all-reduce on 2 and 3 ranks ------------------------------------------------------------------------------
_SHAPES = {"a.weight": (48, 40), "a.bias": (48,), "c.weight": (30, 20, 2)}


def _low_rank_grads(step: int, rank: int, world_size: int, r: int) -> dict:
    """Every rank's gradient of each matrix is a fixed matrix of rank ``r`` in one column space shared
    by the ranks (so the mean has rank <= r), scaled by the step; the bias is random. (A column space
    that changes every step is not a test of fp32 tolerance: error feedback keeps feeding back each
    step's roundoff outside the new space, and it grows geometrically, in fp64 too.)"""
    out = {}
    for name, shape in _SHAPES.items():
        m, n = matrix_shape(shape)
        if len(shape) == 1:
            out[name] = torch.randn(shape, generator=torch.Generator().manual_seed(10 * step + rank))
            continue
        A = torch.randn(m, r, generator=torch.Generator().manual_seed(len(name) * 31 + m))
        B = torch.randn(n, r, generator=torch.Generator().manual_seed(97 * rank + n))
        out[name] = (A @ B.t()).reshape(shape) * (1 + 0.1 * step)
    return out


def _exact(rank, world_size, cfg, steps):
    import torch.distributed as dist

    from fastml_strategy.comm.collective import CompressedAllReduce

    plan = Plan(default=cfg, min_numel=0)
    eng = CompressedAllReduce(plan, dist.group.WORLD, rank, world_size)
    eng.shapes = dict(_SHAPES)
    names = list(_SHAPES)
    numels = [int(torch.Size(s).numel()) for s in _SHAPES.values()]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    lay = eng.layout_for(names, offsets, numels, torch.device("cpu"))
    errs, results = [], []
    for step in range(steps):
        per = [_low_rank_grads(step, j, world_size, cfg.rank) for j in range(world_size)]
        buf = torch.cat([per[rank][n].reshape(-1) for n in names])
        mean = sum(torch.cat([p[n].reshape(-1) for n in names]) for p in per) / world_size
        assert eng.run(lay, buf, step)
        errs.append(float((buf - mean).abs().max() / mean.abs().max()))
        results.append(buf)
    from fastml_strategy.comm._layouts import bucket_wire

    wire = bucket_wire(tuple(numels), tuple(plan.for_parameter(n, k) for n, k in zip(names, numels)), world_size,
                       shapes=tuple(_SHAPES.values()))
    sent = eng.bytes_sent
    per_step = [wire.bytes_sent(rank, step) for step in range(steps)]  # the cost model's, step by step
    assert sent == sum(per_step), (sent, per_step)
    return {"errs": errs, "result": torch.cat(results), "sent": sent, "codec": lay.configs["a.weight"].describe(),
            "rounds": len(lay.lowrank), "per_step": per_step, "steady": wire.bytes_sent(rank)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_rank_r_gradients_all_reduce_exactly_and_replicas_agree(world_size):
    """On gradients whose mean has rank <= r, every step after the warm-up is the exact mean within
    fp32 rounding (the power step finds the column space at once, the warm start keeps it); the two
    warm-up steps are the mean in int8 (within its rounding, and more bytes than the factors);
    every rank holds the same bits, and all low-rank layers of the bucket share one P and one Q round."""
    out = run_workers(_exact, world_size, RECIPES["lowrank2"], 6, timeout=120)
    for r in out:
        assert r["codec"] == "lowrank2" and r["rounds"] == 1
        assert 1e-5 < max(r["errs"][:2]) < 1e-2, r["errs"]  # int8: within a few 1/255 of the range
        assert max(r["errs"][2:]) < 1e-5, r["errs"]
        assert r["per_step"][0] == r["per_step"][1] > r["per_step"][2] == r["steady"], r["per_step"]
        assert torch.equal(r["result"], out[0]["result"])


def test_start_0_compresses_from_the_first_step():
    """``start=0``: the approximation from the first step (exact at once on these gradients, the
    steady bytes every step)."""
    out = run_workers(_exact, 2, CodecConfig(codec="lowrank", rank=2, start=0), 3, timeout=120)
    for r in out:
        assert r["codec"] == "lowrank2-start0"
        assert max(r["errs"]) < 1e-5, r["errs"]
        assert r["per_step"] == [r["steady"]] * 3


def _same_grads_as_simulation(rank, world_size, steps):
    """Both ranks all-reduce the same full-rank gradients (their mean is each rank's own), and one
    process runs the autotuner's SimulatedCompression on them: per step, the largest difference."""
    import torch.distributed as dist

    from fastml_strategy.autotune.profile import SimulatedCompression
    from fastml_strategy.comm.collective import CompressedAllReduce

    cfg = RECIPES["lowrank2"]
    eng = CompressedAllReduce(Plan(default=cfg, min_numel=0), dist.group.WORLD, rank, world_size)
    eng.shapes = dict(_SHAPES)
    names = list(_SHAPES)
    numels = [int(torch.Size(s).numel()) for s in _SHAPES.values()]
    lay = eng.layout_for(names, [sum(numels[:i]) for i in range(len(numels))], numels, torch.device("cpu"))
    model = torch.nn.Module()
    for name, shape in _SHAPES.items():
        mod, attr = name.split(".")
        if not hasattr(model, mod):
            model.add_module(mod, torch.nn.Module())
        setattr(getattr(model, mod), attr, torch.nn.Parameter(torch.zeros(shape)))
    params = dict(model.named_parameters())
    sim = SimulatedCompression(model, {n: cfg for n in names})
    diffs = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        grads = {n: torch.randn(s, generator=g) for n, s in _SHAPES.items()}
        buf = torch.cat([grads[n].reshape(-1) for n in names])  # each rank the same: the mean is each one
        assert eng.run(lay, buf, step)
        for n in names:
            params[n].grad = grads[n].clone()
        sim.apply()
        diffs.append(float((buf - torch.cat([params[n].grad.reshape(-1) for n in names])).abs().max()))
    return diffs


def test_the_calibration_simulates_the_runtime():
    """The autotuner's calibration trains a low-rank layer as the runtime runs it: two int8 warm-up
    steps (each within int8's rounding of the gradient), then one warm-started power step per step
    with error feedback, the same values as the all-reduce gives when every rank has the same gradient."""
    for diffs in run_workers(_same_grads_as_simulation, 2, 5, timeout=120):
        assert max(diffs[:2]) < 0.05, diffs  # int8 of N(0, 1) numbers: a few 1/255 of the block's range
        assert max(diffs[2:]) < 1e-4, diffs


def test_int8_factors_keep_replicas_identical():
    out = run_workers(_exact, 3, CodecConfig(codec="lowrank", rank=2, factors="int8"), 4, timeout=120)
    for r in out:
        assert torch.equal(r["result"], out[0]["result"])
        assert max(r["errs"]) < 0.05, r["errs"]  # int8 factors: a few 1/255 of the range, error-fed




# -- in the DDP hook -----------------------------------------------------------------------------------------------
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 48), torch.nn.ReLU(),
                               torch.nn.Linear(48, 16))


def _batches(rank, steps):
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(8, 32, generator=g) for _ in range(steps)]


def _train(model, state_fn, batches, nan_at=None, rank=0):
    """SGD steps on ``batches`` (a step whose gradients are not finite is skipped, as GradScaler
    does); returns the DDP model and the hook's state."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = DDP(model, bucket_cap_mb=0.01)  # several buckets
    state = state_fn(ddp)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, x in enumerate(batches):
        if nan_at == i and rank == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        ddp(x).square().mean().backward()
        if all(torch.isfinite(p.grad).all() for p in model.parameters()):
            opt.step()
        opt.zero_grad()
    return ddp, state


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _ddp_checks(rank, world_size):
    import fastml_strategy as fm

    plan = Plan.from_recipe("lowrank2", min_numel=0)
    hook = lambda ddp: fm.register_hook(ddp, plan=plan)  # noqa: E731
    out = {}
    # 5 steps in one go, against 3 steps, a checkpoint, a new model and hook, 2 steps
    m = _mlp()
    _, st = _train(m, hook, _batches(rank, 5))
    out["whole"] = _flat(m)
    st.close()
    m = _mlp()
    b = _batches(rank, 5)
    _, st = _train(m, hook, b[:3])
    sd, params = st.state_dict(), [p.detach().clone() for p in m.parameters()]
    out["q_names"] = sorted(sd["lowrank_q"])
    st.close()
    m2 = _mlp()
    with torch.no_grad():
        for p, v in zip(m2.parameters(), params):
            p.copy_(v)

    def resumed(ddp):
        s = fm.register_hook(ddp, plan=plan)
        s.load_state_dict(sd)
        return s

    _, st = _train(m2, resumed, b[3:])
    out["resumed"] = _flat(m2)
    st.close()
    # a NaN on one rank at step 3 (after the warm-up and one compressed step): every rank skips it,
    # residuals and warm starts stay as they were
    m = _mlp()
    b = _batches(rank, 4)
    ddp, st = _train(m, hook, b[:3])
    before = st.state_dict()
    out["q_before_nan"] = sorted(before["lowrank_q"])
    ddp2_state = st
    opt_free = [x for x in b[3:4]]
    x = opt_free[0].clone()
    if rank == 1:
        x[0, 0] = float("nan")
    ddp(x).square().mean().backward()
    after = st.state_dict()
    out["nan_grad_finite"] = all(bool(torch.isfinite(p.grad).all()) for p in m.parameters())
    out["nan_kept"] = (all(torch.equal(before["residuals"][k], after["residuals"][k]) for k in before["residuals"])
                       and all(torch.equal(before["lowrank_q"][k], after["lowrank_q"][k]) for k in before["lowrank_q"]))
    out["nonfinite_steps"] = st.stats()["nonfinite_steps"]
    stats = ddp2_state.stats()
    out["codecs"] = {n: r["codec"] for n, r in stats["layers"].items()}
    st.close()
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_replicas_checkpoint_and_nan(world_size):
    """In the DDP hook (several buckets, DDP's rebuild after step 1): replicas bit-identical; a run
    resumed from state_dict() (Q and the residuals) is bit for bit the uninterrupted one; a NaN on one
    rank reaches every rank's gradients and leaves every residual and warm start untouched."""
    out = run_workers(_ddp_checks, world_size, timeout=200)
    for r in out:
        assert torch.equal(r["whole"], out[0]["whole"]) and torch.equal(r["resumed"], out[0]["resumed"])
        if world_size == 2:  # (3 ranks: gloo's ring sums a P element in an order set by the bucket's size)
            assert torch.equal(r["resumed"], r["whole"])
        else:
            torch.testing.assert_close(r["resumed"], r["whole"], rtol=1e-5, atol=1e-6)
        assert r["q_names"] == r["q_before_nan"] == ["0.weight", "2.weight", "4.weight"]
        assert not r["nan_grad_finite"] and r["nan_kept"] and r["nonfinite_steps"] == 1
        assert r["codecs"] == {"0.weight": "lowrank2", "2.weight": "lowrank2", "4.weight": "lowrank2",
                               "0.bias": "fp32", "2.bias": "fp32", "4.bias": "fp32"}


def _fault(rank, world_size):
    import fastml_strategy as fm
    from fastml_strategy.comm import _lowrank

    real = _lowrank.orthogonalise_
    calls = [0]

    def failing(p):
        calls[0] += 1
        if rank == 1 and calls[0] > 6:
            raise RuntimeError("injected fault")
        return real(p)

    _lowrank.orthogonalise_ = failing
    try:
        m = _mlp()
        try:
            _, st = _train(m, lambda ddp: fm.register_hook(ddp, plan=Plan.from_recipe("lowrank2", min_numel=0)),
                           _batches(rank, 4))
            return "no error"
        except Exception as e:  # noqa: BLE001
            return f"{type(e).__name__}: {e}"
    finally:
        _lowrank.orthogonalise_ = real


def test_a_fault_on_one_rank_raises_on_every_rank():
    msgs = run_workers(_fault, 2, timeout=120)
    for m in msgs:
        assert m.startswith("CompressionError") and "rank 1" in m and "injected fault" in m, m


def _localsgd_refused(rank, world_size):
    import fastml_strategy as fm

    try:
        fm.LocalSGD(_mlp(), torch.optim.SGD(_mlp().parameters(), lr=0.1), plan="lowrank4", every=4)
        return "no error"
    except ValueError as e:
        return str(e)


def test_localsgd_refuses_lowrank_on_every_rank():
    msgs = run_workers(_localsgd_refused, 2, timeout=60)
    assert msgs[0] == msgs[1] and "low-rank codec" in msgs[0] and "register_hook" in msgs[0], msgs


# -- against torch's PowerSGD hook ----------------------------------------------------------------------------------
def _torch_q_init(order, shapes, r):
    """The Q torch's hook draws at its first compressed step (PowerSGDState(random_seed=0)): one
    generator seed from its numpy RandomState, then standard normals per group of same-shape matrices
    (first appearance order), one (cols x r) block per matrix."""
    import numpy as np

    seed = np.random.RandomState(0).randint(1_000_000_000)
    groups: dict = {}
    for name in order:
        if name in shapes:
            groups.setdefault(shapes[name], []).append(name)
    out = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for shape, names in groups.items():
            q = torch.randn(len(names), shape[1], r)
            for k, name in enumerate(names):
                out[name] = q[k].reshape(-1).clone()
    return out


def _vs_torch(rank, world_size, r, steps):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastml_strategy as fm

    batches = _batches(rank, steps)
    model = _mlp()
    names = {id(p): n for n, p in model.named_parameters()}
    ddp = DDP(model)  # one bucket
    seen: list = []
    state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2,
                             use_error_feedback=True, warm_start=True, random_seed=0)

    def hook(st, bucket):
        seen.append([names[id(p)] for p in bucket.parameters()])
        return ps.powerSGD_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    sent = [0.0]
    real = dist.all_reduce

    def counting(t, *a, **k):  # torch's hook all-reduces through torch.distributed.all_reduce
        sent[0] += 2.0 * (world_size - 1) / world_size * t.numel() * t.element_size()
        return real(t, *a, **k)

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch_bytes, start = [], None
    dist.all_reduce = counting
    try:
        for i, x in enumerate(batches):
            if i == 2:
                start = [p.detach().clone() for p in model.parameters()]
            before = sent[0]
            ddp(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
            torch_bytes.append(sent[0] - before)
    finally:
        dist.all_reduce = real
    torch_end = _flat(model)
    # FastML from the parameters torch compressed from, with the Q torch drew
    shapes = {n: (p.shape[0], p[0].numel()) for n, p in model.named_parameters() if p.dim() > 1}
    m2 = _mlp()
    with torch.no_grad():
        for p, v in zip(m2.parameters(), start):
            p.copy_(v)
    ddp2 = DDP(m2)
    # (start=0: torch's hook has had its two uncompressed steps; FastML's compresses from its first)
    st = fm.register_hook(ddp2, plan=Plan(default=CodecConfig(codec="lowrank", rank=r, start=0), min_numel=0))
    st._engine.lowrank_q.update(_torch_q_init(seen[2], shapes, r))
    opt = torch.optim.SGD(m2.parameters(), lr=0.1)
    fm_bytes = []
    for x in batches[2:]:
        before = st.stats()["bytes_sent"]
        ddp2(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        fm_bytes.append(st.stats()["bytes_sent"] - before)
    st.close()
    start_flat = torch.cat([v.reshape(-1) for v in start])
    return {"torch_bytes": torch_bytes[2:], "fm_bytes": fm_bytes, "torch_delta": torch_end - start_flat,
            "fm_delta": _flat(m2) - start_flat}


@pytest.mark.parametrize("r", [2, 4])
def test_same_bytes_and_close_updates_as_torch_powersgd(r):
    """On the same model and batches (one bucket, 2 gloo ranks), from the step where torch's hook starts
    compressing, with the Q torch drew: FastML sends torch's bytes per step exactly, plus the 64-byte
    headers of its one all_to_all and all_gather (which carry faults), and the cost model predicts
    FastML's bytes exactly; the updates agree to fp32 roundoff (Gram-Schmidt here, torch's
    Gram-Schmidt at rank 2 and Householder QR at rank 4: the same basis up to signs)."""
    from fastml_strategy.comm._layouts import bucket_wire

    out = run_workers(_vs_torch, 2, r, 6, timeout=200)
    model = _mlp()
    names = [n for n, _ in model.named_parameters()][::-1]
    params = dict(model.named_parameters())
    wire = bucket_wire(tuple(params[n].numel() for n in names), tuple(RECIPES[f"lowrank{r}"] if params[n].dim() > 1
                       else RECIPES["none"] for n in names), 2, shapes=tuple(tuple(params[n].shape) for n in names))
    factors = ((64 + 48 + 16) + (32 + 64 + 48)) * r * 4
    for rank, o in enumerate(out):
        assert o["torch_bytes"] == [128 * 4 + factors] * 4, o["torch_bytes"]  # biases, then P and Q
        assert o["fm_bytes"] == [b + 2 * 64 for b in o["torch_bytes"]], (o["fm_bytes"], o["torch_bytes"])
        assert o["fm_bytes"] == [wire.bytes_sent(rank)] * 4
        rel = float((o["fm_delta"] - o["torch_delta"]).norm() / o["torch_delta"].norm())
        assert rel < 1e-4, rel
    assert torch.equal(out[0]["fm_delta"], out[1]["fm_delta"])


def _hier_refused(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import fastml_strategy as fm

    try:
        fm.register_hook(DDP(_mlp()), plan="lowrank4", ranks_per_node=2)
        return "no error"
    except ValueError as e:
        return str(e)


def test_hierarchical_hook_refuses_lowrank_on_every_rank():
    msgs = run_workers(_hier_refused, 4, timeout=120)
    assert len(set(msgs)) == 1 and "low-rank codec" in msgs[0] and "ranks_per_node=1" in msgs[0], msgs
