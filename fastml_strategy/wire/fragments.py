"""LocalSGD's fragments, without tensors: which consecutive parameters synchronise together
(:class:`fastml_strategy.LocalSGD` with ``fragments=F``, Streaming DiLoCo's staggered outer syncs).
Each fragment's outer all-reduce is one bucket of the compressed all-reduce
(:func:`fastml_strategy.wire.bucket_wire`); the cost model prices it so."""

from __future__ import annotations

from typing import Sequence

__all__ = ["split_fragments"]


def split_fragments(numels: Sequence[int], fragments: int) -> list[list[int]]:
    """The parameters (by index; ``numels``: their sizes, in model order) of each of ``fragments``
    fragments: consecutive runs of about equal size, every fragment at least one parameter while
    there are enough."""
    total = sum(numels)
    out: list = []
    cur: list = []
    acc = 0
    for i, n in enumerate(numels):
        cur.append(i)
        acc += n
        left_params, left_frags = len(numels) - i - 1, fragments - len(out) - 1
        if left_frags > 0 and (acc >= total * (len(out) + 1) / fragments or left_params == left_frags):
            out.append(cur)
            cur = []
    out.append(cur)
    return out
