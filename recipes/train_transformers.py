"""Hugging Face ``transformers.Trainer`` with FastML: a tiny Llama (or GPT-2) language model built from a
config, trained byte by byte on text that ships with Python (the source of the standard library's
``argparse`` module): nothing is downloaded from a hub.

The FastML part of an existing Trainer script is one line, after building the Trainer::

    trainer = Trainer(model=model, args=training_args, train_dataset=train)
    fastml_strategy.transformers.setup(trainer, plan="int4")   # or plan=None: $FASTML_PLAN, else int4
    trainer.train()

Run (2 processes; without a GPU the recipe trains on CPU over gloo, ``--cpu`` forces it where GPUs are;
on GPUs the backend is NCCL)::

    torchrun --nproc_per_node 2 recipes/train_transformers.py --cpu --max-steps 50
    torchrun --nproc_per_node 2 recipes/train_transformers.py --cpu --plan none     # DDP's own all-reduce
    torchrun --nproc_per_node 2 recipes/train_transformers.py --cpu --gpt2 --bf16 --accumulate 2
    torchrun --nproc_per_node 2 recipes/train_transformers.py --cpu --max-steps 50 --save-steps 25
    torchrun --nproc_per_node 2 recipes/train_transformers.py --cpu --max-steps 100 --resume  # from the last checkpoint
    torchrun --nproc_per_node 2 recipes/train_transformers.py --cpu --every 10   # LocalSGD: sync every 10 steps

The logs (``trainer.state.log_history``, TensorBoard/W&B with ``--report-to``) carry
``fastml/compression_ratio``, ``fastml/bytes_per_step`` and ``fastml/error/<parameter>`` at every
logging step; each ``checkpoint-N`` folder holds ``fastml_state.pt`` (every rank's error-feedback
residuals, step and plan), and ``--resume`` continues bit-exactly where the checkpoint left off.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import torch

import fastml_strategy.transformers
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments


class ByteText(torch.utils.data.Dataset):
    """Windows of ``seq`` bytes of a text file (byte-level ids 0..255: no tokenizer needed)."""

    def __init__(self, path: str, seq: int) -> None:
        with open(path, "rb") as f:
            self.data = torch.tensor(list(f.read()), dtype=torch.long)
        self.seq = seq

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq

    def __getitem__(self, i: int) -> dict:
        ids = self.data[i * self.seq:(i + 1) * self.seq]
        return {"input_ids": ids, "labels": ids.clone()}


def tiny_model(gpt2: bool, width: int, layers: int, seq: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if gpt2:
        return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=width, n_layer=layers, n_head=4, n_positions=seq))
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=width, intermediate_size=2 * width,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                        max_position_embeddings=seq))


def params_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode() + p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", default=None, help="recipe name or plan JSON (default: $FASTML_PLAN or int4)")
    ap.add_argument("--cpu", action="store_true", help="train on CPU even if a GPU is present (without one, "
                                                          "the recipe trains on CPU anyway)")
    ap.add_argument("--gpt2", action="store_true", help="a GPT-2 model instead of Llama")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--max-steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=8, help="per process")
    ap.add_argument("--accumulate", type=int, default=1, help="gradient_accumulation_steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    ap.add_argument("--gradient-checkpointing", action="store_true")
    ap.add_argument("--bucket-cap-mb", type=float, default=None, help="TrainingArguments.ddp_bucket_cap_mb")
    ap.add_argument("--every", type=int, default=None,
                    help="LocalSGD: synchronise every N optimizer steps instead of all-reducing every step")
    ap.add_argument("--output-dir", default="runs/train_transformers")
    ap.add_argument("--save-steps", type=int, default=0, help="write checkpoint-N every N steps (0: never)")
    ap.add_argument("--resume", nargs="?", const=True, default=None,
                    help="resume from a checkpoint folder, or (no value) the last one in --output-dir")
    ap.add_argument("--logging-steps", type=int, default=10)
    ap.add_argument("--report-to", default="none", help="tensorboard, wandb, ... (default none)")
    ap.add_argument("--summary", default=None, help="write final figures to SUMMARY.rank<R>.json")
    args = ap.parse_args()

    train = ByteText(argparse.__file__, args.seq)  # the text: argparse's source, packaged with Python
    model = tiny_model(args.gpt2, args.width, args.layers, args.seq)
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulate, learning_rate=args.lr, bf16=args.bf16,
        activation_checkpointing=args.gradient_checkpointing, ddp_bucket_cap_mb=args.bucket_cap_mb,
        logging_steps=args.logging_steps, save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500, report_to=args.report_to, seed=0,
        # without use_cpu, transformers 5 on a machine without GPUs trains each process alone (no DDP)
        use_cpu=args.cpu or not torch.cuda.is_available(),
        disable_tqdm=True, lr_scheduler_type="constant",
        ddp_find_unused_parameters=False)  # every parameter trains each step (else DDP warns)
    trainer = Trainer(model=model, args=training_args, train_dataset=train)

    rank = int(os.environ.get("RANK", "0"))
    try:
        callback = fastml_strategy.transformers.setup(trainer, plan=args.plan, every=args.every)  # the FastML line
        trainer.train(resume_from_checkpoint=args.resume)
    except ValueError as e:  # a bad plan: the same one-line error on every rank, before the first step
        if "fastml_strategy.transformers" not in str(e):
            raise
        print(f"{os.path.basename(__file__)}: error (rank {rank}): {e}", file=sys.stderr, flush=True)
        sys.exit(2)

    stats = callback.state.stats() if callback.state is not None else None
    if stats is not None and "steps" not in stats:  # LocalSGD's figures
        stats["steps"] = stats["inner_steps"]
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    if trainer.is_world_process_zero():
        ratio = stats["compression_ratio"] if stats else 1.0
        print(f"step {trainer.state.global_step}: loss {losses[0] if losses else float('nan'):.3f} -> "
              f"{losses[-1] if losses else float('nan'):.3f}, compression {ratio:.2f}x "
              f"(plan {callback.plan.name})", flush=True)
    if args.summary:
        with open(f"{args.summary}.rank{rank}.json", "w") as f:
            json.dump({"global_step": trainer.state.global_step, "losses": losses,
                       "params_sha256": params_sha256(trainer.model), "plan": stats["plan"] if stats else None,
                       "fastml_step": stats["steps"] if stats else None,
                       "compression_ratio": stats["compression_ratio"] if stats else None}, f)


if __name__ == "__main__":
    main()
