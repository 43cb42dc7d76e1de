"""A ``fastml-autotune`` target for a Hugging Face ``Trainer``: the factory returns the ``Trainer`` your
training script builds (model, ``TrainingArguments``, dataset, collator), and the tuner takes the model,
the batches, the loss and the optimizer from it. Here: the tiny Llama of ``recipes/train_transformers.py``,
built from a config and trained byte by byte on Python's own ``argparse`` source (nothing downloaded)::

    fastml-autotune recipes/autotune_transformers.py:workload --link 1gbit --world-size 8 --target-steps 20000 --out tune-out
    torchrun --nproc_per_node 2 recipes/train_transformers.py --cpu --plan tune-out/plan.json

(under torchrun, ``torchrun --nproc_per_node 2 -m fastml_strategy.autotune.cli recipes/autotune_transformers.py:workload
--out tune-out`` measures the link instead of ``--link``). ``workload_bench`` is the larger model of
``benchmarks/bench_transformers.py`` (``train_transformers.py --width 256 --layers 4``).

The tuner calls the factory once per calibration run, so build everything afresh from fixed seeds (the
model under ``torch.manual_seed``, ``TrainingArguments(seed=...)``, which seeds Trainer's shuffling):
every run then starts from the same weights and sees the same batches. A factory may also return
``(model, train_dataset)`` or ``(model, train_dataset, data_collator)``: the tuner builds a ``Trainer``
with default ``TrainingArguments`` around them. What is and is not taken from the Trainer:
docs/autotune.md ("Hugging Face Trainer").
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_transformers import ByteText, tiny_model  # noqa: E402
from transformers import Trainer, TrainingArguments  # noqa: E402


def build_trainer(width: int = 128, layers: int = 2, seq: int = 64, batch_size: int = 8, gpt2: bool = False,
                  lr: float = 3e-3) -> Trainer:
    """The Trainer of ``recipes/train_transformers.py`` with its defaults (no FastML line: the tuner
    compresses the gradients itself)."""
    args = TrainingArguments(output_dir=os.path.join(tempfile.gettempdir(), "fastml-autotune-transformers"),
                             per_device_train_batch_size=batch_size,
                             learning_rate=lr, lr_scheduler_type="constant", seed=0, report_to="none",
                             save_strategy="no", disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    return Trainer(model=tiny_model(gpt2, width, layers, seq), args=args,
                   train_dataset=ByteText(argparse.__file__, seq))


def workload() -> Trainer:
    """``recipes/train_transformers.py``'s model: Llama, width 128, 2 layers (0.39M parameters)."""
    return build_trainer()


def workload_bench() -> Trainer:
    """``benchmarks/bench_transformers.py``'s model: Llama, width 256, 4 layers (2.75M parameters)."""
    return build_trainer(width=256, layers=4)
