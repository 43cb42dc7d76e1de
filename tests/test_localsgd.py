"""LocalSGD (DiLoCo-style local steps with compressed outer synchronisation) in real gloo runs."""

from __future__ import annotations

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers

pytestmark = pytest.mark.timeout(200)


def _mlp(seed: int = 0, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 4))


def _batch(rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)


def _flat(model) -> list:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()


def _averaging_equals_ddp(rank, world_size):
    import fastml_strategy as fm

    ddp_model = _mlp()
    ddp = DDP(ddp_model)
    local_model = _mlp(seed=0 if rank == 0 else rank + 5)  # LocalSGD starts every rank from rank 0
    opt_d = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    opt_l = torch.optim.SGD(local_model.parameters(), lr=0.1, momentum=0.9)
    local = fm.LocalSGD(local_model, opt_l, every=1, outer="sgd", outer_lr=1.0, outer_momentum=0.0, plan="none")
    for step in range(10):
        for model, opt in ((ddp, opt_d), (local_model, opt_l)):
            x, y = _batch(rank, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        local.step()
    s = local.stats()
    local.close()
    return _flat(ddp_model), _flat(local_model), s["inner_steps"], s["outer_steps"]


def test_every_step_averaging_equals_ddp():
    """every=1, outer SGD with lr 1 and no momentum, plan none: plain parameter averaging, which with a
    (linear) SGD inner optimizer is DDP."""
    for ddp, local, inner, outer in run_workers(_averaging_equals_ddp, 2, timeout=90):
        assert max(abs(a - b) for a, b in zip(ddp, local)) < 1e-6
        assert inner == outer == 10


def _replicas(rank, world_size, fragments, delay, plan, steps):
    import fastml_strategy as fm

    model = _mlp(seed=rank)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    local = fm.LocalSGD(model, inner, every=6, plan=fm.Plan.from_recipe(plan, min_numel=0),
                        fragments=fragments, delay=delay)
    snaps = []
    apply = local._apply

    def record(frag, mean, finite):  # right after a fragment's outer update: its parameters, by value
        apply(frag, mean, finite)
        snaps.append((local.inner_steps, frag.index,
                      torch.cat([p.detach().reshape(-1) for p in frag.params]).tolist()))

    local._apply = record
    for step in range(steps):
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        local.step()
    local.synchronize()
    shared = torch.cat([a.detach().reshape(-1) for a in local._anchor.values()]).tolist()
    s = local.stats()
    local.close()
    return snaps, shared, s


@pytest.mark.parametrize("world_size,fragments,delay", [(2, 1, 0), (3, 1, 0), (4, 1, 0), (2, 3, 1), (3, 2, 2)])
def test_replicas_identical_after_every_sync(world_size, fragments, delay):
    res = run_workers(_replicas, world_size, fragments, delay, "int4", 19, timeout=150)
    assert len(res[0][0]) == res[0][2]["outer_steps"]
    assert all(r[0] == res[0][0] for r in res)  # every fragment, right after every sync
    assert all(r[1] == res[0][1] for r in res)  # the shared parameters
    s = res[0][2]
    assert s["inner_steps"] == 19
    # whole model: syncs at 6, 12, 18; fragment f of F at f*6//F + 6k
    assert s["outer_steps"] == sum(len([t for t in range(1, 20) if t >= f * 6 // fragments and
                                        (t - f * 6 // fragments) % 6 == 0]) for f in range(fragments))
    assert s["compression_ratio"] > 3 and s["ratio_vs_ddp"] > 6 * 3


def _digits(rank, world_size, every, steps):
    import fastml_strategy as fm
    from fastml_strategy._digits import accuracy, batches, digits_mlp, load_digits_split

    xtr, ytr, xte, yte = load_digits_split()
    out = {}
    outers = {"local": dict(outer="sgd", outer_lr=1.0, outer_momentum=0.0),  # averaging
              "diloco": {}}  # DiLoCo's Nesterov, lr 0.7, momentum 0.9 (the defaults)
    for mode in ("ddp", "local", "diloco"):
        model = digits_mlp(hidden=128)
        if mode == "ddp":
            net = DDP(model)
            inner = torch.optim.Adam(net.parameters(), lr=1e-3)
            local = None
        else:
            net = model
            inner = torch.optim.Adam(model.parameters(), lr=1e-3)
            local = fm.LocalSGD(model, inner, every=every, plan="int4", **outers[mode])
        data = batches(xtr, ytr, 32, rank, world_size)
        for _ in range(steps):
            x, y = next(data)
            torch.nn.functional.cross_entropy(net(x), y).backward()
            inner.step()
            inner.zero_grad()
            if local is not None:
                local.step()
        if local is not None:
            local.synchronize()
            out[f"{mode}_bytes"] = local.stats()["ratio_vs_ddp"]
            local.close()
        out[mode] = accuracy(model, xte, yte)
    return out


def test_digits_local_steps_match_ddp_accuracy():
    """H=20 with int4 outer compression: within 1 point of DDP's accuracy after the same 300 inner
    steps with an averaging outer step; DiLoCo's Nesterov defaults train too (2 ranks is a small
    setting for their momentum: docs/localsgd.md has the measurement)."""
    res = run_workers(_digits, 2, 20, 300, timeout=180)
    assert res[0]["local"] == res[1]["local"]  # one model after the last sync
    assert res[0]["local"] >= res[0]["ddp"] - 0.01, res[0]
    assert res[0]["diloco"] > 0.9, res[0]
    assert res[0]["local_bytes"] > 100  # at least 100x fewer bytes than DDP's fp32 all-reduce every step


def _resume(rank, world_size, path, mode):
    import fastml_strategy as fm

    model = _mlp(seed=3)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    local = fm.LocalSGD(model, inner, every=4, plan="int4", fragments=2, delay=1)
    start = 0
    if mode == "resume":
        ck = torch.load(f"{path}.{rank}", weights_only=False)
        model.load_state_dict(ck["model"])
        inner.load_state_dict(ck["inner"])
        local.load_state_dict(ck["local"])
        start = 6
    for step in range(start, 15):
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        local.step()
        if mode == "full" and step + 1 == 6:  # fragment 1 synced at step 6 waits 1 step: pending
            assert any(f.pending is not None for f in local._fragments)
            torch.save({"model": model.state_dict(), "inner": inner.state_dict(), "local": local.state_dict()},
                       f"{path}.{rank}")
    local.synchronize()
    out = _flat(model), local.stats()["outer_steps"]
    local.close()
    return out


def test_resume_is_bit_exact(tmp_path):
    path = str(tmp_path / "ck")
    full = run_workers(_resume, 2, path, "full", timeout=90)
    resumed = run_workers(_resume, 2, path, "resume", timeout=90)
    assert [r[0] for r in full] == [r[0] for r in resumed]
    assert full[0][1] == resumed[0][1]


def _dies(rank, world_size):
    import fastml_strategy as fm
    import fastml_strategy.codecs as codecs

    model = _mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    local = fm.LocalSGD(model, inner, every=2, plan="int4")
    for step in range(8):
        if step == 5 and rank == 1:
            codecs.encode_chunk = lambda *a, **k: os._exit(3)  # dies inside the synchronisation
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        try:
            local.step()
        except fm.CompressionError as e:
            return {"step": step, "msg": str(e), "cause": repr(e.__cause__) if e.__cause__ else None}
    return {"step": None}


def test_rank_death_during_a_sync_raises_compression_error():
    res = run_workers(_dies, 2, timeout=90, pg_timeout=20, allow_deaths=True)
    assert res[1] == ("died", 3)
    status, value = res[0]
    assert status == "ok" and value["step"] == 5, res
    assert "LocalSGD" in value["msg"] and "restart from the last checkpoint" in value["msg"]
    assert value["cause"] is not None  # gloo's error, kept as the __cause__


def _bad(rank, world_size):
    import fastml_strategy as fm

    out = {}
    cases = {
        "every": dict(every=0),
        "fragments": dict(fragments=7),  # the MLP has 6 parameters
        "plan": dict(plan=fm.Plan.from_recipe("int4").with_layers({"nope.weight": fm.RECIPES["int8"]})),
        "outer": dict(outer="adam"),
        "delay": dict(every=4, fragments=2, delay=2),
        "plan_on_rank1": dict(plan="int4" if rank == 0 else "int9"),
        "ddp": None,
    }
    for key, kw in cases.items():
        try:
            if kw is None:
                fm.LocalSGD(DDP(_mlp()), None)
            else:
                fm.LocalSGD(_mlp(), None, **kw).close()
            out[key] = None
        except (ValueError, TypeError) as e:
            out[key] = (type(e).__name__, str(e))
    return out


def test_bad_arguments_fail_on_every_rank():
    res = run_workers(_bad, 2, timeout=90)
    for r in res:
        assert r["every"][0] == "ValueError" and "every=0" in r["every"][1]
        assert "fragments=7" in r["fragments"][1] and "6 trainable parameters" in r["fragments"][1]
        assert "nope.weight" in r["plan"][1]
        assert "outer='adam'" in r["outer"][1]
        assert "delay=2" in r["delay"][1]
        assert "rank(s) [1]" in r["plan_on_rank1"][1]
        assert r["ddp"][0] == "TypeError" and "model.module" in r["ddp"][1]
    assert res[0]["plan_on_rank1"] == res[1]["plan_on_rank1"]


def _nan_on_rank0(rank, world_size, optimizer, fragments):
    """Rank 0 writes a NaN into its last parameter after inner step 4 (as a bad batch or an overflow
    would); LocalSGD must make it whole again at the next synchronisation that sees it."""
    import fastml_strategy as fm

    model = _mlp(seed=1, width=16)
    inner = (torch.optim.SGD(model.parameters(), lr=0.1) if optimizer == "sgd"
             else torch.optim.Adam(model.parameters(), lr=1e-2))
    local = fm.LocalSGD(model, inner, every=4, fragments=fragments, plan="int4", outer="sgd", outer_lr=1.0,
                        outer_momentum=0.0)
    finite_after = []
    for step in range(20):
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        local.step()
        if rank == 0 and step + 1 == 4:
            with torch.no_grad():
                list(model.parameters())[-1].view(-1)[0] = float("nan")
        finite_after.append(all(bool(torch.isfinite(p).all()) for p in model.parameters()))
    state_ok = all(bool(torch.isfinite(v).all()) for st in inner.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.is_floating_point())
    shared = torch.cat([a.detach().reshape(-1) for a in local._anchor.values()]).tolist()
    s = local.stats()
    local.close()
    return finite_after, state_ok, shared, s["nonfinite_syncs"], s["outer_steps"]


@pytest.mark.parametrize("optimizer,fragments", [("sgd", 2), ("adam", 1)])
def test_one_rank_nan_is_recovered_at_the_next_sync(optimizer, fragments):
    """The NaN reaches the synchronisation of a fragment; every rank skips that outer step, and rank
    0 is restored whole (every fragment's parameters from their last synchronisation, the inner
    optimizer's non-finite state dropped): from then on its model and optimizer are finite, the
    replicas' shared parameters are identical and finite, and only that one sync was non-finite."""
    res = run_workers(_nan_on_rank0, 2, optimizer, fragments, timeout=120)
    finite0, state_ok0, shared0, nonfinite0, outer0 = res[0]
    assert not all(finite0) and all(finite0[8:]), finite0  # NaN at step 4, whole again by step 8
    assert state_ok0 and res[1][1]
    assert shared0 == res[1][2] and all(v == v for v in shared0)
    assert nonfinite0 == res[1][3] == 1
    assert outer0 == res[1][4] == (10 if fragments == 2 else 5)


def _settings_and_state(rank, world_size):
    import fastml_strategy as fm

    out = {}
    for key, kw in {"every": dict(every=2 if rank == 0 else 3),
                    "fragments": dict(fragments=1 if rank == 0 else 2),
                    "outer_lr": dict(outer_lr=0.7 if rank == 0 else 0.5)}.items():
        try:
            fm.LocalSGD(_mlp(), None, **kw).close()
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    # every rank's state in one dict, loadable on each rank; another kind of state names itself
    model = _mlp()
    local = fm.LocalSGD(model, torch.optim.SGD(model.parameters(), lr=0.1), every=1, plan="int4")
    x, y = _batch(rank, 0)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    local.step()
    both = local.state_dict(all_ranks=True)
    out["per_rank"] = [s["rank"] for s in both["per_rank"]]
    local.load_state_dict(both)
    try:
        local.load_state_dict({"format_version": 1, "rank": rank, "world_size": world_size, "step": 0})
    except ValueError as e:
        out["ddp_state"] = str(e)
    local.close()
    return out


def test_settings_that_differ_between_ranks_fail_on_every_rank():
    """A valid but different every, fragments or outer setting on one rank is refused on every rank
    alike when LocalSGD is built (it used to hang until the timeout at the first sync, or drift)."""
    res = run_workers(_settings_and_state, 2, timeout=90)
    for key, shown in (("every", "rank 0: 2, rank 1: 3"), ("fragments", "rank 0: 1, rank 1: 2"),
                       ("outer_lr", "rank 0: 0.7, rank 1: 0.5")):
        assert res[0][key] == res[1][key] and f"different {key} ({shown})" in res[0][key], res[0][key]
    for r in res:
        assert r["per_rank"] == [0, 1]
        assert "a DDP FastML state" in r["ddp_state"] and "FastMLState.load_state_dict" in r["ddp_state"]


def _beside_ddp_over_all(rank, model, steps=10):
    """Train the island ``model`` with LocalSGD (plan none, every=1, outer SGD lr 1: the mean of the
    machines' models every step) beside DDP over every rank on the same batches; returns that DDP."""
    import fastml_strategy as fm

    ref = DDP(_mlp())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    local = fm.LocalSGD(model, opts[1], every=1, outer="sgd", outer_lr=1.0, outer_momentum=0.0, plan="none")
    for step in range(steps):
        for m, opt in zip((ref, model), opts):
            x, y = _batch(rank, step)
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
            opt.zero_grad()
        local.step()
    local.close()
    return ref


def _int4_local_steps(rank, model, inner, plan):
    """12 inner steps of the island ``model``, synchronised every 3 in 2 fragments; returns its
    LocalSGD after applying what is pending."""
    import fastml_strategy as fm

    local = fm.LocalSGD(model, inner, every=3, fragments=2, plan=plan)
    for step in range(12):
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        local.step()
    local.synchronize()
    return local


def _fsdp_islands(rank, island):
    """LocalSGD over FSDP2 islands (part of the islands launch): ``none`` with every=1 and outer SGD lr 1
    equals DDP over all 4 ranks; int4 keeps local rank l's shards identical across machines."""
    import torch.distributed as dist

    import fastml_strategy as fm
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(island, "cpu")

    def sharded(seed):
        m = _mlp(seed=seed)
        for layer in m:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(m, mesh=mesh)

    def full(m):
        return torch.cat([p.full_tensor().detach().reshape(-1) for p in m.parameters()])

    out = {}
    world_mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu")
    try:  # FSDP2 over every rank reduce-scatters across machines every step: refused
        fm.LocalSGD(fully_shard(_mlp(), mesh=world_mesh), None, every=2).close()
        out["all"] = None
    except TypeError as e:
        out["all"] = str(e)
    model = sharded(0 if rank < 2 else rank + 9)  # machine 1's shards come from machine 0's
    ref = _beside_ddp_over_all(rank, model)
    out["ddp_diff"] = float((full(model) - torch.cat([p.detach().reshape(-1) for p in ref.parameters()]))
                            .abs().max())
    model = sharded(3)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    plan = fm.Plan.from_recipe("int4", min_numel=0)
    local = _int4_local_steps(rank, model, inner, plan)
    out["shards"] = torch.cat([a.detach().reshape(-1) for a in local._anchor.values()]).tolist()
    synced = set(local._fragments[0].names)  # synchronised at step 12 (fragment 1 at step 10)
    out["full"] = torch.cat([p.full_tensor().detach().reshape(-1) for n, p in model.named_parameters()
                             if n in synced]).tolist()
    s = local.stats()
    out["stats"] = {k: s[k] for k in ("outer_steps", "ranks_per_node", "bytes_sent_inter", "compression_ratio")}
    sd = local.state_dict()
    out["res_numel"] = {n: v.numel() for n, v in sd["residuals"].items()}
    out["shard_numel"] = {n: p.to_local().numel() for n, p in model.named_parameters()}
    again = fm.LocalSGD(model, inner, every=3, fragments=2, plan=plan)
    again.load_state_dict(sd)
    out["reloaded"] = all(torch.equal(again._engine.residuals()[n], v) for n, v in sd["residuals"].items())
    again.close()
    local.close()
    # a setting that differs on one rank (rank 3) is refused on every rank, before any inner step
    for key, value in (("every", 3), ("outer_lr", 0.5)):
        try:
            fm.LocalSGD(sharded(0), None, plan=plan, **{key: value if rank == 3 else fm.LocalSteps().kwargs()[key]})
            out[f"differ_{key}"] = None
        except ValueError as e:
            out[f"differ_{key}"] = str(e)
    out["nonfinite"] = _fsdp_island_nonfinite(rank, sharded(5), plan)
    return out


def _fsdp_island_nonfinite(rank, model, plan):
    """An inf in rank 0's shard at the second of three synchronisations (every 2): as for a DDP island
    or one replica per rank, every rank skips that outer step alike and keeps its residuals, rank 0
    takes the shared values back, and training goes on."""
    import fastml_strategy as fm

    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    local = fm.LocalSGD(model, inner, every=2, plan=plan)
    out = {}
    for step in range(6):
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        if step == 3:
            before = {n: v.clone() for n, v in local._engine.residuals().items()}
            shared_before = [a.detach().clone() for a in local._anchor.values()]
            if rank == 0:
                with torch.no_grad():
                    next(model.parameters()).to_local().view(-1)[0] = float("inf")
        local.step()
        if step == 3:
            after = local._engine.residuals()
            out["residuals_kept"] = bool(before) and all(torch.equal(before[n], after[n]) for n in before)
            out["shared_kept"] = all(torch.equal(a, b) for a, b in zip(shared_before, local._anchor.values()))
            out["finite_after_skip"] = all(bool(torch.isfinite(p.to_local()).all()) for p in model.parameters())
    s = local.stats()
    out.update(nonfinite_syncs=s["nonfinite_syncs"], outer_steps=s["outer_steps"],
               shards=torch.cat([p.to_local().detach().reshape(-1) for p in model.parameters()]).tolist())
    local.close()
    return out


def _islands(rank, world_size):
    """4 ranks as 2 machines x 2: DDP inside each machine, LocalSGD across machines."""
    import fastml_strategy as fm
    from fastml_strategy.localsgd import machine_group

    island = machine_group(ranks_per_node=2)
    out = {}
    # 1. every=1, outer SGD lr 1, no momentum, plan none: DDP over all 4 ranks
    model = DDP(_mlp(seed=0 if rank == 0 else rank + 9), process_group=island)  # LocalSGD: from rank 0
    ref = _beside_ddp_over_all(rank, model)
    out["ddp_diff"] = max(abs(a - b) for a, b in zip(_flat(ref.module), _flat(model.module)))
    # 2. int4 across machines, every 3, 2 fragments: every rank of every machine holds the same shared
    # parameters, and after the last sync the same model; bytes cross machines once per part
    model = DDP(_mlp(seed=3), process_group=island)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    local = _int4_local_steps(rank, model, inner, fm.Plan.from_recipe("int4", min_numel=0))
    out["shared"] = torch.cat([a.detach().reshape(-1) for a in local._anchor.values()]).tolist()
    s = local.stats()
    out["stats"] = {k: s[k] for k in ("outer_steps", "ranks_per_node", "bytes_sent_inter", "bytes_sent_intra",
                                      "compression_ratio", "residual_bytes")}
    out["numel"] = sum(p.numel() for p in model.parameters())
    # the state round trip: this rank's residuals are its parts, and they load back
    sd = local.state_dict()
    out["res_numel"] = {n: v.numel() for n, v in sd["residuals"].items()}
    out["param_numel"] = {n: p.numel() for n, p in model.module.named_parameters()}
    again = fm.LocalSGD(model, inner, every=3, fragments=2, plan=fm.Plan.from_recipe("int4", min_numel=0))
    again.load_state_dict(sd)
    out["reloaded"] = all(torch.equal(again._engine.residuals()[n], v) for n, v in sd["residuals"].items())
    again.close()
    local.close()
    # 3. DDP over every rank, and DDP over ranks of two machines: refused on every rank
    import torch.distributed as dist

    g02, g13 = dist.new_group([0, 2]), dist.new_group([1, 3])  # every rank makes every group
    for key, group in (("all", None), ("across", g02 if rank in (0, 2) else g13)):
        try:
            wrong = DDP(_mlp(), process_group=group) if group is not None else DDP(_mlp())
            fm.LocalSGD(wrong, None, every=2).close()
            out[key] = None
        except (TypeError, ValueError) as e:
            out[key] = (type(e).__name__, str(e))
    # 4. FSDP2 islands: the model sharded over its machine's 2 ranks, LocalSGD across machines
    out["fsdp"] = _fsdp_islands(rank, island)
    # 5. the Accelerate helper builds the islands itself when torchrun says 2 machines x 2
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank % 2),
                      LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    from accelerate import Accelerator

    import fastml_strategy.accelerate as fa

    acc = Accelerator(cpu=True)
    ref, plain = DDP(_mlp()), _mlp()
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, plain)]
    model, opt = fa.prepare_local_sgd(acc, plain, opts[1], plan="none", every=1, outer="sgd", outer_lr=1.0,
                                      outer_momentum=0.0)
    for step in range(5):
        for m, o in ((ref, opts[0]), (model, opt)):
            x, y = _batch(rank, step)
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            o.zero_grad()
        acc.fastml_localsgd.step()
    out["accelerate"] = {"wrapped": type(model).__name__,
                         "island": dist.get_process_group_ranks(model.process_group),
                         "diff": max(abs(a - b) for a, b in zip(_flat(ref.module), _flat(model.module))),
                         "ranks_per_node": acc.fastml_localsgd.stats()["ranks_per_node"]}
    acc.fastml_localsgd.close()
    # 6. Fabric's local-steps strategy on num_nodes=2 x devices=2 builds the islands too
    import lightning.fabric as LF

    from fastml_strategy.lightning import FastMLLocalSGDFabricStrategy

    fabric = LF.Fabric(accelerator="cpu", devices=2, num_nodes=2,
                       strategy=FastMLLocalSGDFabricStrategy(plan="none", every=1, outer="sgd", outer_lr=1.0,
                                                             outer_momentum=0.0))
    fabric.launch()
    ref, plain = DDP(_mlp()), _mlp()
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = fabric.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    for step in range(5):
        for m, o in ((ref, opt_ref), (model, opt)):
            x, y = _batch(rank, step)
            loss = torch.nn.functional.cross_entropy(m(x), y)
            fabric.backward(loss) if m is model else loss.backward()
            o.step()  # Fabric's: LocalSGD counts the inner step
            o.zero_grad()
    inner = fabric.strategy.localsgd.model  # what LocalSGD synchronises: the DDP island
    out["fabric"] = {"wrapped": type(inner).__name__,
                     "island": dist.get_process_group_ranks(inner.process_group),
                     "diff": max(abs(a - b) for a, b in zip(_flat(ref.module), _flat(inner.module))),
                     "ranks_per_node": fabric.strategy.localsgd.stats()["ranks_per_node"]}
    fabric.strategy.teardown()
    # 7. the Trainer's local-steps strategy on num_nodes=2 x devices=2: the same islands
    import lightning.pytorch as pl

    from fastml_strategy.lightning import FastMLLocalSGDStrategy

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()

        def training_step(self, batch, i):
            return torch.nn.functional.cross_entropy(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):  # this rank's batches, in order
            xs, ys = zip(*(_batch(rank, step) for step in range(5)))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys)),
                                               batch_size=8)

    ref = DDP(_mlp())
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(5):
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(ref(x), y).backward()
        opt_ref.step()
        opt_ref.zero_grad()
    seen = {}

    class Look(pl.Callback):  # what LocalSGD synchronises, while it lives (fit's teardown closes it)
        def on_train_end(self, trainer, pl_module):
            inner = trainer.strategy.localsgd.model
            seen.update(wrapped=type(inner).__name__, island=dist.get_process_group_ranks(inner.process_group),
                        ranks_per_node=trainer.strategy.localsgd.stats()["ranks_per_node"])

    lm = Net()
    trainer = pl.Trainer(accelerator="cpu", devices=2, num_nodes=2, max_epochs=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         use_distributed_sampler=False, callbacks=[Look()],
                         strategy=FastMLLocalSGDStrategy(plan="none", every=1, outer="sgd", outer_lr=1.0,
                                                         outer_momentum=0.0))
    trainer.fit(lm)
    out["trainer"] = {**seen, "steps": trainer.global_step,
                      "diff": max(abs(a - b) for a, b in zip(_flat(ref.module), _flat(lm.net)))}
    return out


@pytest.mark.timeout(330)
def test_diloco_islands_ddp_inside_a_machine_local_steps_across():
    """LocalSGD islands on 2 machines x 2 ranks, DDP or FSDP2 inside a machine, built by hand and by the
    Accelerate helper, Fabric and the Trainer (own processes: Accelerate keeps a per-process state)."""
    res = run_workers(_islands, 4, timeout=300, fresh=True)
    for r in res:
        assert r["ddp_diff"] < 1e-6, r["ddp_diff"]
        assert r["shared"] == res[0]["shared"]
        s = r["stats"]
        assert s["ranks_per_node"] == 2 and s["outer_steps"] == 8
        # int4 parts cross machines; the fp32 reduce-scatter and all-gather stay inside
        assert 0 < 3 * s["bytes_sent_inter"] < s["bytes_sent_intra"], s
        assert r["reloaded"]
        assert r["all"][0] == "TypeError" and "machine_group()" in r["all"][1]
        assert r["across"][0] == "ValueError" and "not the ranks of one machine" in r["across"][1]
    for r, out in enumerate(res):
        acc = out["accelerate"]
        assert acc["wrapped"] == "DistributedDataParallel" and acc["island"] == [r // 2 * 2, r // 2 * 2 + 1]
        assert acc["ranks_per_node"] == 2 and acc["diff"] < 1e-6, acc
        fab = out["fabric"]
        assert fab["wrapped"] == "DistributedDataParallel" and fab["island"] == acc["island"], fab
        assert fab["ranks_per_node"] == 2 and fab["diff"] < 1e-6, fab
        tr = out["trainer"]
        assert tr["wrapped"] == "DistributedDataParallel" and tr["island"] == acc["island"], tr
        assert tr["ranks_per_node"] == 2 and tr["steps"] == 5 and tr["diff"] < 1e-6, tr
    assert res[0]["across"] == res[1]["across"]
    # FSDP2 islands: DDP's result for `none`; local rank l's shards equal across machines, so every
    # rank of every machine holds the same full model; error feedback on the shard
    for r, out in enumerate(res):
        f = out["fsdp"]
        assert f["ddp_diff"] < 1e-6, f["ddp_diff"]
        assert f["shards"] == res[r % 2]["fsdp"]["shards"] and f["shards"] != res[1 - r % 2]["fsdp"]["shards"]
        assert f["full"] == res[0]["fsdp"]["full"]
        assert f["stats"]["outer_steps"] == 8 and f["stats"]["ranks_per_node"] == 2, f["stats"]
        assert f["stats"]["bytes_sent_inter"] > 0 and f["stats"]["compression_ratio"] > 4, f["stats"]
        assert f["res_numel"] == f["shard_numel"] and f["reloaded"], f
        assert "sharded with FSDP2 over every rank" in f["all"] and "machine_group()" in f["all"], f["all"]
        # a different setting on one rank: the same error on every rank, naming each rank's value
        assert f["differ_every"] == res[0]["fsdp"]["differ_every"], f
        assert "different every (rank 0: 50, rank 1: 50, rank 2: 50, rank 3: 3)" in f["differ_every"], f
        assert f["differ_outer_lr"] == res[0]["fsdp"]["differ_outer_lr"], f
        assert "different outer_lr (rank 0: 0.7, rank 1: 0.7, rank 2: 0.7, rank 3: 0.5)" in f["differ_outer_lr"]
        # an inf in rank 0's shard: that outer step skipped on every rank, residuals and shared values
        # kept, and after the next synchronisation local rank l's shards agree across machines again
        nf = f["nonfinite"]
        assert nf["nonfinite_syncs"] == 1 and nf["outer_steps"] == 3, nf
        assert nf["residuals_kept"] and nf["shared_kept"] and nf["finite_after_skip"], nf
        assert nf["shards"] == res[r % 2]["fsdp"]["nonfinite"]["shards"], (r, nf)
    # error feedback on this rank's part only: the two local ranks' parts of each parameter add up to it
    for machine in (0, 2):
        mine, peer = res[machine]["res_numel"], res[machine + 1]["res_numel"]
        assert {n: mine.get(n, 0) + peer.get(n, 0) for n in res[0]["param_numel"]} == res[0]["param_numel"]
        assert sum(mine.values()) < sum(res[0]["param_numel"].values())

