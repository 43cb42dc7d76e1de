"""The error-feedback residuals of one engine, keyed by parameter name, and the layouts that hold them.

A residual lives inside the layout that encodes its parameter (:mod:`fastml_strategy.comm._layouts`: a view
of the layout's residual buffers, written by the encoder). Layouts change: DDP rebuilds its buckets
after the first iteration, a frozen layer joins later, FSDP builds a unit's layout at its first
reduce-scatter. The store keeps every residual across those changes:

- *adoption* (:meth:`ResidualStore.adopt`): a new layout takes the current residual of each of its
  parameters, from the layout that held it (which is dropped: it shares a parameter with the new one)
  or from those waiting;
- *waiting* residuals (:attr:`ResidualStore.pending`): loaded from a checkpoint, reserved before the
  first step (:meth:`ResidualStore.reserve`, so that a fresh state's ``state_dict()`` already has
  every entry), or left over by a dropped layout, until a layout of their parameter exists;
- *commit* (:meth:`ResidualStore.commit`): a double-buffered layout's encoder writes the new residuals
  into second buffers, which become the current ones only once the step is known to be finite, so a
  step that GradScaler skips leaves every residual as it was;
- *checkpoints*: :meth:`ResidualStore.residuals` (every residual, live or waiting, by name) and
  :meth:`ResidualStore.load`.
"""

from __future__ import annotations

import torch

__all__ = ["ResidualStore"]


class ResidualStore:
    """The layouts of one engine, by shape key, and the residuals they own or that wait for one."""

    def __init__(self) -> None:
        self.layouts: dict[tuple, object] = {}
        # residuals loaded or reserved before the layout that owns them exists, or left by a dropped one
        self.pending: dict[str, torch.Tensor] = {}

    def get(self, key: tuple):
        return self.layouts.get(key)

    def adopt(self, key: tuple, lay):
        """Keep ``lay`` under ``key``, after giving it the current residual of each of its parameters.
        Layouts sharing a parameter with it are stale (DDP rebuilt its buckets, a layer was frozen):
        they are dropped, and their other parameters' residuals wait for their new layout."""
        new = set(lay.names)
        old = self.residuals()
        for k in [k for k, v in self.layouts.items() if new & set(v.names)]:
            for name, view in self.layouts.pop(k).residual_views().items():
                if name not in new:
                    self.pending[name] = view
        for name, view in lay.residual_views().items():
            src = self.pending.pop(name, None)
            if src is None:
                src = old.get(name)
            if src is not None:
                view.copy_(src.reshape(-1).to(view.device))
        self.layouts[key] = lay
        return lay

    def reserve(self, name: str, numel: int, dtype: torch.dtype, device) -> None:
        """A zero residual for ``name``, waiting for its layout, unless it has one already."""
        if name not in self.pending and name not in self._live():
            self.pending[name] = torch.zeros(numel, dtype=dtype, device=device)

    @staticmethod
    def commit(lay) -> None:
        """Make the residuals the last encode of ``lay`` computed the current ones."""
        lay.commit_residuals()

    def _live(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for lay in self.layouts.values():
            out.update(lay.residual_views())
        return out

    def residuals(self) -> dict[str, torch.Tensor]:
        """Every residual by parameter name: the waiting ones and the layouts' (views)."""
        out = dict(self.pending)
        out.update(self._live())
        return out

    def nbytes(self) -> int:
        """Bytes of error-feedback memory held (both buffers of a double-buffered layout)."""
        return sum(lay.residual_nbytes() for lay in self.layouts.values()) + sum(
            t.numel() * t.element_size() for t in self.pending.values())

    def load(self, residuals: dict[str, torch.Tensor]) -> None:
        """Copy saved residuals into the live layouts; the others wait for their layout."""
        live = self._live()
        for name, t in residuals.items():
            if name in live:
                live[name].copy_(t.reshape(-1).to(live[name].device))
            else:
                self.pending[name] = t.detach().reshape(-1).clone()
