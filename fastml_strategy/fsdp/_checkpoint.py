"""FastML's FSDP state in a distributed checkpoint (``torch.distributed.checkpoint``): every rank's
residuals under its own key, the rest one JSON string (:func:`save_distributed`,
:func:`load_distributed`)."""

from __future__ import annotations

import json
from typing import Any, Optional

import torch
import torch.distributed as dist

_TENSOR_KEY = "__fastml_tensor__"  # how a tensor is referenced inside the JSON skeleton


def _dcp_encode(own: dict) -> dict:
    """One rank's state as DCP keeps it: every tensor under ``tensors/<path>``, the rest one JSON
    string (DCP would drop empty dicts and split the plan into one entry per field)."""
    tensors: dict = {}

    def enc(x: Any, path: tuple) -> Any:
        if isinstance(x, torch.Tensor):
            key = "/".join(path)
            tensors[key] = x
            return {_TENSOR_KEY: key}
        if isinstance(x, dict):
            return {str(k): enc(v, path + (str(k),)) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [enc(v, path + (str(i),)) for i, v in enumerate(x)]
        return x

    return {"state": json.dumps(enc(own, ())), "tensors": tensors}


def _dcp_decode(state: str, tensors: dict) -> dict:
    def dec(x: Any) -> Any:
        if isinstance(x, dict):
            if set(x) == {_TENSOR_KEY}:
                return tensors[x[_TENSOR_KEY]]
            return {k: dec(v) for k, v in x.items()}
        if isinstance(x, list):
            return [dec(v) for v in x]
        return x

    return dec(json.loads(state))


CHECKPOINT_KEY = "fastml"



def save_distributed(state: "FSDPState", checkpoint_id) -> None:
    """Write every rank's FastML state into the distributed checkpoint folder ``checkpoint_id`` (a
    collective: call on every rank)."""
    import torch.distributed.checkpoint as dcp

    dcp.save({CHECKPOINT_KEY: state.distributed_state_dict()}, checkpoint_id=checkpoint_id)


def load_distributed(checkpoint_id) -> Optional[dict]:
    """This rank's FastML state from a folder written by :func:`save_distributed` (a collective), as
    :meth:`FSDPState.load_state_dict` takes it, or None if the folder holds no checkpoint. Needs no
    live state (the template comes from the checkpoint's own metadata), and raises ValueError naming
    the fix if the checkpoint holds another number of ranks."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not os.path.isfile(os.path.join(str(checkpoint_id), ".metadata")):
        return None
    rank, world_size = dist.get_rank(), dist.get_world_size()
    meta = FileSystemReader(str(checkpoint_id)).read_metadata()
    paths = {fqn: tuple(p) for fqn, p in (meta.planner_data or {}).items() if p and p[0] == CHECKPOINT_KEY}
    ranks = {p[1] for p in paths.values()}
    mine = f"rank{rank}"
    if len(ranks) != world_size or mine not in ranks:
        raise ValueError(
            f"the checkpoint {checkpoint_id} holds the FastML state of {len(ranks)} ranks, this run has "
            f"{world_size}: error-feedback residuals belong to one rank's shard. Resume with the same "
            f"number of processes and mesh, or delete {checkpoint_id} to start the residuals from zero")
    template: dict = {}
    for fqn, p in paths.items():
        if p[1] == mine:
            item = meta.state_dict_metadata[fqn]
            template[fqn] = (torch.empty(item.size, dtype=item.properties.dtype)
                             if isinstance(item, TensorStorageMetadata) else None)
    dcp.load(template, checkpoint_id=checkpoint_id)
    state, tensors = None, {}
    for fqn, p in paths.items():
        if p[1] == mine and p[2] == "state":
            state = template[fqn]
        elif p[1] == mine and p[2] == "tensors":
            tensors["/".join(p[3:])] = template[fqn]
    if state is None:
        raise ValueError(f"the checkpoint {checkpoint_id} has no FastML state for {mine}; it was not "
                         f"written by fastml_strategy.fsdp.save_distributed")
    return _dcp_decode(state, tensors)


