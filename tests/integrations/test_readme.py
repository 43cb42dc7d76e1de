"""The README's examples are real: its Python blocks run on 2 processes, and every command in README.md
and docs/ names a recipe, launcher config and options that exist."""

from __future__ import annotations

import re
import shlex

import pytest

from _launch import JOBS, ROOT, rank_files, run, torchrun

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
