"""Faults of one rank in a real multi-process compressed run (gloo): a rank dies or stalls, an encoder
raises on one rank, one rank's gradients are non-finite, one rank's parameters drift.

The promise under test: every rank fails fast with the same clear FastML error (never a hang), a
non-finite step is seen alike everywhere and changes no error-feedback state, and drift is caught.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _fault_helpers import flat_params, loss_of, mlp
from _dist import run_workers

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

# Seconds. The default group (rendezvous, start-up) gets a generous timeout, since ranks start
# seconds apart on a loaded 2-core machine; FastML's collectives run on a group of their own with a
# short one, as a user would set with init_process_group(timeout=...) (the hook's group inherits it:
# see test_replica_check_is_silent_when_replicas_agree).
PG_TIMEOUT = 60
COMM_TIMEOUT = 5


def _setup(plan="int4", check_replicas_every=0, ranks_per_node=None, comm_timeout=COMM_TIMEOUT):
    from datetime import timedelta

    import fastml_strategy as fm

    model = mlp()
    ddp = DDP(model, bucket_cap_mb=0.02)
    group = dist.new_group(list(range(dist.get_world_size())), timeout=timedelta(seconds=comm_timeout))
    state = fm.register_hook(ddp, plan=plan, check_replicas_every=check_replicas_every,
                             process_group=group, ranks_per_node=ranks_per_node)
    assert state.hierarchical == (ranks_per_node is not None and ranks_per_node > 1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    return model, ddp, state, opt


def _error_report(e: BaseException, t0: float) -> dict:
    return {"type": type(e).__name__, "module": type(e).__module__, "msg": str(e),
            "cause": repr(e.__cause__), "elapsed": time.monotonic() - t0}


def _stay_alive(marks, rank, count):
    """Note in folder ``marks`` that ``rank`` raised, then wait (60 s at most) until ``count`` ranks
    have: no rank learns of a failure from another one's exit or its next collectives."""
    open(os.path.join(marks, str(rank)), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(marks)) < count and time.monotonic() < deadline:
        time.sleep(0.1)


# -- a rank dies or stalls at step 3 -------------------------------------------------------------------
def _rank_fault(rank, world_size, how, victim, plan="int4", ranks_per_node=None, comm_timeout=COMM_TIMEOUT,
                marks=None):
    """``marks`` (a folder): a rank that raised notes it there and stays alive (as a process that
    logs and waits would) until every rank that fails has raised, so that none learns of the failure
    from another one's exit. ``how="raise"``: the victim stays alive but fails before its first
    collective of step 3 (it never issues it), as after an error outside the collectives."""
    import fastml_strategy.codecs as codecs

    model, ddp, state, opt = _setup(plan, ranks_per_node=ranks_per_node, comm_timeout=comm_timeout)
    t0 = time.monotonic()
    for step in range(6):
        if step == 3:
            t0 = time.monotonic()
            if rank == victim and how == "exit":
                os._exit(17)  # before its forward: peers are already waiting in the collective
            if rank == victim and how == "sigkill_in_encoder":
                real = codecs.encode_chunk

                def die(*a, **k):  # inside the comm thread, in the middle of the backward pass
                    os.kill(os.getpid(), signal.SIGKILL)
                    return real(*a, **k)

                codecs.encode_chunk = die
            if rank == victim and how == "stall":
                time.sleep(COMM_TIMEOUT + 3)  # alive but silent: peers must time out, not wait forever
            if rank == victim and how == "raise":
                def fail(*a, **k):  # on the communication thread, before the bucket's first collective
                    raise RuntimeError("injected failure before the step's collectives")

                state._engine.start = fail
        try:
            loss_of(ddp, rank, step).backward()
        except Exception as e:  # noqa: BLE001
            report = {"step": step, **_error_report(e, t0)}
            if marks is not None:
                _stay_alive(marks, rank, world_size if how == "raise" else world_size - 1)
            return report
        opt.step()
        opt.zero_grad()
    return {"step": None}


@pytest.mark.parametrize("world_size,how,plan,ranks_per_node", [
    (2, "exit", "int4", None), (3, "sigkill_in_encoder", "int4", None), (2, "stall", "int4", None),
    # a `none` plan's all-reduce is issued by the hook itself (no communication thread): same promise
    (2, "exit", "none", None), (2, "stall", "none", None)])
def test_dead_or_stalled_rank_fails_every_other_rank_fast(world_size, how, plan, ranks_per_node):
    victim = world_size - 1
    results = run_workers(_rank_fault, world_size, how, victim, plan, ranks_per_node, timeout=90,
                          pg_timeout=PG_TIMEOUT, allow_deaths=True)
    _check_fault_results(results, world_size, how, victim)


def _check_fault_results(results, world_size, how, victim, within=COMM_TIMEOUT + 4):
    if how == "stall":
        assert results[victim][0] == "ok"  # it wakes up to a broken group and fails too
        assert results[victim][1]["type"] == "CompressionError", results[victim]
    else:
        assert results[victim][0] == "died", results[victim]
    for r in range(world_size):
        if r == victim:
            continue
        status, res = results[r]
        assert status == "ok", res
        assert res["step"] == 3, f"rank {r} did not fail at step 3: {res}"
        assert res["type"] == "CompressionError" and res["module"] == "fastml_strategy.collective", res
        assert "restart from the last checkpoint" in res["msg"], res["msg"]
        # gloo says "Connection closed by peer", "Timed out waiting ..." or, for the side whose
        # pair was closed by its own timeout, "Application timeout caused pair closure"
        assert any(w in res["cause"] for w in ("gloo", "Connection", "Timed out", "timeout")), res
        assert "callback" not in res["cause"], res  # gloo's own error, not a future's wrapper
        # "within the process group's timeout": a dead peer is noticed at once, a stalled one at the
        # timeout; allow a little slack for the 2-core machine.
        assert res["elapsed"] < within, res


# the death phase's group timeout: a survivor that waited for it instead of hearing of the failure
# through the job's store (fastml_strategy.comm._peers) would take this long
DEATH_TIMEOUT = 30


def _hier_faults(rank, world_size, path):
    """Two machines of two ranks (hierarchical path), three faults in one launch (to keep CI time
    down): rank 3 stalls at step 3 (rank 2 is its machine peer); then, with a fresh hook and groups
    whose timeout is long, a `none` plan (every bucket takes the plain all-reduce across machines),
    rank 2 fails before its collectives of step 3 and stays alive: rank 3 waits on it inside
    machine 1, rank 0 across machines, and rank 1 across machines on rank 3, which has raised; all
    must hear of it through the failure channel, the plain all-reduce's wait included. Last, with
    a fresh hook again (int4), rank 2 dies at step 3. Rank 1 shares no group with it but the
    world's: rank 0 (its cross-machine peer) and rank 3 (its machine peer) see the closed
    connection, and rank 1, waiting on rank 0 inside machine 0, must hear of it through the
    failure channel."""
    import json

    t0 = time.monotonic()
    stall = _rank_fault(rank, world_size, "stall", 3, "int4", 2)
    with open(os.path.join(path, f"stall{rank}.json"), "w") as f:
        json.dump({**stall, "phase_s": time.monotonic() - t0}, f)
    t0 = time.monotonic()
    os.makedirs(os.path.join(path, "raised"), exist_ok=True)
    raised = _rank_fault(rank, world_size, "raise", 2, "none", 2, comm_timeout=DEATH_TIMEOUT,
                         marks=os.path.join(path, "raised"))
    with open(os.path.join(path, f"raise{rank}.json"), "w") as f:
        json.dump({**raised, "phase_s": time.monotonic() - t0}, f)
    marks = os.path.join(path, "marks")
    os.makedirs(marks, exist_ok=True)
    t0 = time.monotonic()
    return {**_rank_fault(rank, world_size, "exit", 2, "int4", 2, comm_timeout=DEATH_TIMEOUT, marks=marks),
            "phase_s": time.monotonic() - t0}


def test_hierarchical_dead_or_stalled_rank_fails_every_other_rank_fast(tmp_path):
    import json

    results = run_workers(_hier_faults, 4, str(tmp_path), timeout=150, pg_timeout=PG_TIMEOUT, allow_deaths=True)
    stall = [("ok", json.loads((tmp_path / f"stall{r}.json").read_text())) for r in range(4)]
    _check_fault_results(stall, 4, "stall", 3)
    # a `none` plan: every rank raised at step 3, long before the groups' timeout, and every rank's
    # error names the one that failed first (the failure channel carries its text)
    for r in range(4):
        res = json.loads((tmp_path / f"raise{r}.json").read_text())
        assert res["step"] == 3 and res["type"] == "CompressionError", (r, res)
        assert "restart from the last checkpoint" in res["msg"] and "injected failure" in res["msg"], (r, res)
        assert res["elapsed"] < DEATH_TIMEOUT / 3, (r, res)
    # every survivor, rank 1 included, raised long before the groups' timeout (alive until all had)
    _check_fault_results(results, 4, "exit", 2, within=DEATH_TIMEOUT / 3)


def test_store_host_rank_0_dies_and_every_survivor_fails_fast(tmp_path, capfd):
    """Rank 0 dies at step 3 where it hosts the job's c10d store: run_workers starts the ranks as
    ``mp.spawn`` (or srun/mpirun without torchrun's agent) would, with ``init_method="env://"``, so
    rank 0's process is the store's server. Two machines of two ranks, int4: rank 1 (its machine
    peer) and rank 2 (its peer across machines) see the closed connection; rank 3 shares no group
    with rank 0 and waits on ranks 1 and 2, which have raised (and stay alive), while the failure
    channel's store died with rank 0. Every survivor must raise FastML's error long before the
    groups' timeout, rank 3's naming rank 0 and the store, and no rank may print c10d's C++ trace of
    a failed store read (before the fix: rank 3 waited the whole timeout, after that trace)."""
    marks = tmp_path / "marks"
    marks.mkdir()
    results = run_workers(_rank_fault, 4, "exit", 0, "int4", 2, DEATH_TIMEOUT, str(marks), timeout=120,
                          pg_timeout=PG_TIMEOUT, allow_deaths=True)
    assert results[0][0] == "died", results[0]
    for r in (1, 2, 3):
        status, res = results[r]
        assert status == "ok" and res["step"] == 3, (r, results[r])
        assert res["type"] == "CompressionError" and res["module"] == "fastml_strategy.collective", res
        assert "restart from the last checkpoint" in res["msg"], res["msg"]
        assert res["elapsed"] < DEATH_TIMEOUT / 3, (r, res)  # not the groups' timeout
    msg = results[3][1]["msg"]
    assert "rank 0, which hosts the job's c10d store at 127.0.0.1:" in msg and "most likely died" in msg, msg
    err = capfd.readouterr().err
    assert "TCPStore.cpp" not in err and "frame #" not in err, err[-3000:]


# LocalSGD on islands: the init timeout (every group LocalSGD and the island use inherits it), long
# enough that a survivor that waited for it instead of hearing of the failure fails the bound below
ISLAND_TIMEOUT = 30


def _ddp_island_failure(rank, world_size, marks):
    """Two machines of two ranks, DDP inside each, LocalSGD (`none`: the plain all-reduce across
    machines, every 2) across: rank 2 fails in its second synchronisation (inner step 4), before its
    first collective, and stays alive. Rank 3 waits on it inside machine 1, rank 0 across machines,
    rank 1 across machines on rank 3 (which has raised): each must hear of it through the failure
    channel, not at the group timeout."""
    import fastml_strategy as fm
    from fastml_strategy.localsgd import machine_group

    model = mlp()
    ddp = DDP(model, process_group=machine_group(ranks_per_node=2))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    local = fm.LocalSGD(ddp, opt, every=2, plan="none")
    assert local._channel is not None and local.ranks_per_node == 2
    return _second_sync_fails_on_rank_2(ddp, opt, local, rank, world_size, marks)


def _second_sync_fails_on_rank_2(model, opt, local, rank, world_size, marks):
    """Train 6 inner steps with LocalSGD every 2; rank 2 fails in its second synchronisation, on the
    communication thread before its first collective, and stays alive; every rank returns what it
    raised (step, outer steps, error, seconds since inner step 3)."""
    if rank == 2:
        real, calls = local._engine.start, []

        def start(*a, **k):  # on the communication thread, before the synchronisation's collectives
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("injected failure before the synchronisation's collectives")
            return real(*a, **k)

        local._engine.start = start
    t0 = time.monotonic()
    for step in range(6):
        if step == 3:
            t0 = time.monotonic()
        try:
            loss_of(model, rank, step).backward()
            opt.step()
            opt.zero_grad()
            local.step()
        except Exception as e:  # noqa: BLE001
            report = {"step": step, "outer_steps": local.outer_steps, **_error_report(e, t0)}
            _stay_alive(marks, rank, world_size)
            return report
    return {"step": None}


def _flat_halving_failure(rank, world_size, marks):
    """Flat LocalSGD (one replica per rank) whose outer synchronisation runs recursive halving on 4
    ranks: rank 2 fails in its second synchronisation before its first collective and stays alive.
    Its partners of the first round wait on it; the others meet only ranks that did not fail: each
    must hear of it through the failure channel, not at the group timeout (issue 35)."""
    import fastml_strategy as fm

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    local = fm.LocalSGD(model, opt, every=2, plan=fm.Plan.from_recipe("int4", schedule="halving"))
    assert local._channel is not None
    return _second_sync_fails_on_rank_2(model, opt, local, rank, world_size, marks)


def _island_faults(rank, world_size, path):
    """Three faults in one launch (to keep CI time down): a DDP island's rank fails (alive), a rank of
    flat LocalSGD over the halving schedule fails (alive), then an FSDP2 island's rank dies."""
    import json

    for sub in ("raised", "flat", "marks"):
        os.makedirs(os.path.join(path, sub), exist_ok=True)
    with open(os.path.join(path, f"ddp{rank}.json"), "w") as f:
        json.dump(_ddp_island_failure(rank, world_size, os.path.join(path, "raised")), f)
    with open(os.path.join(path, f"flat{rank}.json"), "w") as f:
        json.dump(_flat_halving_failure(rank, world_size, os.path.join(path, "flat")), f)
    return _fsdp_island_death(rank, world_size, os.path.join(path, "marks"))


def _fsdp_island_death(rank, world_size, marks):
    """Two machines of two ranks, FSDP2 inside each, LocalSGD (int4, every 2) across: rank 3 dies
    before its inner step 3 (index 2). Its machine peer (rank 2) fails in FSDP's own all-gather, rank 1
    (its counterpart across machines) at the next synchronisation (inner step 4). Rank 0 meets rank 2
    there, which has raised and never issues its part: rank 0 must hear of rank 1's failure through
    the failure channel instead of waiting for the group timeout. A survivor that raised stays alive
    (``marks``) until every survivor has, so that none learns of the failure from another's exit."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import fastml_strategy as fm
    from fastml_strategy.localsgd import machine_group

    mesh = DeviceMesh.from_group(machine_group(ranks_per_node=2), "cpu")
    model = mlp()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    local = fm.LocalSGD(model, opt, every=2, plan="int4")
    t0 = time.monotonic()
    for step in range(6):
        if step == 2:
            t0 = time.monotonic()
            if rank == 3:
                os._exit(17)  # between two synchronisations, before its forward
        try:
            loss_of(model, rank, step).backward()
            opt.step()
            opt.zero_grad()
            local.step()
        except Exception as e:  # noqa: BLE001
            report = {"step": step, **_error_report(e, t0)}
            _stay_alive(marks, rank, world_size - 1)
            return report
    return {"step": None}


def test_island_rank_failure_or_death_fails_every_other_rank_fast(tmp_path):
    import json

    results = run_workers(_island_faults, 4, str(tmp_path), timeout=150, pg_timeout=ISLAND_TIMEOUT,
                          allow_deaths=True)
    # DDP island, `none`: every rank raised at the second synchronisation (inner step 4), long before
    # the group timeout, and every rank's error names the failure that started it
    for r in range(4):
        res = json.loads((tmp_path / f"ddp{r}.json").read_text())
        assert res["step"] == 3 and res["outer_steps"] == 1 and res["type"] == "CompressionError", (r, res)
        assert "restart from the last checkpoint" in res["msg"] and "injected failure" in res["msg"], (r, res)
        assert res["elapsed"] < ISLAND_TIMEOUT / 3, (r, res)
    # flat LocalSGD, halving on 4 ranks: likewise through the failure channel
    for r in range(4):
        res = json.loads((tmp_path / f"flat{r}.json").read_text())
        assert res["step"] == 3 and res["outer_steps"] == 1 and res["type"] == "CompressionError", (r, res)
        assert "injected failure" in res["msg"] and res["elapsed"] < ISLAND_TIMEOUT / 3, (r, res)
    # FSDP2 island, int4, a rank dies
    assert results[3][0] == "died", results[3]
    status, res = results[2]  # FSDP's all-gather with the dead rank: gloo's own error, at once
    assert status == "ok" and res["step"] == 2 and res["elapsed"] < ISLAND_TIMEOUT / 3, res
    for r in (0, 1):  # at the synchronisation after inner step 4, FastML's error
        status, res = results[r]
        assert status == "ok" and res["step"] == 3, (r, res)
        assert res["type"] == "CompressionError" and "restart from the last checkpoint" in res["msg"], res
        assert res["elapsed"] < ISLAND_TIMEOUT / 3, (r, res)  # not the group timeout
    # rank 1 saw the closed connection; rank 0 heard of rank 1's failure through the failure channel
    assert "another rank failed" in results[0][1]["msg"] and "rank 1" in results[0][1]["msg"], results[0]


# -- an exception inside compression on one rank only -------------------------------------------------------
def _encoder_raises(rank, world_size, stage, ranks_per_node=None):
    import fastml_strategy.codecs as codecs
    from fastml_strategy import CompressionError

    model, ddp, state, opt = _setup("int4", ranks_per_node=ranks_per_node)
    for step in range(5):
        if step == 3 and rank == 1:
            # "encoding": the first-stage encode of a gradient chunk (encode_chunk, into the
            # all_to_all message); "reduction": the re-encode of the chunk sum (reduce_chunk, into the
            # all_gather message, its 4th argument)
            name, out_arg = ("encode_chunk", 2) if stage == "encoding" else ("reduce_chunk", 3)
            real = getattr(codecs, name)

            def boom(*a, real=real, **k):
                ptr = a[out_arg].untyped_storage().data_ptr()
                lays = state._engine.layouts.values()
                msgs = [lay.send if stage == "encoding" else lay.gsend for lay in lays]
                if any(ptr == m.untyped_storage().data_ptr() for m in msgs):
                    raise RuntimeError("injected codec failure")
                return real(*a, **k)

            setattr(codecs, name, boom)
        try:
            loss_of(ddp, rank, step).backward()
        except CompressionError as e:
            # Once failed, the hook stays failed (the group may be unusable): the next step says so.
            try:
                loss_of(ddp, rank, step + 1).backward()
                again = "no error"
            except Exception as e2:  # noqa: BLE001
                again = type(e2).__name__
            return {"step": step, "msg": str(e), "cause": repr(e.__cause__), "again": again}
        opt.step()
        opt.zero_grad()
    return {"step": None}


@pytest.mark.parametrize("stage,world_size,ranks_per_node", [
    ("encoding", 2, None), ("reduction", 2, None),
    # hierarchical: rank 1's error travels in its cross-machine group's headers (ranks 1, 3), then to
    # ranks 0 and 2 in the end-of-step agreement of all ranks
    ("reduction", 4, 2)])
def test_encoder_exception_on_one_rank_fails_every_rank_alike(stage, world_size, ranks_per_node):
    res = run_workers(_encoder_raises, world_size, stage, ranks_per_node, timeout=60, pg_timeout=PG_TIMEOUT)
    assert all(r["step"] == 3 for r in res), res
    assert len({r["msg"] for r in res}) == 1, "every rank must raise the same error"
    assert f"compression failed on rank 1 during {stage}" in res[0]["msg"], res[0]["msg"]
    assert "injected codec failure" in res[0]["msg"]
    assert "injected codec failure" in res[1]["cause"]  # the failing rank keeps its traceback
    assert len({r["again"] for r in res}) == 1 and res[0]["again"] != "no error"


def _final_decode_raises(rank, world_size):
    """Rank 1's decoding of the all-gathered result fails (after the bucket's last collective): no
    message header can carry it, so the ranks exchange their status at the end of the step."""
    import fastml_strategy.codecs as codecs
    from fastml_strategy import CompressionError

    model, ddp, state, opt = _setup("int4")
    t0 = time.monotonic()
    for step in range(5):
        if step == 3 and rank == 1:
            real = codecs.decode_chunk

            def boom(buf, *a, **k):
                ptr = buf.untyped_storage().data_ptr()
                if any(ptr == lay.grecv.untyped_storage().data_ptr()
                       for lay in state._engine.layouts.values() if lay.grecv is not None):
                    raise RuntimeError("injected decode failure")
                return real(buf, *a, **k)

            codecs.decode_chunk = boom
        t0 = time.monotonic()
        try:
            loss_of(ddp, rank, step).backward()
        except CompressionError as e:
            return {"step": step, **_error_report(e, t0)}
        opt.step()
        opt.zero_grad()
    return {"step": None}


def test_final_decode_exception_on_one_rank_fails_every_rank_promptly():
    res = run_workers(_final_decode_raises, 2, timeout=60, pg_timeout=PG_TIMEOUT)
    assert res[0]["step"] == res[1]["step"] == 3, res
    assert res[0]["msg"] == res[1]["msg"], "every rank must raise the same error"
    assert "compression failed on rank 1 during decoding" in res[0]["msg"], res[0]["msg"]
    assert "injected decode failure" in res[0]["msg"]
    assert "injected decode failure" in res[1]["cause"]
    assert res[0]["elapsed"] < COMM_TIMEOUT, res  # at once, not at the process group's timeout


# -- non-finite gradients on one rank --------------------------------------------------------------------
def _nonfinite(rank, world_size, plan, ranks_per_node=None):
    if plan == "int4, poisoned layer none":  # the NaN in a plain all-reduce of a compressing step
        from fastml_strategy import RECIPES, Plan

        plan = Plan.from_recipe("int4").with_layers({"2.weight": RECIPES["none"]})
    elif plan == "int4 halving":  # recursive halving/doubling carries the NaN (issue 35)
        from fastml_strategy import Plan

        plan = Plan.from_recipe("int4", schedule="halving")
    model, ddp, state, opt = _setup(plan, check_replicas_every=1, ranks_per_node=ranks_per_node)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    target = "2.weight"  # 128 x 128: compressed
    poison = {"on": False}

    def hook(g):
        if poison["on"]:
            g = g.clone()
            g[0, 0] = float("inf")
            g[5, 7] = float("nan")
        return g

    if rank == 1:
        dict(model.named_parameters())[target].register_hook(hook)
    out = {"skipped": [], "grad_finite": [], "residuals_changed": [], "res_finite": True}
    for step in range(8):
        poison["on"] = step == 3
        before = {k: v.clone() for k, v in state.state_dict()["residuals"].items()}
        params_before = flat_params(model).clone()
        scaler.scale(loss_of(ddp, rank, step)).backward()
        after = state.state_dict()["residuals"]
        out["grad_finite"].append(all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()))
        out["target_grad_finite_" + str(step)] = bool(torch.isfinite(
            dict(model.named_parameters())[target].grad).all())
        out["residuals_changed"].append(  # (no residuals exist before the first step: zeros)
            any(not torch.equal(before.get(k, torch.zeros_like(v)), v) for k, v in after.items()))
        out["res_finite"] = out["res_finite"] and all(bool(torch.isfinite(v).all()) for v in after.values())
        if step == 3:
            out["residual_norm_at_3"] = sum(float(v.norm()) for v in after.values())
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        out["skipped"].append(torch.equal(params_before, flat_params(model)))
    gathered = [torch.zeros_like(flat_params(model)) for _ in range(world_size)]
    dist.all_gather(gathered, flat_params(model))
    out["identical"] = all(torch.equal(gathered[0], g) for g in gathered[1:])
    out["finite_params"] = bool(torch.isfinite(flat_params(model)).all())
    out["nonfinite_steps"] = state.stats()["nonfinite_steps"]
    out["schedules"] = sorted(state.stats().get("schedules", {}))
    return out


@pytest.mark.parametrize("plan,world_size,ranks_per_node", [
    ("int4", 2, None), ("topk1", 2, None), ("int4, poisoned layer none", 2, None), ("none", 2, None),
    # hierarchical: the NaN of rank 1 reaches one local rank's part on each machine (across machines)
    # and every rank through the intra-machine all-gather; the agreement skips the commit everywhere
    ("int4", 4, 2),
    # recursive halving/doubling on 4 ranks: the poisoned part travels through log2 N rounds
    ("int4 halving", 4, None)])
def test_nonfinite_gradient_on_one_rank_reaches_all_and_spares_residuals(plan, world_size, ranks_per_node):
    for r, out in enumerate(run_workers(_nonfinite, world_size, plan, ranks_per_node, timeout=90,
                                        pg_timeout=PG_TIMEOUT)):
        # Step 3: every rank (not only rank 1) receives NaN/inf in the poisoned layer's gradient...
        assert out["grad_finite"] == [True] * 3 + [False] + [True] * 4, (r, out["grad_finite"])
        assert not out["target_grad_finite_3"]
        # ...so GradScaler skips that step on every rank alike, and only that one.
        assert out["skipped"] == [False] * 3 + [True] + [False] * 4, (r, out["skipped"])
        if plan == "none":  # DDP's all-reduce: no residual, nothing checked or counted (as DDP's hook)
            assert out["residuals_changed"] == [False] * 8 and out["nonfinite_steps"] == 0, (r, out)
            assert out["identical"] and out["finite_params"]
            continue
        # Error feedback: no residual of any bucket moves on the skipped step; they stay finite and
        # non-trivial; every other step does update them.
        assert out["residuals_changed"] == [True] * 3 + [False] + [True] * 4, (r, out)
        assert out["res_finite"] and out["residual_norm_at_3"] > 0
        assert out["nonfinite_steps"] == 1
        if plan == "int4 halving":
            assert "halving" in out["schedules"] and "ring" not in out["schedules"], out["schedules"]
        # Training went on normally: finite parameters, identical on every rank (checked every step
        # by check_replicas_every=1 as well).
        assert out["identical"] and out["finite_params"]


# -- replica drift ----------------------------------------------------------------------------------------
def _drift(rank, world_size, perturb):
    import fastml_strategy as fm
    from fastml_strategy.hook import ReplicaDriftError

    if perturb == "frozen":  # a parameter frozen at registration (unfrozen later, say) is checked too
        model = mlp()
        model[0].weight.requires_grad_(False)
        ddp = DDP(model, bucket_cap_mb=0.02)
        state = fm.register_hook(ddp, plan="int4", check_replicas_every=2)
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.05)
    elif perturb:
        model, ddp, state, opt = _setup("none" if perturb == "none" else "int4", check_replicas_every=2)
    else:  # the hook's own group, which must inherit init_process_group's timeout
        model = mlp()
        ddp = DDP(model, bucket_cap_mb=0.02)
        state = fm.register_hook(ddp, plan="int4", check_replicas_every=2)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(7):
        if perturb and step == 3 and rank == 1:
            with torch.no_grad():  # one element, one rank, outside the all-reduce
                (model[0].weight if perturb == "frozen" else model[2].weight)[3, 3] += 1e-6
        try:
            loss_of(ddp, rank, step).backward()
        except ReplicaDriftError as e:
            return {"step": step, "msg": str(e)}
        opt.step()
        opt.zero_grad()
    timeout = state.process_group._get_backend(torch.device("cpu")).options._timeout
    return {"step": None, "steps": state.stats()["steps"], "timeout_s": timeout.total_seconds()}


@pytest.mark.parametrize("perturb", [True, "frozen", "none"])
def test_replica_drift_is_detected_on_every_rank(perturb):
    res = run_workers(_drift, 2, perturb, timeout=60, pg_timeout=PG_TIMEOUT)
    # Perturbed before step 3's forward; the check runs after steps 2, 4, 6 (at the end of the
    # all-reduce of the step's last bucket): it fires during step 3's backward (state step 4).
    assert res[0]["step"] == res[1]["step"] == 3, res
    assert res[0]["msg"] == res[1]["msg"] and "replicas differ" in res[0]["msg"], res


def test_replica_check_is_silent_when_replicas_agree():
    for out in run_workers(_drift, 3, False, timeout=60, pg_timeout=PG_TIMEOUT):
        assert out == {"step": None, "steps": 7, "timeout_s": PG_TIMEOUT}
