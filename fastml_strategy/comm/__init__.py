"""The communication engine: FastML's compressed collectives and what the ranks agree on around them.

Every module here issues (or prepares) collectives over ``torch.distributed``; none knows a training
mode or a framework. The engines above (:mod:`fastml_strategy.hook` for DDP, :mod:`fastml_strategy.fsdp`,
:mod:`fastml_strategy.localsgd`) build on them; they build on the codecs (:mod:`fastml_strategy.codecs`),
the plans (:mod:`fastml_strategy.config`) and the tensor-free layouts (:mod:`fastml_strategy.wire`).

- :mod:`~fastml_strategy.comm.collective`: ``CompressedAllReduce``, the all-reduce of one DDP bucket
  (ring scatter-reduce-allgather, or halving through ``_halving``); ``_lowrank`` its low-rank rounds
- :mod:`~fastml_strategy.comm.hierarchical`: the bucket on N machines x R ranks;
  :mod:`~fastml_strategy.comm.topology` which ranks share a machine
- ``_reduce_scatter``: FSDP's compressed reduce-scatter; ``_exchange`` the chunk exchange it shares
  with the all-reduce
- ``_layouts``: the tensor views of the ``wire`` layouts; ``_residuals`` the error-feedback residuals
  they hold; ``_status`` the 64-byte header and the step's checks
- ``_distributed``: what ranks agree on before the first step (plan, machines, build);
  ``_peers`` the failure channel that tells every rank that one failed

Public: ``collective``, ``hierarchical`` and ``topology`` (also importable by their old paths,
``fastml_strategy.collective`` and so on, as the same module objects). This package imports nothing
on its own: ``import fastml_strategy`` loads what the hook needs.
"""
