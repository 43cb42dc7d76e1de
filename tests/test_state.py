"""FastMLState checkpoints: residuals, step counter and plan round-trip, and resuming is bit-exact."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers

pytestmark = pytest.mark.timeout(180)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128),
                               torch.nn.ReLU(), torch.nn.Linear(128, 10))


def _steps(ddp, opt, start, stop, rank):
    for i in range(start, stop):
        g = torch.Generator().manual_seed(rank * 1000 + i)
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)


def _resume(rank, world_size, plan, path):
    import fastml_strategy as fm

    # 20 steps straight
    m1 = _model()
    d1 = DDP(m1, bucket_cap_mb=0.02)
    fm.register_hook(d1, plan=plan)
    o1 = torch.optim.SGD(d1.parameters(), lr=0.05, momentum=0.9)
    _steps(d1, o1, 0, 20, rank)

    # 10 steps, checkpoint (every rank's FastML state), new model/optimizer/hook, resume to 20
    m2 = _model()
    d2 = DDP(m2, bucket_cap_mb=0.02)
    s2 = fm.register_hook(d2, plan=plan)
    o2 = torch.optim.SGD(d2.parameters(), lr=0.05, momentum=0.9)
    _steps(d2, o2, 0, 10, rank)
    full = s2.state_dict(all_ranks=True)
    if rank == 0:
        torch.save({"model": m2.state_dict(), "opt": o2.state_dict(), "fastml": full}, path)
    dist.barrier()
    s2.close()
    ck = torch.load(path, weights_only=False)
    m3 = _model()
    m3.load_state_dict(ck["model"])
    d3 = DDP(m3, bucket_cap_mb=0.02)
    s3 = fm.register_hook(d3, plan=plan)
    s3.load_state_dict(ck["fastml"])
    o3 = torch.optim.SGD(d3.parameters(), lr=0.05, momentum=0.9)
    o3.load_state_dict(ck["opt"])
    nres = len(s3.state_dict()["residuals"])
    _steps(d3, o3, 10, 20, rank)
    same = all(torch.equal(a, b) for a, b in zip(m1.parameters(), m3.parameters()))
    return same, s3.step, nres


@pytest.mark.parametrize("plan", ["int4", "int4-sr", "topk1-int4"])
def test_resume_is_bit_exact(plan, tmp_path):
    for same, step, nres in run_workers(_resume, 2, plan, str(tmp_path / "ck.pt")):
        assert step == 20
        assert nres > 0, "residuals must be part of the state"
        assert same, f"{plan}: resumed run differs from the straight run"


def test_state_dict_rejects_wrong_world_size():
    import fastml_strategy as fm

    sd = {"format_version": 1, "per_rank": [{}, {}, {}]}

    class _S(fm.FastMLState):
        def __init__(self):  # no process group needed for this check
            self.world_size, self.rank, self._saved = 2, 0, None

    with pytest.raises(ValueError, match="3 ranks but this run has 2"):
        _S().load_state_dict(sd)


def _mismatches(rank, world_size):
    import fastml_strategy as fm

    out = {}
    d = DDP(_model(), bucket_cap_mb=0.02)
    s = fm.register_hook(d, plan="int4")
    o = torch.optim.SGD(d.parameters(), lr=0.05)
    _steps(d, o, 0, 2, rank)
    own = s.state_dict()

    def attempt(key, sd, **kw):
        try:
            s.load_state_dict(sd, **kw)
            out[key] = None
        except ValueError as e:
            out[key] = str(e)

    attempt("other_world", dict(own, world_size=8, rank=5))
    attempt("other_rank", dict(own, rank=1 - rank))
    int8 = fm.Plan.from_recipe("int8").to_dict()
    attempt("other_plan", dict(own, plan=int8))
    bad = dict(own["residuals"])
    bad["2.weight"] = torch.zeros(7)
    attempt("wrong_shape", dict(own, residuals=bad))
    attempt("unknown_param", dict(own, residuals={**own["residuals"], "nope.weight": torch.zeros(3)}))
    step_before = s.step
    attempt("other_plan_loose", dict(own, plan=int8), strict=False)
    out["step_after_loose"] = (step_before, s.step)
    # after every refusal the hook still trains
    _steps(d, o, 2, 3, rank)
    out["steps"] = s.step
    return out


def test_load_state_dict_names_every_mismatch_before_loading():
    for r in run_workers(_mismatches, 2):
        assert "saved by a run of 8 ranks, this run has 2" in r["other_world"]
        assert "this is rank" in r["other_rank"] and "state_dict(all_ranks=True)" in r["other_rank"]
        assert "saved with plan 'int8'" in r["other_plan"] and "strict=False" in r["other_plan"]
        assert "'2.weight' has 7 elements" in r["wrong_shape"]
        assert "'nope.weight'" in r["unknown_param"] and "no such parameter" in r["unknown_param"]
        assert r["other_plan_loose"] is None  # strict=False loads (with a warning)
        assert r["steps"] == 3


def _pickled(rank, world_size):
    import pickle

    import fastml_strategy as fm

    model = _model()
    ddp = DDP(model, bucket_cap_mb=0.02)
    state = fm.register_hook(ddp, plan="int4", layer_stats_every=3)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    _steps(ddp, opt, 0, 4, rank)
    saved, stats = state.state_dict(), state.stats()
    back = pickle.loads(pickle.dumps(state))
    out = {
        "step": back.step, "plan": back.plan == state.plan, "every": back.layer_stats_every,
        "stats_equal": {k: back.stats()[k] == stats[k] for k in ("steps", "bytes_sent", "bytes_uncompressed",
                                                              "compression_ratio", "plan")},
        "residuals_equal": saved["residuals"].keys() == back.state_dict()["residuals"].keys() and all(
            torch.equal(saved["residuals"][k], back.state_dict()["residuals"][k]) for k in saved["residuals"]),
    }
    # a detached state cannot run the hook: the error says what to do instead
    d2 = DDP(_model(), bucket_cap_mb=0.02)
    d2.register_comm_hook(back, fm.hook._fastml_hook)
    try:
        _steps(d2, torch.optim.SGD(d2.parameters(), lr=0.05), 0, 1, rank)
        out["hook_error"] = None
    except RuntimeError as e:
        out["hook_error"] = str(e)
    # ... and what it says works: a new hook resumes from the unpickled state, bit-exactly
    d3 = DDP(_model(), bucket_cap_mb=0.02)
    s3 = fm.register_hook(d3, plan=back.plan)
    s3.load_state_dict(back.state_dict())
    out["resumed"] = s3.step == 4 and all(torch.equal(s3.state_dict()["residuals"][k], v)
                                          for k, v in saved["residuals"].items())
    for s in (state, s3):
        s.close()
    return out


def test_pickle_round_trip_keeps_the_checkpoint_and_refuses_to_run():
    for r in run_workers(_pickled, 2):
        assert r["step"] == 4 and r["plan"] and r["every"] == 3
        assert all(r["stats_equal"].values()), r["stats_equal"]
        assert r["residuals_equal"]
        assert r["hook_error"] is not None and "was unpickled" in r["hook_error"], r["hook_error"]
        assert "load_state_dict" in r["hook_error"]
        assert r["resumed"]
