"""FastML over the model patterns users train (a matrix of them), in one pair of real gloo processes.

For every pattern, from the same start and the same data: plain DDP, DDP + FastML ``none`` (must equal
DDP within 1e-6; it is DDP's own all-reduce there), and DDP + FastML ``int4`` and ``lowrank2`` (PowerSGD)
with every tensor compressed (replicas must stay bit-identical).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from _dist import run_workers

pytestmark = pytest.mark.timeout(240)

STEPS = 4


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(40, 16)
        self.mid = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 40, bias=False)
        self.head.weight = self.tok.weight  # GPT-style weight tying

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.tok(x).mean(1))))


class Branchy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)
        self.extra = torch.nn.Linear(16, 4)

    def forward(self, x, branch=False):
        h = torch.relu(self.a(x))
        return self.b(h) + (self.extra(h) if branch else 0)


class SparseEmb(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32, sparse=True)
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.head(self.emb(x).mean(1))


class Conv(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.c2(torch.relu(self.c1(x)))).mean((2, 3)))


def _mlp(dtype=torch.float32):
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).to(dtype)


# name -> (model factory, input maker(gen, dtype), DDP kwargs, options)
PATTERNS = {
    "tied": (Tied, lambda g: torch.randint(0, 40, (6, 5), generator=g), {}, {"plan_alias": "head.weight"}),
    "frozen-then-unfrozen": (_mlp, lambda g: torch.randn(6, 8, generator=g), {}, {"unfreeze": True}),
    "unused-branch": (Branchy, lambda g: torch.randn(6, 8, generator=g), {"find_unused_parameters": True},
                      {"branch": True}),
    "sparse-embedding": (SparseEmb, lambda g: torch.randint(0, 50, (6, 3), generator=g), {}, {}),
    "bf16-model": (lambda: _mlp(torch.bfloat16), lambda g: torch.randn(6, 8, generator=g).bfloat16(), {}, {}),
    # with `none`, gradients beyond fp32's range (1e40): DDP keeps them, so must FastML's none
    "float64-model": (lambda: _mlp(torch.float64), lambda g: torch.randn(6, 8, generator=g).double(), {},
                      {"scale": 1e40}),
    "no_sync": (_mlp, lambda g: torch.randn(6, 8, generator=g), {}, {"accumulate": 2}),
    "static_graph": (_mlp, lambda g: torch.randn(6, 8, generator=g), {"static_graph": True}, {}),
    "gradient_as_bucket_view": (_mlp, lambda g: torch.randn(6, 8, generator=g),
                                {"gradient_as_bucket_view": True}, {}),
    "channels_last-conv": (lambda: Conv().to(memory_format=torch.channels_last),
                           lambda g: torch.randn(4, 3, 6, 6, generator=g).to(memory_format=torch.channels_last),
                           {}, {}),
    "single-tiny-layer": (lambda: torch.nn.Linear(3, 2), lambda g: torch.randn(6, 3, generator=g), {}, {}),
    "regex-matches-nothing": (_mlp, lambda g: torch.randn(6, 8, generator=g), {},
                              {"plan_regex": "re:decoder\\..*"}),
}


def _train(rank, name, recipe):
    """One run of a pattern; recipe None is plain DDP. Returns (flat parameters, warnings, stats)."""
    import fastml_strategy as fm

    make, inputs, ddp_kw, opt_kw = PATTERNS[name]
    torch.manual_seed(0)
    model = make()
    if opt_kw.get("unfreeze"):
        model[2].weight.requires_grad_(False)
    plan = None
    if recipe is not None:
        plan = fm.Plan.from_recipe(recipe, min_numel=0)
        if recipe == "none":  # FastML's none must be DDP: no per-layer setting
            pass
        elif "plan_alias" in opt_kw:
            plan = plan.with_layers({opt_kw["plan_alias"]: fm.RECIPES["int8"]})
        if "plan_regex" in opt_kw and recipe != "none":
            plan = plan.with_layers({opt_kw["plan_regex"]: fm.RECIPES["int8"]})
    caught: list[str] = []

    def wrap(state_dict=None):
        ddp = DDP(model, **ddp_kw)
        if plan is None:
            return ddp, None
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            state = fm.register_hook(ddp, plan=plan)
        caught.extend(str(x.message) for x in w if "FastML" in str(x.message))
        if state_dict is not None:
            state.load_state_dict(state_dict, strict=False)  # the parameters that train changed
        return ddp, state

    ddp, state = wrap()
    # a lossy codec encodes float64 from fp32 (values past 3.4e38 are not representable): the scaled
    # case is for the exact paths only
    scale = opt_kw.get("scale", 1.0) if recipe in (None, "none") else 1.0
    opt = torch.optim.SGD(model.parameters(), lr=0.05 / scale)
    gen = torch.Generator().manual_seed(100 + rank)
    for step in range(STEPS):
        if opt_kw.get("unfreeze") and step == STEPS // 2:
            # DDP fixes the parameters it reduces at construction: unfreezing means wrapping again
            model[2].weight.requires_grad_(True)
            saved = state.state_dict() if state is not None else None
            if state is not None:
                state.close()
            ddp, state = wrap(saved)
        for micro in range(opt_kw.get("accumulate", 1)):
            last = micro == opt_kw.get("accumulate", 1) - 1
            ctx = ddp.no_sync() if not last else torch.enable_grad()
            with ctx:
                kw = {"branch": rank == 0 and step % 2 == 0} if opt_kw.get("branch") else {}
                out = ddp(inputs(gen), **kw)
                (out.square().mean() * scale).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    stats = state.stats() if state is not None else None
    if state is not None:
        state.close()
    return flat.tolist(), caught, stats


def _all_patterns(rank, world_size):
    out = {}
    for name in PATTERNS:
        try:
            out[name] = {recipe: _train(rank, name, recipe) for recipe in (None, "none", "int4", "lowrank2")}
        except Exception as e:  # noqa: BLE001 - reported per pattern
            out[name] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_all_patterns, 2, timeout=220)


@pytest.mark.parametrize("name", list(PATTERNS))
def test_pattern(results, name):
    per_rank = [r[name] for r in results]
    for r in per_rank:
        assert not isinstance(r, str), r
    ddp = torch.tensor(per_rank[0][None][0])
    none = torch.tensor(per_rank[0]["none"][0])
    assert torch.isfinite(ddp).all() == torch.isfinite(none).all()
    diff = float((ddp - none).abs().max())
    assert diff <= 1e-6 * max(1.0, float(ddp.abs().max())), (name, diff)
    # a lossy plan: replicas bit-identical
    assert per_rank[0]["int4"][0] == per_rank[1]["int4"][0], name
    assert per_rank[0]["lowrank2"][0] == per_rank[1]["lowrank2"][0], name
    assert torch.isfinite(torch.tensor(per_rank[0]["lowrank2"][0])).all(), name
    assert per_rank[0]["none"][0] == per_rank[1]["none"][0], name
    warned = per_rank[0]["int4"][1]
    if name == "regex-matches-nothing":
        assert any("re:decoder" in w and "matches no parameter" in w for w in warned), warned
    if name == "tied":
        assert any("'head.weight' is another name of 'tok.weight'" in w for w in warned), warned
        assert per_rank[0]["int4"][2]["layers"]["tok.weight"]["codec"] == "int8"
        assert per_rank[0]["lowrank2"][2]["layers"]["mid.weight"]["codec"] == "lowrank2"
    if name == "sparse-embedding":
        assert any("sparse gradients" in w and "emb.weight" in w for w in warned), warned
    if name == "float64-model":
        assert torch.isfinite(none).all()  # 1e40-scaled float64 gradients stay finite through `none`
