"""Topology detection (fastml_strategy.topology): which ranks share a machine, from the explicit
setting, FASTML_RANKS_PER_NODE or the launcher's variables, and the errors for what cannot work."""

from __future__ import annotations

import pytest

from fastml_strategy.comm.topology import Topology, detect_ranks_per_node, topology_for


def test_sources_in_order():
    env = {"FASTML_RANKS_PER_NODE": "4", "LOCAL_WORLD_SIZE": "2", "SLURM_NTASKS_PER_NODE": "8"}
    assert detect_ranks_per_node(2, env) == (2, "ranks_per_node")
    assert detect_ranks_per_node(None, env) == (4, "FASTML_RANKS_PER_NODE")
    del env["FASTML_RANKS_PER_NODE"]
    assert detect_ranks_per_node(None, env) == (2, "LOCAL_WORLD_SIZE")
    del env["LOCAL_WORLD_SIZE"]
    assert detect_ranks_per_node(None, env) == (8, "SLURM_NTASKS_PER_NODE")
    assert detect_ranks_per_node(None, {"SLURM_TASKS_PER_NODE": "4(x3)"}) == (4, "SLURM_NTASKS_PER_NODE")
    assert detect_ranks_per_node(None, {"OMPI_COMM_WORLD_LOCAL_SIZE": "2"})[0] == 2
    assert detect_ranks_per_node(None, {}) == (1, "default")


def test_topology_of_a_rank():
    t = topology_for(5, 8, env={"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "1", "GROUP_RANK": "1"})
    assert t == Topology(8, 4, 2, 1, 1, "LOCAL_WORLD_SIZE") and t.hierarchical
    assert t.node_members(1) == [4, 5, 6, 7] and t.local_peers(1) == [1, 5]
    assert not topology_for(3, 4, env={"LOCAL_WORLD_SIZE": "4"}).hierarchical  # one machine
    assert not topology_for(3, 4, 1, env={"LOCAL_WORLD_SIZE": "2"}).hierarchical  # flat on request


@pytest.mark.parametrize("kw,env,words", [
    ({"explicit": 3}, {}, ["does not divide the world size 4", "ranks_per_node=R"]),
    ({"explicit": 0}, {}, ["ranks_per_node=0", "whole number >= 1"]),
    ({}, {"FASTML_RANKS_PER_NODE": "two"}, ["FASTML_RANKS_PER_NODE='two'"]),
    ({}, {"SLURM_TASKS_PER_NODE": "2(x1),1"}, ["different numbers of ranks", "ranks_per_node=1"]),
    # torchrun says rank 1 is local rank 0 of machine 1: its machines are not contiguous blocks
    ({}, {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0", "GROUP_RANK": "1"},
     ["LOCAL_RANK=0", "contiguous", "ranks_per_node=1"]),
])
def test_refusals_say_how_to_fix(kw, env, words):
    with pytest.raises(ValueError) as e:
        topology_for(1, 4, env=env, **kw)
    for w in words:
        assert w in str(e.value), str(e.value)
