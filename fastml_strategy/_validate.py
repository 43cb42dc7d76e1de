"""One home for checking the whole-number settings FastML takes (``every``, ``layer_stats_every``,
``check_replicas_every``...), given as arguments or through ``FASTML_*`` environment variables, and
for renamed keywords.

Every entry point (``register_hook``, ``fsdp.register``, ``LocalSGD``, the framework adapters, the
autotuner) checks with these, so a setting has one rule and one message wherever it is given::

    whole_number("every", every, 1, owner="LocalSGD")
        -> ValueError("LocalSGD: every=0; use a whole number >= 1")
    env_whole_number("FASTML_LAYER_STATS_EVERY", None, default=10)
        -> the argument if given, else the variable if set, else 10

A setting has one name: the keyword (``layer_stats_every``) and its variable (``FASTML_`` + the
keyword in capitals, ``FASTML_LAYER_STATS_EVERY``). An old keyword stays for a while through
:func:`renamed`, which warns.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

__all__ = ["whole_number", "env_whole_number", "renamed", "type_problem", "LAYER_STATS_EVERY", "LAYER_STATS_EVERY_LOCALSGD"]

# The defaults of ``layer_stats_every`` (``FASTML_LAYER_STATS_EVERY``): measuring a layer's compression
# error costs a decode and two passes over its gradient, so the per-step paths (the DDP hook, FSDP)
# measure every 10th step; LocalSGD synchronises once per H inner steps already, so it measures every
# synchronisation.
LAYER_STATS_EVERY = 10
LAYER_STATS_EVERY_LOCALSGD = 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def type_problem(value: Any, number: bool = False) -> str | None:
    """Why ``value`` is not a whole number (``number``: not a number at all), worded to follow a
    setting's name in an error (``bits must be an integer, got the string '4' ...``); None if it is
    one. A plan JSON that quotes a number (``"bits": "4"``) is refused, not read as 4: its author
    meant something, and a plan is compared byte for byte across ranks."""
    if _is_int(value) or (number and isinstance(value, float)):
        return None
    kind = "a number" if number else "an integer"
    if value is None:
        return "is None"
    if isinstance(value, str):
        return f"must be {kind}, got the string {value!r} (write it without quotes)"
    if isinstance(value, float):
        return f"must be an integer, got {value!r}"
    if isinstance(value, bool):
        return f"must be {kind}, got {value!r}"
    return f"must be {kind}, got a {type(value).__name__} ({value!r})"


def whole_number(name: str, value: Any, minimum: int = 1, *, owner: str | None = None, note: str = "") -> int:
    """``value`` if it is an int (not a bool) >= ``minimum``; else ValueError naming the setting and
    the fix, then ``note`` (``" (0 turns it off)"``)."""
    if _is_int(value) and value >= minimum:
        return value
    where = f"{owner}: " if owner else ""
    raise ValueError(f"{where}{name}={value!r}; use a whole number >= {minimum}{note}")


def env_whole_number(var: str, value: Any, default: int | None, minimum: int = 0, *,
                     owner: str | None = None) -> int | None:
    """The setting ``value`` when it is not None, else the environment variable ``var`` when it is set
    and not blank, else ``default``; checked by :func:`whole_number` (its name: ``var`` without
    ``FASTML_``, in lower case). A variable that is not a whole number raises ValueError naming it."""
    name = var.removeprefix("FASTML_").lower()
    if value is None:
        raw = os.environ.get(var, "").strip()
        if not raw:
            return default
        try:
            value = int(raw)
        except ValueError:
            off = ", or 0 to switch it off" if minimum == 0 else ""
            raise ValueError(f"{var}={raw!r} is not a whole number; set it to N >= {max(1, minimum)}{off}, "
                             f"or unset it") from None
        if value < minimum:
            raise ValueError(f"{var}={raw!r}; set it to a whole number >= {minimum}, or unset it")
    return whole_number(name, value, minimum, owner=owner, note=" (0 turns it off)" if minimum == 0 else "")


def renamed(owner: str, old: str, old_value: Any, new: str, new_value: Any, stacklevel: int = 3) -> Any:
    """The value of a setting whose keyword was renamed from ``old`` to ``new``: ``new_value``, or
    ``old_value`` (with a FutureWarning saying to use ``new``) when only the old keyword was given.
    Both given raises TypeError."""
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{owner}: {old}= and {new}= name the same setting; pass only {new}=")
    warnings.warn(f"{owner}: {old}= is deprecated and will be removed; pass {new}={old_value!r} instead "
                  f"(the same setting: the environment variable FASTML_{new.upper()})",
                  FutureWarning, stacklevel=stacklevel)
    return old_value
