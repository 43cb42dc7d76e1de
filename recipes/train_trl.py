"""TRL's ``SFTTrainer`` with a PEFT LoRA adapter and FastML: supervised fine-tuning of a tiny Llama built
from a config, on text that ships with Python (the docstrings of the standard library's ``argparse``
module), with a word-level tokenizer built here. Nothing is downloaded from a hub.

The FastML part is the same one line as for ``transformers.Trainer``::

    trainer = SFTTrainer(model=model, args=sft_config, train_dataset=ds, processing_class=tokenizer,
                         peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    fastml_strategy.transformers.setup(trainer, plan=plan)
    trainer.train()

Only the adapters train, so only their gradients travel; plan names are the names that
``trainer.model.named_parameters()`` shows (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.
default.weight``...). LoRA matrices are small (r x width), under the default plan's ``min_numel`` of
4096 elements; for a model that trains PEFT adapters, ``setup`` lowers a recipe's ``min_numel`` to the
smallest adapter matrix (here 8 x 128 = 1024 elements), so the default plan (int4) compresses them. A
Plan or plan JSON keeps its own ``min_numel``.

Run (CPU, 2 processes; without a GPU the recipe trains on CPU anyway)::

    torchrun --nproc_per_node 2 recipes/train_trl.py --cpu --max-steps 30
    torchrun --nproc_per_node 2 recipes/train_trl.py --cpu --plan none      # uncompressed, for comparison
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import warnings

import torch

import fastml_strategy.transformers


def corpus() -> list[str]:
    """Sentences of argparse's docstrings and comments: real English text packaged with Python."""
    with open(argparse.__file__, encoding="utf-8") as f:
        text = f.read()
    lines = [ln.strip(" #\"'") for ln in text.splitlines()]
    words = " ".join(ln for ln in lines if re.fullmatch(r"[A-Za-z ,.;:()'-]{20,}", ln)).lower().split()
    return [" ".join(words[i:i + 24]) for i in range(0, len(words) - 24, 12)]


def word_tokenizer(texts: list[str], size: int):
    """A word-level ``PreTrainedTokenizerFast`` over the ``size`` commonest words (built, not downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    counts = collections.Counter(w for t in texts for w in t.split())
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for w, _ in counts.most_common(size - len(vocab)):
        vocab[w] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=None,
                    help="recipe name or plan JSON (default: $FASTML_PLAN, else int4)")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--max-steps", type=int, default=30)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-2)
    ap.add_argument("--rank", type=int, default=8, help="LoRA rank")
    ap.add_argument("--output-dir", default="runs/train_trl")
    args = ap.parse_args()

    from datasets import Dataset
    from peft import LoraConfig
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    # TRL's SFTTrainer reads model.is_gradient_checkpointing, deprecated in transformers 5 (upstream's
    # FutureWarning, not this script's): silence just that one message
    warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)

    texts = corpus()
    tokenizer = word_tokenizer(texts, size=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=64))
    config = SFTConfig(output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
                       learning_rate=args.lr, logging_steps=5, save_strategy="no", report_to="none",
                       use_cpu=args.cpu or not torch.cuda.is_available(), seed=0, disable_tqdm=True, max_length=32, packing=False,
                       ddp_find_unused_parameters=False,  # the adapters train each step (else DDP warns)
                       # TRL's default (checkpointing on) under its transformers 5 name, without the FutureWarning
                       gradient_checkpointing=False, activation_checkpointing=True)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tokenizer,
                         peft_config=LoraConfig(r=args.rank, lora_alpha=2 * args.rank,
                                                target_modules=["q_proj", "v_proj"]))
    rank = int(os.environ.get("RANK", "0"))
    try:
        callback = fastml_strategy.transformers.setup(trainer, plan=args.plan)  # the one FastML line
        trainer.train()
    except ValueError as e:  # a bad plan: the same one-line error on every rank, before the first step
        if "fastml_strategy.transformers" not in str(e):
            raise
        print(f"{os.path.basename(__file__)}: error (rank {rank}): {e}", file=sys.stderr, flush=True)
        sys.exit(2)

    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        stats = callback.state.stats() if callback.state is not None else None
        trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
        loss = f"loss {losses[0]:.3f} -> {losses[-1]:.3f}" if losses else "no loss logged (under 5 steps)"
        print(f"step {trainer.state.global_step}: {loss}, {trainable} trainable "
              f"(LoRA) parameters, compression {stats['compression_ratio'] if stats else 1.0:.2f}x "
              f"(plan {callback.plan.name})", flush=True)


if __name__ == "__main__":
    main()
