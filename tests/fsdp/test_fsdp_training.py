"""FastML under FSDP2 as a user runs it: convergence on the digits task, resume from a distributed
checkpoint, a rank that dies, and bad input caught on every rank before the first step."""

from __future__ import annotations

import os

import pytest
import torch

from _fsdp_helpers import OddNet, full_params, max_diff, plan, shard
from _dist import run_workers

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def _digits(rank, world_size, recipes, steps):
    """Train one digits MLP per recipe (None: FSDP's own reduce-scatter) side by side; returns
    (first loss, last loss, test accuracy) per recipe."""
    import fastml_strategy.fsdp as ff
    from fastml_strategy._digits import accuracy, batches, digits_mlp, load_digits_split

    xtr, ytr, xte, yte = load_digits_split()
    runs = []
    for recipe in recipes:
        model = shard(digits_mlp(hidden=128))
        if recipe is not None:
            ff.register(model, plan=recipe)
        runs.append((model, torch.optim.Adam(model.parameters(), lr=3e-3),
                     batches(xtr, ytr, 32, rank, world_size), []))
    for _ in range(steps):
        for model, opt, data, losses in runs:
            x, y = next(data)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    out = {}
    for recipe, (model, _, _, losses) in zip(recipes, runs):
        # accuracy() runs the FSDP model: a collective, on every rank alike
        out[str(recipe)] = (sum(losses[:10]) / 10, sum(losses[-20:]) / 20, accuracy(model, xte, yte))
    return out


@pytest.mark.parametrize("world_size,steps", [(2, 160), (3, 120)])  # 3: uneven shards
def test_digits_converge_like_uncompressed_fsdp(world_size, steps):
    recipes = [None, "int4", "topk1-int4"]
    res = run_workers(_digits, world_size, recipes, steps, timeout=230)[0]
    first, last, acc_ref = res["None"]
    assert last < 0.25 * first and acc_ref > 0.9
    for recipe in recipes[1:]:
        f, l, acc = res[recipe]
        assert l < 0.3 * f, (recipe, f, l)
        if recipe == "int4":
            assert acc >= acc_ref - 0.01, (recipe, acc, acc_ref)
        else:  # top-k keeps 1% per step: it converges, more slowly
            assert acc > 0.85, (recipe, acc, acc_ref)


def _dcp_run(rank, world_size, ckpt_dir, mode, steps, save_at):
    """mode "full": train `steps`, saving a distributed checkpoint after `save_at`; "resume": load it
    and train the rest; "resume-without-fastml": the same, but FastML's residuals start at zero."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import fastml_strategy.fsdp as ff

    model = shard(OddNet())
    state = ff.register(model, plan=plan("int4"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(11 + rank)
    xs = [torch.randn(8, 13, generator=gen) for _ in range(steps)]
    start = 0
    if mode != "full":
        msd, osd = get_state_dict(model, opt)
        ckpt = {"model": msd, "optim": osd, "fastml": state.distributed_state_dict()}
        dcp.load(ckpt, checkpoint_id=ckpt_dir)
        set_state_dict(model, opt, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"])
        if mode == "resume":
            state.load_state_dict(ckpt["fastml"])
        start = save_at
    for step in range(start, steps):
        model(xs[step]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if mode == "full" and step + 1 == save_at:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "fastml": state.distributed_state_dict()},
                     checkpoint_id=ckpt_dir)
    return full_params(model), state.stats()["steps"]


def test_resume_from_distributed_checkpoint_is_bit_exact(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    full = run_workers(_dcp_run, 2, ckpt, "full", 8, 4, timeout=120)
    resumed = run_workers(_dcp_run, 2, ckpt, "resume", 8, 4, timeout=120)
    for (p_full, n_full), (p_res, n_res) in zip(full, resumed):
        assert n_full == n_res == 8
        assert max_diff(p_full, p_res) == 0.0
    # the residuals are part of the trajectory: without them the run differs
    fresh = run_workers(_dcp_run, 2, ckpt, "resume-without-fastml", 8, 4, timeout=120)
    assert max_diff(full[0][0], fresh[0][0]) > 0


def _dies(rank, world_size):
    import fastml_strategy.codecs as codecs
    import fastml_strategy.fsdp as ff
    from fastml_strategy import CompressionError

    model = shard(OddNet())
    ff.register(model, plan=plan("int4"))
    gen = torch.Generator().manual_seed(rank)
    for step in range(5):
        if step == 2 and rank == 1:
            def die(*a, **k):  # dies in the middle of its reduce-scatter, as an OOM kill would
                os._exit(3)

            codecs.encode_chunk = die
        try:
            model(torch.randn(8, 13, generator=gen)).square().mean().backward()
        except CompressionError as e:
            return {"step": step, "msg": str(e)}
    return {"step": None}


def test_rank_death_raises_compression_error_on_survivors():
    res = run_workers(_dies, 2, timeout=90, pg_timeout=20, allow_deaths=True)
    assert res[1] == ("died", 3)
    status, value = res[0]
    assert status == "ok" and value["step"] == 2, res
    assert "reduce-scatter" in value["msg"] and "restart from the last checkpoint" in value["msg"]


def _hsdp_dies(rank, world_size, marks):
    """Rank 3 of a 2 x 2 HSDP mesh dies inside FastML's cross-replica all-reduce; each survivor
    notes when it raised and then stays alive (as a process that logs and waits would) until every
    survivor has raised, so that no survivor learns of the failure from another one's exit."""
    import time

    import fastml_strategy.codecs as codecs
    import fastml_strategy.fsdp as ff
    from fastml_strategy import CompressionError
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = shard(OddNet(), mesh=mesh)
    ff.register(model, plan=plan("int4"))
    gen = torch.Generator().manual_seed(rank)
    for step in range(5):
        if step == 2 and rank == 3:
            codecs.encode_chunk = lambda *a, **k: os._exit(3)  # HSDP encodes only across replicas
        t0 = time.monotonic()
        try:
            model(torch.randn(8, 13, generator=gen)).square().mean().backward()
        except CompressionError as e:
            took = time.monotonic() - t0
            open(os.path.join(marks, str(rank)), "w").close()
            deadline = time.monotonic() + 40
            while len(os.listdir(marks)) < 3 and time.monotonic() < deadline:
                time.sleep(0.1)
            return {"step": step, "msg": str(e), "took": took,
                    "cause": repr(e.__cause__) if e.__cause__ is not None else None}
    return {"step": None}


def test_hsdp_rank_death_raises_compression_error_on_every_survivor_promptly(tmp_path):
    """Every survivor, in either group of the dead rank or in neither, raises FastML's error within
    seconds (the process-group timeout is 20 s), with the underlying error as its cause."""
    res = run_workers(_hsdp_dies, 4, str(tmp_path), timeout=120, pg_timeout=20, allow_deaths=True)
    assert res[3] == ("died", 3), res
    for r in range(3):
        status, value = res[r]
        assert status == "ok" and value["step"] == 2, (r, res[r])
        assert value["took"] < 10, (r, value)
        assert value["cause"] is not None, (r, value)
        assert "restart from the last checkpoint" in value["msg"] or "failed on rank" in value["msg"], value


def _bad_inputs(rank, world_size):
    import fastml_strategy as fm
    import fastml_strategy.fsdp as ff
    from torch.distributed.fsdp import FullyShardedDataParallel

    out = {}

    def attempt(key, fn):
        try:
            fn()
            out[key] = None
        except Exception as e:  # noqa: BLE001
            out[key] = (type(e).__name__, str(e))

    attempt("not_sharded", lambda: ff.register(OddNet(), plan="int4"))
    attempt("not_a_module", lambda: ff.register("model", plan="int4"))
    model = shard(OddNet())
    attempt("missing_param", lambda: ff.register(model, plan=fm.Plan.from_recipe("int4").with_layers(
        {"nope.weight": fm.RECIPES["int8"]})))
    # one rank's plan differs (the other ranks' plan is fine): every rank must raise
    attempt("mismatch", lambda: ff.register(model, plan="int4" if rank == 0 else "int8"))
    attempt("bad_only_on_rank1", lambda: ff.register(model, plan="int4" if rank == 0 else "int9"))
    attempt("shard_plan_without_hsdp", lambda: ff.register(model, plan="int4", shard_plan="int8"))
    # FSDP1 cannot be built on a CPU-only machine ("FSDP needs a non-CPU accelerator"): an instance
    # of its class, initialised as a plain Module, is what the type check sees on a GPU machine.
    fsdp1 = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    torch.nn.Module.__init__(fsdp1)
    attempt("fsdp1", lambda: ff.register(fsdp1, plan="int4"))
    # a setting that is bad on one rank only, or valid but different: the same error on every rank
    attempt("ag_bits_bad_on_rank1", lambda: ff.register(model, plan="int4",
                                                        all_gather_bits=None if rank == 0 else 9))
    attempt("ag_bits_differ", lambda: ff.register(model, plan="int4", all_gather_bits=8 if rank else None))
    attempt("stats_every_bad_on_rank0", lambda: ff.register(model, plan="int4",
                                                            layer_stats_every=-1 if rank == 0 else 10))
    # after all that, registration still works and trains
    state = ff.register(model, plan=plan("int4"))
    model(torch.randn(8, 13)).square().mean().backward()
    out["trained_steps"] = state.stats()["steps"]
    # a second register without close() is refused (closing the first would remove its hooks)
    attempt("twice", lambda: ff.register(model, plan=plan("int4")))
    # another kind of FastML state names itself and what loads it
    attempt("wrong_kind", lambda: state.load_state_dict(
        {"format_version": 1, "kind": "localsgd", "rank": rank, "world_size": world_size}))
    state.close()
    again = ff.register(model, plan=plan("int4"))  # after close(), registering again works
    model(torch.randn(8, 13)).square().mean().backward()
    out["trained_again"] = again.stats()["steps"]
    return out


def test_bad_input_fails_on_every_rank_before_any_step():
    res = run_workers(_bad_inputs, 2, timeout=120)
    for r in res:
        assert r["not_sharded"][0] == "TypeError" and "fully_shard" in r["not_sharded"][1]
        assert r["not_a_module"][0] == "TypeError"
        assert r["missing_param"][0] == "ValueError" and "nope.weight" in r["missing_param"][1]
        assert r["mismatch"][0] == "ValueError" and "different plans" in r["mismatch"][1]
        assert r["bad_only_on_rank1"][0] == "ValueError" and "rank(s) [1]" in r["bad_only_on_rank1"][1]
        assert r["shard_plan_without_hsdp"][0] == "ValueError"
        assert r["fsdp1"][0] == "TypeError" and "FSDP1" in r["fsdp1"][1]
        assert r["trained_steps"] == 1
        assert r["ag_bits_bad_on_rank1"][0] == "ValueError"
        assert "all_gather_bits=9" in r["ag_bits_bad_on_rank1"][1] and "rank(s) [1]" in r["ag_bits_bad_on_rank1"][1]
        assert r["ag_bits_differ"][0] == "ValueError"
        assert "different all_gather_bits (rank 0: None, rank 1: 8)" in r["ag_bits_differ"][1]
        assert "layer_stats_every" in r["stats_every_bad_on_rank0"][1]
        assert "rank(s) [0]" in r["stats_every_bad_on_rank0"][1]
        assert r["twice"][0] == "ValueError" and "registered already" in r["twice"][1]
        assert "a LocalSGD state" in r["wrong_kind"][1] and "LocalSGD.load_state_dict" in r["wrong_kind"][1]
        assert r["trained_again"] == 1
    # the same message on every rank
    for key in ("ag_bits_bad_on_rank1", "ag_bits_differ", "stats_every_bad_on_rank0"):
        assert res[0][key] == res[1][key]
    assert res[0]["mismatch"] == res[1]["mismatch"]
    assert res[0]["bad_only_on_rank1"] == res[1]["bad_only_on_rank1"]
