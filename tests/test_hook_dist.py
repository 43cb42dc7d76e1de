"""The compressed all-reduce in real DDP runs: W gloo processes, real buckets, real optimizer steps."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers
from fastml_strategy import RECIPES

pytestmark = pytest.mark.timeout(240)


def _mlp(width: int = 128, depth: int = 3, dtype=torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, width), torch.nn.ReLU()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    layers.append(torch.nn.Linear(width, 10))
    return torch.nn.Sequential(*layers).to(dtype)


def _flat_params(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def _gather_equal(model, world_size: int) -> bool:
    flat = _flat_params(model)
    out = [torch.zeros_like(flat) for _ in range(world_size)]
    dist.all_gather(out, flat)
    return all(torch.equal(out[0], o) for o in out[1:])


def _train(rank, world_size, plan, steps=20, ddp_kwargs=None, accumulate=1, dtype=torch.float32,
           width=128, unused=False, min_numel=None):
    import fastml_strategy as fm

    model = _mlp(width, dtype=dtype)
    if unused:
        model = _WithUnused(model, width)
    ddp = DDP(model, bucket_cap_mb=0.02, **(ddp_kwargs or {}))
    if min_numel is not None:
        plan = fm.Plan.from_recipe(plan, min_numel=min_numel)
    state = fm.register_hook(ddp, plan=plan)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    start = _flat_params(model)
    gen = torch.Generator().manual_seed(1000 + rank)
    nbuckets = set()
    for _ in range(steps):
        for micro in range(accumulate):
            x = torch.randn(16, 32, generator=gen).to(dtype)
            y = torch.randint(0, 10, (16,), generator=gen)
            ctx = ddp.no_sync() if micro < accumulate - 1 else _nullcontext()
            with ctx:
                loss = torch.nn.functional.cross_entropy(ddp(x).float(), y)
                loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        nbuckets.add(len(state._engine.layouts))
    stats = state.stats()
    return {
        "identical": _gather_equal(model, world_size),
        "ratio": stats["compression_ratio"],
        "steps": stats["steps"],
        "buckets": max(nbuckets),
        "finite": bool(torch.isfinite(_flat_params(model)).all()),
        "loss": float(loss),
        "layers": stats["layers"],
        "moved": not torch.equal(start, _flat_params(model)),
        # bytes per step the codecs predict (headers and padding aside), and the measured ones
        "predicted_bytes": sum(row["bytes"] for row in stats["layers"].values()),
        "bytes_per_step": stats["bytes_sent"] / max(1, stats["steps"]),
        "codecs": sorted({row["codec"] for row in stats["layers"].values()}),
    }


class _WithUnused(torch.nn.Module):
    def __init__(self, body, width):
        super().__init__()
        self.body = body
        self.unused = torch.nn.Linear(width, width)  # never used in forward

    def forward(self, x):
        return self.body(x)


def _train_case(rank, world_size, case):
    return _train(rank, world_size, "int4", 8, **case)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("plan", ["int4", "topk1"])
def test_replicas_bit_identical(world_size, plan):
    results = run_workers(_train, world_size, plan, 20)
    for r in results:
        assert r["identical"], f"{plan} replicas diverged at W={world_size}"
        assert r["steps"] == 20
        assert r["buckets"] >= 3, "the model must span at least 3 DDP buckets"
        assert r["finite"]
        assert r["moved"], "the model must train (identical untrained replicas prove nothing)"
        assert RECIPES[plan].describe() in r["codecs"], f"{plan} must be on the wire, found {r['codecs']}"
        # the bytes on the wire are the codecs' prediction plus the 64-byte message headers and the
        # all_gather's padding to the largest chunk (chunks end on quantization blocks)
        overhead = r["bytes_per_step"] - r["predicted_bytes"]
        assert 0 <= overhead <= 2 * 64 * (world_size - 1) * r["buckets"] + 0.1 * r["predicted_bytes"], r


def test_world_size_one_runs_the_codec():
    (r,) = run_workers(_train, 1, "int4", 5)
    assert r["steps"] == 5 and r["finite"]
    assert r["ratio"] == 1.0  # no bytes on the wire at W=1


def _ratio_run(rank, world_size, plan):
    import fastml_strategy as fm

    torch.manual_seed(0)
    # Dominated by large layers: 3 x (512 x 512) weights; biases go uncompressed.
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                torch.nn.ReLU(), torch.nn.Linear(512, 512))
    ddp = DDP(model, bucket_cap_mb=1)
    state = fm.register_hook(ddp, plan=plan)
    for _ in range(3):
        ddp(torch.randn(8, 512)).square().mean().backward()
    s = state.stats()
    return s["compression_ratio"], s["bytes_sent"], s["bytes_uncompressed"]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_compression_ratio_quantized(world_size):
    r4 = run_workers(_ratio_run, world_size, "int4")
    r2 = run_workers(_ratio_run, world_size, "int2")
    for ratio, sent, unc in r4:
        assert ratio >= 7.0, ratio
        numel = 3 * (512 * 512 + 512)
        assert unc == round(3 * 2 * (world_size - 1) / world_size * 4 * numel)
    for ratio, _, _ in r2:
        assert ratio >= 13.0, ratio


def test_compression_ratio_topk_two_ranks():
    for ratio, _, _ in run_workers(_ratio_run, 2, "topk1"):
        assert ratio >= 40.0, ratio


@pytest.mark.parametrize(
    "case",
    [
        dict(ddp_kwargs={"find_unused_parameters": True}, unused=True),
        dict(ddp_kwargs={"static_graph": True}),
        dict(ddp_kwargs={"gradient_as_bucket_view": True}),
        dict(accumulate=3),
        dict(dtype=torch.bfloat16),
        dict(dtype=torch.float16),
    ],
    ids=["find_unused", "static_graph", "grad_as_bucket_view", "no_sync_accum", "bf16", "fp16"],
)
def test_ddp_features(case):
    for r in run_workers(_train_case, 2, case):
        assert r["identical"] and r["finite"] and r["steps"] == 8


def _uneven(rank, world_size):
    # Sizes not divisible by the world size or the block: 1000003-ish odd layers.
    import fastml_strategy as fm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(97, 1013), torch.nn.Tanh(), torch.nn.Linear(1013, 7))
    ddp = DDP(model, bucket_cap_mb=0.2)
    plan = fm.Plan.uniform(bits=3, block_size=64)
    fm.register_hook(ddp, plan=plan)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for i in range(6):
        torch.manual_seed(rank * 100 + i)
        ddp(torch.randn(5, 97)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return _gather_equal(model, world_size)


def test_odd_sizes_three_ranks():
    assert all(run_workers(_uneven, 3))


def _fp32_vs_plain(rank, world_size):
    # recipe "none" is DDP's own all-reduce: the same gradients, bit for bit, over several steps and
    # buckets, with one all-reduce per bucket issued from the hook (not FastML's communication thread)
    import fastml_strategy as fm

    outs, threads, stats, calls = [], set(), None, [0]
    real = dist.all_reduce

    def counted(*a, **k):
        threads.add(threading.current_thread().name)
        calls[0] += 1
        return real(*a, **k)

    for use in (False, True):
        model = _mlp(64)
        ddp = DDP(model, bucket_cap_mb=0.02)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if use:
            state = fm.register_hook(ddp, plan="none")
            dist.all_reduce = counted
        torch.manual_seed(rank)
        grads = []
        for _ in range(3):
            ddp(torch.randn(8, 32)).square().mean().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
            opt.step()
            opt.zero_grad()
        dist.all_reduce = real
        outs.append(torch.cat(grads))
        if use:
            stats = state.stats()
    return {"equal": torch.equal(outs[0], outs[1]), "threads": sorted(threads), "steps": stats["steps"],
            "ratio": stats["compression_ratio"], "sent": stats["bytes_sent"], "calls": calls[0],
            "numel": sum(p.numel() for p in model.parameters())}


def test_none_recipe_is_ddp():
    for out in run_workers(_fp32_vs_plain, 2):
        assert out["equal"], out
        assert out["threads"] == ["MainThread"], out  # never the fastml-comm thread
        assert out["steps"] == 3 and out["ratio"] == 1.0, out
        # one all-reduce per bucket and step, and more than one bucket (bucket_cap_mb=0.02: 11k
        # parameters; DDP rebuilds its buckets after the first step, so their count may change)
        assert 3 < out["calls"] <= 3 * out["numel"] * 4 / (0.02 * 2 ** 20) + 3, out
        # a ring all-reduce of fp32 with 2 ranks: 2 * (W - 1) / W * 4 bytes per element and step
        assert out["sent"] == 3 * 4 * out["numel"], out


def _quantized_grad_error(rank, world_size, recipe):
    # One step: the all-reduced gradient vs DDP's exact mean, against the int4 error bound.
    import fastml_strategy as fm

    grads = {}
    for use in (False, True):
        model = _mlp(256)
        ddp = DDP(model, bucket_cap_mb=0.05)
        if use:
            fm.register_hook(ddp, plan=fm.Plan.from_recipe(recipe))
        torch.manual_seed(rank)
        ddp(torch.randn(8, 32)).square().mean().backward()
        grads[use] = {n: p.grad.clone() for n, p in model.named_parameters()}
    rel = {n: float((grads[True][n] - grads[False][n]).norm() / grads[False][n].norm())
           for n in grads[False] if grads[False][n].numel() >= 4096}
    return rel


def test_one_step_error_is_small():
    for rel in run_workers(_quantized_grad_error, 2, "int8"):
        assert rel and max(rel.values()) < 0.02, rel


def _bad_plan(rank, world_size, kind):
    import fastml_strategy as fm

    ddp = DDP(_mlp(64), bucket_cap_mb=0.02)
    if kind == "bits":
        plan = {"format_version": 1, "default": {"codec": "quantize", "bits": 9}}
    elif kind == "missing_param":
        plan = fm.Plan.from_recipe("int4").with_layers({"encoder.weight": fm.RECIPES["int8"]})
    elif kind == "one_rank_bad":
        plan = "int4" if rank == 0 else "int99"
    elif kind == "different":
        plan = "int4" if rank == 0 else "int8"
    else:
        raise AssertionError(kind)
    try:
        fm.register_hook(ddp, plan=plan)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("kind,needle", [
    ("bits", "bits"),
    ("missing_param", "encoder.weight"),
    ("one_rank_bad", "int99"),
    ("different", "different plans"),
])
def test_bad_plan_fails_on_every_rank(kind, needle):
    msgs = run_workers(_bad_plan, 2, kind, timeout=90)
    assert msgs[0] == msgs[1], "every rank must raise the same error"
    assert needle in msgs[0], msgs[0]


def _overlap(rank, world_size):
    # Hold the first bucket's communication until backward has computed the gradient of the FIRST
    # layer (the last one backward reaches). If the hook communicated synchronously (blocking the
    # autograd thread), backward could never get there: the wait would time out.
    import threading

    import fastml_strategy as fm

    torch.manual_seed(0)
    # 1 MB + 4 MB + 40 KB of gradients: at least 3 buckets from the first iteration on
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = fm.register_hook(ddp, plan="int4")
    first_layer_done = threading.Event()
    model[0].weight.register_hook(lambda g: first_layer_done.set())
    waited = []
    start = state._engine.start

    def held_start(lay, buf, step, *a, **k):
        if step == 1 and not waited:  # the first bucket of the second step (after DDP's rebuild)
            waited.append(first_layer_done.wait(timeout=20))
        return start(lay, buf, step, *a, **k)

    state._engine.start = held_start
    for _ in range(2):
        first_layer_done.clear()
        ddp(torch.randn(8, 256)).square().mean().backward()
    return waited[0], len(state._engine.layouts)


def test_communication_overlaps_backward():
    for overlapped, buckets in run_workers(_overlap, 2, timeout=120):
        assert buckets >= 3
        assert overlapped, "bucket 0's all-reduce could not run while backward went on"


def _across_buckets(rank, world_size, defer):
    # Pipelining across buckets: with the next bucket already queued, a bucket's tail (its last
    # piece's decode) runs only once the next bucket's first message is on the wire (its `before`).
    # Backward is over before bucket 0 starts (held as in _overlap), so every bucket is queued.
    import fastml_strategy as fm

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 10))
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = fm.register_hook(ddp, plan="int4")
    if not defer:  # the runner then never sees a next bucket queued: every tail runs at once
        state._runner._queue.empty = lambda: True
    backward_done = threading.Event()
    model[0].weight.register_hook(lambda g: backward_done.set())
    log, start = [], state._engine.start

    def logged_start(lay, buf, step, layer_stats, checks, baseline_elem_size=4, before=None):
        n = len([e for e in log if e[0] == "start"])
        if step == 1 and n == 0:
            backward_done.wait(timeout=20)
        log.append(("start", n))

        def logged_before():
            log.append(("before", n))
            if before is not None:
                before()

        tail = start(lay, buf, step, layer_stats, checks, baseline_elem_size, before=logged_before)

        def logged_tail():
            log.append(("tail", n))
            tail()

        return logged_tail if tail is not None else None

    grads = []
    for step in range(2):
        if step == 1:
            state._engine.start = logged_start
        backward_done.clear()
        torch.manual_seed(rank + 10 * step)
        ddp(torch.randn(8, 256)).square().mean().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    return log, torch.cat(grads)


def test_a_bucket_is_decoded_while_the_next_one_is_on_the_wire():
    deferred = run_workers(_across_buckets, 2, True, timeout=120)
    at_once = run_workers(_across_buckets, 2, False, timeout=120)
    for (log, grads), (log0, grads0) in zip(deferred, at_once):
        n = len([e for e in log if e[0] == "start"])
        assert n >= 3, log
        # each bucket but the last: its tail right after the next bucket's first send
        for b in range(n - 1):
            i = log.index(("tail", b))
            assert log[i - 1] == ("before", b + 1), log
        assert log[-1] == ("tail", n - 1), log
        # without a queued successor, each tail follows its own bucket at once
        for b in range(n):
            assert log0.index(("tail", b)) < log0.index(("start", b + 1)) if b + 1 < n else True, log0
        # the same bytes decoded into the same buffers: the same gradients, bit for bit
        assert torch.equal(grads, grads0)
    assert torch.equal(deferred[0][1], deferred[1][1])  # and identical replicas


def _cycles(rank, world_size):
    import threading

    import fastml_strategy as fm
    from torch.distributed import distributed_c10d as c10d

    def counts():
        return threading.active_count(), len(c10d._world.pg_map)

    model = _mlp()
    before = None
    for i in range(10):
        ddp = DDP(model, bucket_cap_mb=0.02)
        state = fm.register_hook(ddp, plan="int4")
        loss = torch.nn.functional.cross_entropy(ddp(torch.randn(4, 32)), torch.randint(0, 10, (4,)))
        loss.backward()
        state.close()
        del ddp, state
        if i == 0:
            before = counts()
    return before, counts()


def test_register_close_cycles_leak_no_thread_or_group():
    """close() stops the communication thread and destroys FastML's own process group (Lightning's
    re-fit and the autotuner's measurements register again and again)."""
    for before, after in run_workers(_cycles, 2, timeout=120):
        assert after == before, (before, after)


def _advice_given(rank, world_size):
    # Python's own warning filters (a pool worker is a fresh `python`, no pytest filters): what a user
    # running a script sees, with logging left at its default (WARNING) level
    import warnings

    import fastml_strategy as fm
    from fastml_strategy import _advice

    _advice._GIVEN.clear()
    with warnings.catch_warnings(record=True) as caught:
        for view in (False, False, True):  # the advice comes once per job, not once per model
            fm.register_hook(DDP(_mlp(64), gradient_as_bucket_view=view), plan="int4")
        # every tensor under min_numel: int4 compresses nothing
        fm.register_hook(DDP(_mlp(32), gradient_as_bucket_view=True), plan="int4")
        # 8.4 MB of gradients in DDP's one default bucket: the bucket_cap_mb advice after step 1
        big = torch.nn.Linear(1024, 2048)
        ddp = DDP(big, gradient_as_bucket_view=True)
        fm.register_hook(ddp, plan="int4")
        for _ in range(2):
            ddp(torch.randn(2, 1024)).square().mean().backward()
    _advice._GIVEN.clear()
    texts = [str(w.message) for w in caught if issubclass(w.category, fm.FastMLAdvice)]
    return {"view": sum("gradient_as_bucket_view=True" in t for t in texts),
            "min_numel": sum("min_numel=4,096" in t for t in texts),
            "buckets": sum("bucket_cap_mb=" in t for t in texts),
            "percent": [t for t in texts if "%%" in t], "all": len(texts)}


def test_advice_is_shown_at_default_level_once_on_rank_0():
    res = run_workers(_advice_given, 2, timeout=180)
    assert res[0] == {"view": 1, "min_numel": 1, "buckets": 1, "percent": [], "all": 3}, res
    assert res[1] == {"view": 0, "min_numel": 0, "buckets": 0, "percent": [], "all": 0}, res


def _bucket_view_same(rank, world_size, recipe):
    # register_hook advises gradient_as_bucket_view=True: the gradients are then views into DDP's
    # buckets, which the hook all-reduces in place. Same training, bit for bit, with it and without.
    import fastml_strategy as fm

    out = {}
    for view in (False, True):
        model = _mlp(64)
        ddp = DDP(model, bucket_cap_mb=0.02, gradient_as_bucket_view=view)
        state = fm.register_hook(ddp, plan=recipe)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(rank)
        for _ in range(4):
            ddp(torch.randn(8, 32)).square().mean().backward()
            opt.step()
            opt.zero_grad()  # set_to_none: DDP hands the bucket views out again next step
        out[view] = (torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
                     {k: v.clone() for k, v in state.state_dict()["residuals"].items()})
    params_equal = torch.equal(out[False][0], out[True][0])
    res_equal = out[False][1].keys() == out[True][1].keys() and all(
        torch.equal(out[False][1][k], out[True][1][k]) for k in out[False][1])
    return params_equal, res_equal, len(out[True][1])


@pytest.mark.parametrize("recipe", ["int4", "topk1", "none"])
def test_gradient_as_bucket_view_trains_the_same(recipe):
    for params_equal, res_equal, residuals in run_workers(_bucket_view_same, 2, recipe):
        assert params_equal and res_equal, recipe
        assert (residuals > 0) == (recipe != "none")
