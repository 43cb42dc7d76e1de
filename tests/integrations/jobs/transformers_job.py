"""One torchrun job (2 CPU ranks) that checks every contract of fastml_strategy.transformers in one process
pair, on a tiny Llama built from a config (about 90k parameters; no hub download):

plain Trainer DDP vs the integration with plan `none` (10 steps); int4 (replicas, loss, logged figures);
gradient accumulation (only the syncing micro-batch is compressed); bf16 + gradient checkpointing; a PEFT
LoRA model (plan names as model.named_parameters() shows them); resume bit-exact from checkpoint-N (and
not bit-exact without FastML's state); TRL's SFTTrainer with the same line; bad plans (before any step,
on every rank); torch_compile=True (aot_eager backend); FSDP2 through fsdp/fsdp_config (setup switches
Accelerate to its FSDP2 path on CPU): plan `none` against plain DDP, int4, resume from Trainer's FSDP
checkpoint, accumulation with bf16; a GPT-2 plan naming the tied lm_head.weight; a resume under another
plan. Each rank writes its findings to OUT.rank<R>.json for tests/integrations/test_transformers.py.

``transformers_job.py OUT refusals`` runs, instead, what setup must refuse on every rank before any step
(started as ranks without torchrun's agent, so each rank's own outcome shows): TrainingArguments without
use_cpu on a machine without GPUs (each process would train alone), and a bad plan file on rank 1 only.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import fastml_strategy.transformers as fmt
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

VOCAB, SEQ = 64, 16
OUT = Path(sys.argv[1])
WORK = OUT.parent / "work"
RANK = int(os.environ["RANK"])


def config() -> LlamaConfig:
    # 64-wide, 2 layers: every projection has >= 4096 elements (int4 compresses it), norms stay exact
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2 * SEQ)


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(config())


class Progressions(torch.utils.data.Dataset):
    """Token sequences a, a+1, a+2, ... (mod VOCAB) from a random start: a bigram a tiny model learns in a
    few steps, so the loss falls well below its start (ln 64 = 4.16)."""

    def __len__(self) -> int:
        return 512

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        ids = (torch.randint(0, VOCAB, (1,), generator=g) + torch.arange(SEQ)) % VOCAB
        return {"input_ids": ids, "labels": ids.clone()}


def targs(name: str, **kw) -> TrainingArguments:
    base = dict(output_dir=str(WORK / name), per_device_train_batch_size=4, max_steps=10, learning_rate=1e-2,
                logging_steps=2, save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                warmup_steps=0, lr_scheduler_type="constant")
    base.update(kw)
    return TrainingArguments(**base)


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode() + p.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float().clone() for _, p in sorted(model.named_parameters())])


def losses(trainer) -> list:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def train(name: str, plan=None, fastml: bool = True, model=None, resume=None, every=None, stats_every=None,
          **kw) -> tuple:
    trainer = Trainer(model=model if model is not None else tiny_llama(), args=targs(name, **kw),
                      train_dataset=Progressions())
    cb = fmt.setup(trainer, plan=plan, every=every, layer_stats_every=stats_every) if fastml else None
    t = time.monotonic()
    trainer.train(resume_from_checkpoint=resume)
    return trainer, cb, time.monotonic() - t


def summary(trainer, cb) -> dict:
    logged = [h for h in trainer.state.log_history if "loss" in h]
    s = cb.state.stats() if cb is not None and cb.state is not None else None
    return {"digest": digest(trainer.model), "losses": losses(trainer), "global_step": trainer.state.global_step,
            "fastml_step": s.get("steps", s.get("inner_steps")) if s else None, "outer_steps": (s or {}).get(
                "outer_steps"), "logged": logged[-1] if logged else {},
            "layers": {n: r["codec"] for n, r in s["layers"].items()} if s else {},
            "wrapped": type(trainer.model_wrapped).__name__, **error_logs(logged)}


def error_logs(logged: list) -> dict:
    """The logging steps whose logs carry fastml/error/* figures, and every such key logged."""
    keys = [[k for k in h if k.startswith("fastml/error/")] for h in logged]
    return {"error_steps": [h["step"] for h, ks in zip(logged, keys) if ks],
            "error_keys": sorted({k for ks in keys for k in ks})}


def one_line_error(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def main() -> None:
    r: dict = {"rank": RANK}
    t0 = time.monotonic()

    # 1. plan `none` through the integration = plain Trainer DDP
    plain, _, r["t_plain"] = train("plain", fastml=False)
    none, cb_none, _ = train("none", plan="none")
    r["plain"], r["none"] = summary(plain, None), summary(none, cb_none)
    r["none_max_abs_diff"] = float((flat(plain.model) - flat(none.model)).abs().max())
    r["none_vs_init_max_abs_diff"] = float((flat(none.model) - flat(tiny_llama())).abs().max())

    # 2. int4: replicas identical, loss falls, figures in the logs (per-layer errors measured at optimizer
    # steps 1, 5, 9: in the logs of steps 2, 6, 10 only)
    int4, cb4, r["t_int4"] = train("int4", plan="int4", stats_every=4)
    r["int4"] = summary(int4, cb4)

    # 3. accumulation: 2 micro-batches of 2 per step; the hook runs once per optimizer step
    acc, cb_acc, _ = train("acc", plan="int4", max_steps=6, per_device_train_batch_size=2,
                           gradient_accumulation_steps=2, ddp_bucket_cap_mb=0.02)
    r["acc"] = summary(acc, cb_acc)
    r["acc_bucket_bytes_cap"] = acc.model_wrapped.bucket_bytes_cap

    # 4. bf16 autocast + gradient checkpointing
    bf, cb_bf, _ = train("bf16", plan="int4", max_steps=6, bf16=True, activation_checkpointing=True)
    r["bf16"] = summary(bf, cb_bf)
    r["bf16_checkpointing"] = bool(bf.model.is_gradient_checkpointing)
    r["bf16_mixed_precision"] = str(bf.accelerator.mixed_precision)

    # 5. PEFT LoRA: only the adapters train, and the plan names them as model.named_parameters() does
    from peft import LoraConfig, get_peft_model

    lora_model = get_peft_model(tiny_llama(), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    names = [n for n, p in lora_model.named_parameters() if p.requires_grad]
    exact = next(n for n in names if "lora_B" in n)
    base_before = {n: p.detach().clone() for n, p in lora_model.named_parameters() if not p.requires_grad}
    lora_plan = {"format_version": 1, "name": "lora", "default": {"codec": "quantize", "bits": 4},
                 "min_numel": 256, "layers": {exact: {"codec": "quantize", "bits": 8}}}
    lo, cb_lo, _ = train("lora", plan=lora_plan, model=lora_model, max_steps=6)
    r["lora"] = summary(lo, cb_lo)
    r["lora_exact"] = exact
    r["lora_base_changed"] = any(not torch.equal(p, base_before[n]) for n, p in lo.model.named_parameters()
                                 if n in base_before)

    # 6. resume: 4 + 4 steps from checkpoint-4 equal 8 uninterrupted steps, bit for bit
    full, cb_full, _ = train("resume", plan="int4", max_steps=8, save_strategy="steps", save_steps=4)
    ck = WORK / "resume" / "checkpoint-4"
    saved = torch.load(ck / fmt.STATE_FILE, weights_only=True)
    r["saved"] = {"global_step": saved["global_step"], "ranks": [p["rank"] for p in saved["fastml"]["per_rank"]],
                  "steps": [p["step"] for p in saved["fastml"]["per_rank"]],
                  "residuals": len(saved["fastml"]["per_rank"][RANK]["residuals"])}
    resumed, cb_res, _ = train("resume", plan="int4", max_steps=8, save_strategy="steps", save_steps=4,
                               resume=str(ck))
    r["full"], r["resumed"] = summary(full, cb_full), summary(resumed, cb_res)
    # the same resume from a copy of the folder without fastml_state.pt: residuals start from zero
    if RANK == 0:
        bare = WORK / "bare" / "checkpoint-4"
        shutil.copytree(ck, bare, dirs_exist_ok=True)
        (bare / fmt.STATE_FILE).unlink()
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bare_run, cb_bare, _ = train("bare", plan="int4", max_steps=8, resume=str(WORK / "bare" / "checkpoint-4"))
    r["bare"] = summary(bare_run, cb_bare)
    r["bare_warned"] = any("residuals start from zero" in str(w.message) for w in caught)
    # the same checkpoint resumed under another plan: refused, naming the file and the plan it was saved with
    r["resume_other_plan"] = one_line_error(lambda: train("resume", plan="int8", max_steps=8, save_strategy="steps",
                                                          save_steps=4, resume=str(ck)))

    # 6b. GPT-2 ties lm_head.weight to transformer.wte.weight: a plan naming the tied name applies to it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gpt, cb_gpt, _ = train("gpt2", model=tiny_gpt2(), max_steps=2, plan={
            "format_version": 1, "layers": {"lm_head.weight": {"codec": "quantize", "bits": 8}}})
    r["gpt2"] = summary(gpt, cb_gpt)
    r["gpt2_alias_noted"] = any("'lm_head.weight' is another name of 'transformer.wte.weight'" in str(w.message)
                                for w in caught)

    # 7. LocalSGD (every=3): checkpoint-4 falls between two synchronisations (the ranks' models differ
    # there); resuming from it gives each rank its own model, optimizer and LocalSGD state back
    ls_full, cb_ls, _ = train("lsgd", plan="int4", every=3, max_steps=6, save_strategy="steps", save_steps=4)
    ls_saved = torch.load(WORK / "lsgd" / "checkpoint-4" / fmt.STATE_FILE, weights_only=True)
    per = ls_saved["fastml"]["per_rank"]
    r["lsgd_saved"] = {"kind": ls_saved["kind"], "ranks": [p["rank"] for p in per],
                       "models_differ": any(not torch.equal(per[0]["model"][k], per[1]["model"][k])
                                            for k in per[0]["model"])}
    ls_res, cb_lsr, _ = train("lsgd", plan="int4", every=3, max_steps=6, save_strategy="steps", save_steps=4,
                              resume=str(WORK / "lsgd" / "checkpoint-4"))
    r["lsgd"], r["lsgd_resumed"] = summary(ls_full, cb_ls), summary(ls_res, cb_lsr)
    r["lsgd_ratio_vs_ddp"] = cb_ls.state.stats()["ratio_vs_ddp"]

    # 8. TRL's SFTTrainer (LoRA, a tokenizer built here) with the same one line
    r["trl"] = trl_sft()

    # 9. bad plans stop before any step, on every rank, with one line
    os.environ["FASTML_PLAN"] = "int44"
    r["bad_env"] = one_line_error(lambda: train("bad_env", plan=None))
    del os.environ["FASTML_PLAN"]
    r["bad_name"] = one_line_error(lambda: train("bad_name", plan={
        "format_version": 1, "layers": {"model.layers.7.mlp.up_proj.weight": {"codec": "quantize", "bits": 2}}}))
    disagree = Trainer(model=tiny_llama(), args=targs("disagree"), train_dataset=Progressions())
    r["bad_disagree"] = one_line_error(lambda: fmt.setup(disagree, plan="int4" if RANK == 0 else "int8"))
    r["bad_disagree_step"] = disagree.state.global_step

    # 10. torch_compile=True (Accelerate compiles the DDP model; FastML finds DDP inside): the aot_eager
    # backend runs dynamo's tracing, DDP's graph splitting at bucket boundaries and AOTAutograd's compiled
    # backward, as inductor does, without inductor's C++ code generation (about a minute here)
    t = time.monotonic()
    comp, cb_comp, _ = train("compile", plan="int4", torch_compile=True, torch_compile_backend="aot_eager")
    r["compile"] = summary(comp, cb_comp)
    r["t_compile"] = time.monotonic() - t

    # 11. FSDP2 through fsdp/fsdp_config on CPU (setup switches Accelerate to its FSDP2 path)
    t = time.monotonic()
    fsdp_contracts(r, plain)
    r["t_fsdp"] = time.monotonic() - t

    r["seconds"] = time.monotonic() - t0
    with open(f"{OUT}.rank{RANK}.json", "w") as f:
        json.dump(r, f, indent=1, default=str)


FSDP = dict(fsdp="full_shard", fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})


def full_params(model: torch.nn.Module) -> dict:
    """Every parameter whole (an FSDP2 shard gathered: a collective, so every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for n, p in model.named_parameters()}


def fsdp_summary(trainer, cb) -> dict:
    params = full_params(trainer.model)
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode() + params[name].contiguous().numpy().tobytes())
    s = cb.state.stats()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    return {"digest": h.hexdigest(), "losses": losses(trainer), "global_step": trainer.state.global_step,
            "fastml_step": s["steps"], "state": type(cb.state).__name__, "wrapped": type(trainer.model_wrapped).__name__,
            "fsdp_units": sum(type(m).__name__.startswith("FSDP") for m in trainer.model.modules()),
            "logged": logged[-1], **error_logs(logged)}


def fsdp_contracts(r: dict, plain) -> None:
    """Trainer(args=TrainingArguments(fsdp=..., fsdp_config={"version": 2})) on 2 CPU ranks: Accelerate
    ignores the plugin on CPU; setup switches it to its FSDP2 path, and FastML compresses the reduce-scatter."""
    before = Trainer(model=tiny_llama(), args=targs("fsdp_state", **FSDP), train_dataset=Progressions())
    r["fsdp_before"] = [before.accelerator.distributed_type.value, getattr(before.accelerator.state, "fsdp_plugin", None) is None,
                        before.is_fsdp_enabled]
    fmt.setup(before, plan="int4")
    r["fsdp_after"] = [before.accelerator.distributed_type.value, bool(before.accelerator.is_fsdp2),
                       before.is_fsdp_enabled]

    # plan `none` through FSDP2 equals plain Trainer DDP after 10 steps
    none = Trainer(model=tiny_llama(), args=targs("fsdp_none", **FSDP), train_dataset=Progressions())
    cb_none = fmt.setup(none, plan="none")
    none.train()
    theirs, ours = full_params(plain.model), full_params(none.model)
    r["fsdp_none_max_abs_diff"] = max(float((theirs[n] - ours[n]).abs().max()) for n in theirs)
    r["fsdp_none"] = fsdp_summary(none, cb_none)

    # int4, 8 steps with checkpoint-4; then a resume from it equals the uninterrupted run, bit for bit
    def int4(resume=None):
        trainer = Trainer(model=tiny_llama(), args=targs("fsdp_int4", max_steps=8, save_strategy="steps",
                                                          save_steps=4, **FSDP), train_dataset=Progressions())
        cb = fmt.setup(trainer, plan="int4")
        trainer.train(resume_from_checkpoint=resume)
        return fsdp_summary(trainer, cb)

    r["fsdp_int4"] = int4()
    saved = torch.load(WORK / "fsdp_int4" / "checkpoint-4" / fmt.STATE_FILE, weights_only=True)
    r["fsdp_saved"] = {"global_step": saved["global_step"], "ranks": [p["rank"] for p in saved["fastml"]["per_rank"]],
                       "steps": [p["step"] for p in saved["fastml"]["per_rank"]]}
    r["fsdp_resumed"] = int4(resume=str(WORK / "fsdp_int4" / "checkpoint-4"))

    # gradient accumulation (only the syncing micro-batch reduces) with bf16 (FSDP2's mixed precision policy)
    acc = Trainer(model=tiny_llama(), args=targs("fsdp_acc", max_steps=6, per_device_train_batch_size=2,
                                                 gradient_accumulation_steps=2, bf16=True, **FSDP),
                  train_dataset=Progressions())
    cb_acc = fmt.setup(acc, plan="int4")
    acc.train()
    r["fsdp_acc"] = fsdp_summary(acc, cb_acc)
    r["fsdp_acc_param_dtype"] = str(acc.accelerator.state.fsdp_plugin.mixed_precision_policy.param_dtype)

    # LocalSGD with FSDP: refused in setup, before any step
    r["fsdp_every_refused"] = one_line_error(lambda: fmt.setup(
        Trainer(model=tiny_llama(), args=targs("fsdp_bad", **FSDP), train_dataset=Progressions()), every=3))


def trl_sft() -> dict:
    from datasets import Dataset
    from peft import LoraConfig
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i + 2 for i in range(VOCAB - 2)}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    texts = [" ".join(f"t{(a + b * k) % (VOCAB - 2)}" for k in range(SEQ - 1)) for a in range(16) for b in range(8)]
    args = SFTConfig(output_dir=str(WORK / "trl"), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-2,
                     logging_steps=2, save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
                     max_length=SEQ, packing=False)
    trainer = SFTTrainer(model=tiny_llama(), args=args, train_dataset=Dataset.from_dict({"text": texts}),
                         processing_class=tok, peft_config=LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    records = Records()
    logging.getLogger("fastml_strategy.integrations.transformers").addHandler(records)
    logging.getLogger("fastml_strategy.integrations.transformers").setLevel(logging.INFO)
    cb = fmt.setup(trainer, plan="int4")  # a recipe name: setup fits min_numel to the adapters (8 x 64)
    logging.getLogger("fastml_strategy.integrations.transformers").removeHandler(records)
    trainer.train()
    out = summary(trainer, cb)
    out["trainer"] = type(trainer).__name__
    out["min_numel"] = cb.plan.min_numel
    out["fit_logged"] = [m for m in records.messages if "PEFT adapters" in m]
    return out


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)  # 64 x 64 embeddings (4096 elements: compressed), tied to the head
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=1, n_head=4, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))


def refusals() -> None:
    """What setup must refuse on every rank alike, before any step: a Trainer that would train each process
    alone (no use_cpu on a machine without GPUs: Accelerate's state NO, no DDP), and a plan file that is bad
    on rank 1 only (the ranks agree in setup, before DDP's constructor, whose collectives would otherwise
    fail on rank 0 with gloo's "Connection closed by peer")."""
    r: dict = {"rank": RANK}
    alone = Trainer(model=tiny_llama(), args=targs("alone", use_cpu=False), train_dataset=Progressions())
    r["alone_mode"] = alone.args.parallel_mode.value
    r["alone"] = one_line_error(lambda: fmt.setup(alone, plan="int4"))
    WORK.mkdir(parents=True, exist_ok=True)
    path = WORK / f"plan.rank{RANK}.json"
    path.write_text(json.dumps({"format_version": 1, "default": {"codec": "quantize", "bits": 4 if RANK == 0 else 9}}))
    trainer = Trainer(model=tiny_llama(), args=targs("bad_file"), train_dataset=Progressions())

    def setup_and_train() -> None:
        fmt.setup(trainer, plan=str(path))
        trainer.train()

    r["bad_file"] = one_line_error(setup_and_train)
    r["bad_file_step"] = trainer.state.global_step
    with open(f"{OUT}.rank{RANK}.json", "w") as f:
        json.dump(r, f, indent=1, default=str)


if __name__ == "__main__":
    refusals() if sys.argv[2:] == ["refusals"] else main()
