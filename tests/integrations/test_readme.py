"""The README's examples are real: its Python blocks run on 2 processes, and every command in README.md
and docs/ names a recipe, launcher config and options that exist."""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

from _launch import JOBS, RECIPES, ROOT, rank_files, run, torchrun

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_readme_python_blocks_run_on_two_processes(tmp_path):
    """Every ```python block of README.md, in order, on 2 gloo ranks under torchrun, with a small model
    in place of the reader's (jobs/readme_job.py says what stands in for what, and checks each block:
    the hook compressed, the strategies are FastML's, the Accelerate state is a state, FSDP trains)."""
    res = run(torchrun(2) + [str(JOBS / "readme_job.py"), str(ROOT / "README.md"), str(tmp_path)],
              timeout=200, cwd=tmp_path).check()
    blocks = _python_blocks((ROOT / "README.md").read_text())
    r0, r1 = rank_files(tmp_path / "readme")
    assert len(blocks) >= 7  # DDP, plan, Trainer, Fabric, Accelerate, FSDP Trainer/Fabric, FSDP
    for r in (r0, r1):  # every block ran and passed its check on both ranks
        assert [b["block"] for b in r["blocks"]] == list(range(1, len(blocks) + 1)), res.tail()
    assert [b.get("steps") for b in r0["blocks"]] == [b.get("steps") for b in r1["blocks"]]


def _commands(text: str) -> list[str]:
    """The commands of the ```bash blocks, continuation lines joined, comments dropped."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split(" #")[0].strip()
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
    return out


def _recipe_options(path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text()))


def test_documented_commands_name_real_recipes_configs_and_options():
    from fastml_strategy.autotune.cli import build_parser

    autotune_opts = {o for a in build_parser()._actions for o in a.option_strings}
    seen = 0
    for doc in DOCS:
        for cmd in _commands(doc.read_text()):
            words = shlex.split(cmd.replace("...", ""))
            for w in words:
                if w.startswith("recipes/accelerate/"):
                    assert (ROOT / w).is_file(), f"{doc.name}: {w} does not exist ({cmd})"
            scripts = [i for i, w in enumerate(words) if re.fullmatch(r"recipes/\w+\.py", w)]
            if scripts:
                i = scripts[0]
                recipe = ROOT / words[i]
                assert recipe.is_file(), f"{doc.name}: {words[i]} does not exist ({cmd})"
                opts = _recipe_options(recipe)
                for w in words[i + 1:]:
                    if w.startswith("--"):
                        assert w.split("=")[0] in opts, f"{doc.name}: {words[i]} has no option {w} ({cmd})"
                seen += 1
            tuner = [i for i, w in enumerate(words) if w in ("fastml-autotune", "fastml_strategy.autotune.cli")]
            if tuner:
                for w in words[tuner[0] + 1:]:
                    if w.startswith("--"):
                        assert w.split("=")[0] in autotune_opts, f"{doc.name}: fastml-autotune has no {w} ({cmd})"
                seen += 1
    assert seen >= 20  # the check looked at the commands, not at nothing


def test_readme_names_the_cpu_of_every_machine_dependent_figure():
    """A figure measured on "this machine" says which CPU: model, family, AVX2/AVX-512."""
    text = (ROOT / "README.md").read_text()
    assert "this 2-core machine" not in text
    for m in re.finditer(r"2-core AMD EPYC[^.;)]*", text):
        window = text[m.start():m.start() + 120]
        assert re.search(r"family \d+", window) and "AVX" in window, window


def _recipe(name: str):
    """A recipe imported as a module (its main() does not run)."""
    spec = importlib.util.spec_from_file_location(f"_recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _recipe_lines(script: str) -> list[list[str]]:
    """The arguments of every documented command of recipes/<script>, README first, in order."""
    out = []
    for doc in DOCS:
        for cmd in _commands(doc.read_text()):
            words = shlex.split(cmd.replace("...", ""))
            if f"recipes/{script}" in words:
                out.append(words[words.index(f"recipes/{script}") + 1:])
    return out


def _leave_checkpoint(ckpt_dir: Path, strategy: str) -> None:
    """What a run of the Lightning recipe leaves as its "last": a file (DDP, local steps) that records
    the strategy, or a folder of shards (FSDP); a new name when another strategy's "last" is there."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path, v = ckpt_dir / "last.ckpt", 0
    while path.exists() and not (path.is_dir() == (strategy == "fastml_fsdp")):
        v += 1
        path = ckpt_dir / f"last-v{v}.ckpt"
    if strategy == "fastml_fsdp":
        path.mkdir(exist_ok=True)
    else:
        torch.save({"recipe_strategy": strategy, "state_dict": {}}, path)


def test_readme_lightning_lines_in_order_resume_their_own_strategy(tmp_path, monkeypatch):
    """README's (then the docs') Lightning commands, in the order written, as recipes/train_lightning.py
    resolves them, in process: every line parses (strategy choices included), each --strategy keeps its
    checkpoints in its own folder, and each `--resume last` gets a checkpoint of its own strategy (before,
    an FSDP folder became a DDP run's "last": IsADirectoryError). Checkpoints stand in for the runs."""
    tl = _recipe("train_lightning")
    monkeypatch.chdir(tmp_path)
    lines = _recipe_lines("train_lightning.py")
    strategies = set()
    resumed = 0
    for words in lines:
        args = tl.build_parser().parse_args(words)
        ckpt_dir = Path(tl.output_dir(args)) / "checkpoints"
        path, refused = tl.resume_path(args.resume, str(ckpt_dir), args.strategy)
        assert refused is None, (words, refused)
        if args.resume:
            assert tl.checkpoint_strategy(path) == args.strategy, (words, path)
            resumed += 1
        _leave_checkpoint(ckpt_dir, args.strategy)
        strategies.add(args.strategy)
    assert {"fastml", "fastml_fsdp", "fastml_localsgd"} <= strategies and resumed >= 2, lines
    tf = _recipe("train_fabric")
    fabric_lines = _recipe_lines("train_fabric.py")
    assert {tf.build_parser().parse_args(w).strategy for w in fabric_lines} >= {"fastml", "fastml_localsgd"}


def test_recipe_resume_last_takes_its_own_strategys_newest_checkpoint_or_refuses(tmp_path):
    tl = _recipe("train_lightning")
    d = tmp_path / "checkpoints"
    d.mkdir()
    torch.save({"recipe_strategy": "fastml", "state_dict": {}}, d / "last.ckpt")
    (d / "last-v1.ckpt").mkdir()  # FSDP's folder, newer: Lightning's own "last" would take it
    os.utime(d / "last.ckpt", (1, 1))
    assert tl.resume_path("last", str(d), "fastml") == (str(d / "last.ckpt"), None)
    assert tl.resume_path("last", str(d), "fastml_fsdp") == (str(d / "last-v1.ckpt"), None)
    path, why = tl.resume_path("last", str(d), "fastml_localsgd")
    assert path is None and "written by --strategy fastml, fastml_fsdp, not fastml_localsgd" in why, why
    # a local-steps checkpoint written before the recipe recorded its strategy: known by its per-rank state
    torch.save({"fastml_strategy": {"per_rank": [{"localsgd": {}}, {"localsgd": {}}]}}, d / "last-v2.ckpt")
    assert tl.resume_path("last", str(d), "fastml_localsgd") == (str(d / "last-v2.ckpt"), None)
    assert tl.saved_every(str(d / "last-v2.ckpt")) is None and tl.saved_every(str(d / "last.ckpt")) is None
    torch.save({"fastml_strategy": {"per_rank": [{"localsgd": {"every": 10}}]}}, d / "h10.ckpt")
    assert tl.saved_every(str(d / "h10.ckpt")) == 10  # main() refuses another --every in one line
    path, why = tl.resume_path(str(d / "last-v1.ckpt"), str(d), "fastml")
    assert path is None and why.endswith("resume it with --strategy fastml_fsdp"), why
    path, why = tl.resume_path("last", str(tmp_path / "nothing"), "fastml")
    assert path is None and "no last*.ckpt in" in why and "without --resume" in why, why
    assert tl.resume_path(None, str(d), "fastml") == (None, None)


def test_lightning_recipe_bounds_a_step_run_by_the_epochs_it_takes():
    """With --max-steps and no --max-epochs the recipe gives Lightning the epochs the steps take (with
    max_epochs=-1 Lightning's rich bar read "Epoch 2/-2"); one more when resuming, so that the steps,
    never the epochs, end the run (test_lightning.py checks "`max_steps=30` reached")."""
    tl = _recipe("train_lightning")
    # 2 ranks, batch 32: 750 examples each, 23 batches an epoch, as DigitsData's loader yields them
    sampler = torch.utils.data.DistributedSampler(range(tl.TRAIN_SIZE), num_replicas=2, rank=0, drop_last=True)
    assert len(torch.utils.data.DataLoader(range(tl.TRAIN_SIZE), batch_size=32, sampler=sampler,
                                           drop_last=True)) == 23
    assert [tl.epochs_for(n, 2, 32, 1, resuming=False) for n in (1, 23, 24, 30, 46, 47)] == [1, 1, 2, 2, 2, 3]
    assert tl.epochs_for(30, 2, 32, 1, resuming=True) == 3
    assert tl.epochs_for(30, 2, 32, 4, resuming=False) == 5  # 6 optimizer steps an epoch (the last: 3 batches)
    assert tl.epochs_for(50, 1, 32, 1, resuming=False) == 2  # 46 batches on one rank


@pytest.mark.timeout(120)
def test_bad_plan_under_torchrun_every_rank_exits_2_by_itself(tmp_path):
    """README: after a bad plan every rank exits with status 2 by itself, before torchrun stops it (it
    used to list rank 0 as -15, SIGTERM); the shell sees torchrun's own 1; one line from the recipe."""
    res = run(torchrun(2) + [str(RECIPES / "train_torchrun.py"), "--plan", "int5", "--max-steps", "1"],
              timeout=100, cwd=tmp_path)
    assert res.returncode == 1, res.tail()
    assert sorted(re.findall(r"^\s*exitcode\s+: (-?\d+)", res.output, re.M)) == ["2", "2"], res.tail()
    errors = [ln for ln in res.output.splitlines() if ln.startswith("train_torchrun.py: error:")]
    assert len(errors) == 1 and "'int5'" in errors[0], res.tail()
