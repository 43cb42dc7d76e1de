"""A 4-block byte-level GPT (3.3M parameters, 54 tensors) as a ``fastml-autotune`` target, for
timing the tuner and for ``bench_autotune``-style comparisons on a transformer.

    fastml-autotune benchmarks/gpt_workload.py:make --link 50mbit --world-size 2

Model: token + position embeddings (256 bytes x 256, 128 positions x 256), 4 pre-LN blocks of causal
attention (4 heads) and a 4x GELU MLP, a final LayerNorm and an untied head. Data: a synthetic byte
language (each byte followed by one of 4 fixed successors, so the loss falls from ln 256 towards
ln 4), drawn from a ``torch.Generator`` the factory owns (one seed per rank), as a streaming dataset
would: the batches replay only because the tuner rebuilds the workload from this factory for every
calibration run. Batch 8 x 64 tokens, AdamW lr 1e-3; the eval function is none (accuracy loss =
relative final loss). ``bench_autotune.py --workload gpt`` trains it to a validation loss.

``make2`` is a second transformer for the same comparisons: 6 blocks of d=192, a
128-token language with unequally likely successors, context 48, batch 12, NAdam 2e-3 (see
``VOCAB2`` ...);
``bench_autotune.py --workload gpt2``.

``make3`` is a third, wider and shallower one for issue 38's repeated default runs: 3 blocks of
d=320 (5 heads) on the first workload's byte language, context 64, batch 8, AdamW 1e-3 (3.9M
parameters in 42 tensors); ``bench_autotune.py --workload gpt3``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fastml_strategy.autotune import Workload

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 256, 256, 4, 4, 64, 8


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embeddings, ``layers`` pre-LN blocks, a final LayerNorm and an untied head
    (``bench_fsdp.py`` and ``bench_localsgd.py`` build theirs from this class too)."""

    def __init__(self, layers: int = LAYERS, d: int = D, heads: int = HEADS, vocab: int = VOCAB,
                 positions: int = 2 * SEQ, head_bias: bool = True) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(positions, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=head_bias)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def _successors() -> torch.Tensor:
    """The byte language: each byte is followed by one of 4 fixed successors (loss floor ln 4)."""
    return torch.randint(VOCAB, (VOCAB, 4), generator=torch.Generator().manual_seed(1234))


def batch_stream(seed: int, batch: int = BATCH):
    """An endless stream of (input, next-byte) batches of the byte language, from a generator seeded
    with ``seed`` (the stream replays exactly for the same seed)."""
    succ = _successors()
    gen = torch.Generator().manual_seed(seed)
    while True:
        yield language_batch(succ, gen, batch, SEQ)


def language_batch(succ: torch.Tensor, gen: torch.Generator, batch: int, seq: int):
    """One (input, next-token) batch of the language whose token t is followed by one of
    ``succ[t]`` (a first token, then a successor picked uniformly each step), drawn from ``gen``."""
    toks = torch.empty(batch, seq + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(succ.shape[0], (batch,), generator=gen)
    pick = torch.randint(succ.shape[1], (batch, seq), generator=gen)
    for i in range(seq):
        toks[:, i + 1] = succ[toks[:, i], pick[:, i]]
    return toks[:, :-1], toks[:, 1:]


def loss_fn(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(m(x).reshape(-1, VOCAB), y.reshape(-1))


@torch.no_grad()
def validation_loss(m: nn.Module, batches: list) -> float:
    """Mean loss over held-out ``batches`` (the same on every rank, so replicas agree on it)."""
    return sum(float(loss_fn(m, b)) for b in batches) / len(batches)


# -- the second workload: another width, depth, language and optimizer ----------------------
# 6 blocks of d=192 (6 heads); a 128-token language whose successors are not equally likely (each
# token is followed by one of 3 fixed successors with probabilities 0.6, 0.3, 0.1: loss floor 0.90
# nats, against the first workload's 256 tokens, 4 equal successors, ln 4); context 48, batch 12;
# NAdam 2e-3 (Nesterov momentum, no decoupled weight decay) against AdamW 1e-3: 2.7M parameters in
# 78 tensors.
VOCAB2, D2, HEADS2, LAYERS2, SEQ2, BATCH2 = 128, 192, 6, 6, 48, 12
SUCCESSOR_P2 = (0.6, 0.3, 0.1)


def _successors2() -> torch.Tensor:
    """The second language: ``succ[a]`` holds the 3 tokens that may follow ``a``, likeliest first."""
    return torch.randint(VOCAB2, (VOCAB2, len(SUCCESSOR_P2)), generator=torch.Generator().manual_seed(4321))


def batch_stream2(seed: int, batch: int = BATCH2):
    """An endless stream of (input, next-token) batches of the second language, from a generator
    seeded with ``seed`` (the stream replays exactly for the same seed)."""
    succ = _successors2()
    probs = torch.tensor(SUCCESSOR_P2)
    gen = torch.Generator().manual_seed(seed)
    while True:
        toks = torch.empty(batch, SEQ2 + 1, dtype=torch.long)
        toks[:, 0] = torch.randint(VOCAB2, (batch,), generator=gen)
        pick = torch.multinomial(probs, batch * SEQ2, replacement=True, generator=gen).view(batch, SEQ2)
        for i in range(SEQ2):
            toks[:, i + 1] = succ[toks[:, i], pick[:, i]]
        yield toks[:, :-1], toks[:, 1:]


def loss_fn2(m: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(m(x).reshape(-1, VOCAB2), y.reshape(-1))


@torch.no_grad()
def validation_loss2(m: nn.Module, batches: list) -> float:
    """Mean loss of the second workload over held-out ``batches``."""
    return sum(float(loss_fn2(m, b)) for b in batches) / len(batches)


def gpt2_model() -> GPT:
    """The second workload's model (seeded: every rank and run builds the same weights)."""
    torch.manual_seed(0)
    return GPT(layers=LAYERS2, d=D2, heads=HEADS2, vocab=VOCAB2, positions=2 * SEQ2)


def gpt2_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.NAdam(params, lr=2e-3)


def make2() -> Workload:
    """The second workload as a ``fastml-autotune`` target (``benchmarks/gpt_workload.py:make2``)."""
    import torch.distributed as dist

    model = gpt2_model()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return Workload(model=model, batches=lambda: batch_stream2(11 + 1000 * rank), loss_fn=loss_fn2,
                    optimizer=gpt2_optimizer, name="gpt2-2.8m")


def make() -> Workload:
    import torch.distributed as dist

    torch.manual_seed(0)
    model = GPT()
    # the workload's own stream of batches, one per rank (a simulated world size replays rank 0's)
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return Workload(model=model, batches=lambda: batch_stream(7 + 1000 * rank), loss_fn=loss_fn,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), name="gpt-3.3m")


# -- the third workload: wider and shallower (issue 38) -----------------------------------------------
# 3 blocks of d=320 (5 heads) on the byte language of the first workload, batch 8 x 64 tokens, AdamW
# 1e-3: 3.9M parameters in 42 tensors, against the first's 4 blocks of d=256 and the second's 6 of 192.
LAYERS3, D3, HEADS3 = 3, 320, 5


def gpt3_model() -> GPT:
    """The third workload's model (seeded: every rank and run builds the same weights)."""
    torch.manual_seed(0)
    return GPT(layers=LAYERS3, d=D3, heads=HEADS3)


def make3() -> Workload:
    """The third workload as a ``fastml-autotune`` target (``benchmarks/gpt_workload.py:make3``)."""
    import torch.distributed as dist

    model = gpt3_model()
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return Workload(model=model, batches=lambda: batch_stream(13 + 1000 * rank), loss_fn=loss_fn,
                    optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), name="gpt3-3.9m")
