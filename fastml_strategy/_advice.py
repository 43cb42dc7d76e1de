"""Advice FastML gives once per job: what a user should change, either for speed (DDP's bucket size,
``gradient_as_bucket_view``) or for the compression to happen at all (a plan whose tensors all fall
under ``min_numel``).

How it is shown
---------------
Advice is a :class:`FastMLAdvice` warning, a ``UserWarning``, which Python shows with no
configuration at all (``logging`` INFO is hidden at Python's default level, so advice logged there
reaches nobody). It is given

- on rank 0 only (global rank; before ``init_process_group``, the process itself): every rank would
  print the same line;
- once per process and kind of advice (:func:`advise`'s ``kind``): a second model, a second
  ``register_hook`` or an adapter that already gave the same advice in its own words (the Trainer's
  ``ddp_bucket_cap_mb``, say) does not repeat it.

What needs no action (the plan summary, which ranks share a machine, the group's timeout) stays
``logging`` INFO: ``logging.getLogger("fastml_strategy").setLevel(logging.INFO)`` with a handler, or
``logging.basicConfig(level=logging.INFO)``, shows it. Silence advice with
``warnings.filterwarnings("ignore", category=fastml_strategy.FastMLAdvice)``.

The compression-share check (:func:`little_compressed`) is the advice every entry point shares: a
lossy plan that leaves (nearly) every gradient byte uncompressed because of ``min_numel`` (a LoRA
model's adapters, a small model) otherwise reports ``compression_ratio`` 1.0 and no word.
"""

from __future__ import annotations

import warnings
from typing import Iterable, Optional

__all__ = ["FastMLAdvice", "advise", "unactionable", "little_compressed", "LITTLE_COMPRESSED_SHARE"]

# Below this share of the trainable gradient bytes compressed, a lossy plan is advised about min_numel.
LITTLE_COMPRESSED_SHARE = 0.05

_GIVEN: set = set()  # kinds of advice given in this process


class FastMLAdvice(UserWarning):
    """What FastML advises a user to change (once per job, on rank 0): see :mod:`fastml_strategy._advice`."""


def _rank_zero() -> bool:
    try:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    except Exception:  # noqa: BLE001 - a torch without distributed: one process
        return True


def advise(kind: str, text: str, stacklevel: int = 2) -> bool:
    """Warn ``text`` as :class:`FastMLAdvice`, on rank 0, once per process for each ``kind``; returns
    whether it was shown (False on other ranks and for a kind already given)."""
    if kind in _GIVEN or not _rank_zero():
        return False
    _GIVEN.add(kind)
    warnings.warn(text, FastMLAdvice, stacklevel=stacklevel + 1)
    return True


def unactionable(kind: str) -> None:
    """Give no advice of ``kind`` in this process: for an adapter whose framework offers the user no
    way to act on it (Trainer builds DDP itself, and no ``TrainingArguments`` field sets
    ``gradient_as_bucket_view``)."""
    _GIVEN.add(kind)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def little_compressed(plan, params: Iterable, world_size: int, owner: str = "FastML") -> Optional[str]:
    """The advice about ``min_numel`` when a lossy ``plan`` compresses under
    :data:`LITTLE_COMPRESSED_SHARE` of the gradient bytes of ``params`` (``(name, parameter)`` pairs;
    frozen ones are skipped) *because* of ``min_numel``: the tensors it holds back would lift the share
    to at least that much. None otherwise (a plan whose own layers choose fp32 for most of the model
    says so itself)."""
    from fastml_strategy.codecs import effective_config

    total = compressed = 0
    held: list = []  # elements of each tensor min_numel holds back from a lossy codec
    for name, p in params:
        if not p.requires_grad:
            continue
        nbytes = p.numel() * p.element_size()
        total += nbytes
        if effective_config(plan.for_parameter(name, p.numel()), p.numel(), world_size, tuple(p.shape)).lossy:
            compressed += nbytes
        elif p.numel() < plan.min_numel and plan.for_parameter(name).lossy:
            held.append((p.numel(), nbytes))
    held_bytes = sum(b for _, b in held)
    if total == 0 or compressed >= LITTLE_COMPRESSED_SHARE * total or \
            compressed + held_bytes < LITTLE_COMPRESSED_SHARE * total:
        return None
    # the min_numel that compresses the largest held-back tensors, 90% of their bytes
    covered, fit = 0, 1
    for numel, nbytes in sorted(held, reverse=True):
        covered, fit = covered + nbytes, numel
        if covered >= 0.9 * held_bytes:
            break
    from fastml_strategy.config import RECIPES

    how = (f"Plan.from_recipe({plan.name!r}, min_numel={fit})" if plan.name in RECIPES
           else f"dataclasses.replace(plan, min_numel={fit})")
    return (f"{owner}: plan {plan.name!r} compresses {100.0 * compressed / total:.1f}% of this model's "
            f"gradient bytes: {_plural(len(held), 'tensor')} ({100.0 * held_bytes / total:.1f}% of the "
            f"bytes, {max(n for n, _ in held):,} elements at most) have fewer than "
            f"min_numel={plan.min_numel:,} elements and travel uncompressed, so compression_ratio stays "
            f"about 1 (LoRA adapters and small models do this). Lower min_numel to compress them: "
            f"{how}, or \"min_numel\": {fit} in the plan JSON (tensors that small save little each, so "
            f"check state.stats()['compression_ratio'])")
