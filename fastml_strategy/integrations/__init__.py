"""The framework adapters: Lightning and Fabric (:mod:`~fastml_strategy.integrations.lightning`),
Hugging Face Accelerate (:mod:`~fastml_strategy.integrations.accelerate`) and the Hugging Face
Trainer / TRL (:mod:`~fastml_strategy.integrations.transformers`).

Users import them by their public paths, ``fastml_strategy.lightning``, ``fastml_strategy.accelerate``
and ``fastml_strategy.transformers``: the same module objects as these. Nothing else in the package
imports an adapter (``import fastml_strategy`` imports the Lightning one only when Lightning was
already imported, to register the strategy names), and this package imports none of them on its own,
so ``import fastml_strategy`` stays free of Lightning, Accelerate and transformers.
"""
