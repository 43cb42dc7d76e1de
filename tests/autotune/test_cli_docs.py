"""What docs/autotune.md and `fastml-autotune --help` show is what the program prints (no training run).

The sample output in docs/autotune.md is checked against the format strings that print it
(``cli._print_answer`` and the report's headline functions, read from their source): every sample line
must follow one of them literal for literal, and the lines every run of the documented command prints
(the times line, "Wrote", "Wall time", the local-steps winner) must be there. A changed wording then
fails here until the sample is regenerated from a real run. The numbers are not checked: they are
predictions of one run on one machine.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

from fastml_strategy.autotune import cli
from fastml_strategy.autotune.report import words as report

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "autotune.md"
GAP = None  # a formatted value inside a template


def _templates(module, names: tuple[str, ...]) -> dict[str, list[list[str | None]]]:
    """function name -> its f-strings, each as literal parts and GAPs (Markdown bold dropped, as the
    command drops it)."""
    tree = ast.parse(inspect.getsource(module))
    out: dict[str, list[list[str | None]]] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in names:
            found = []
            for node in ast.walk(fn):
                if isinstance(node, ast.JoinedStr):
                    parts: list[str | None] = []
                    for v in node.values:
                        piece = v.value.replace("**", "") if isinstance(v, ast.Constant) else GAP
                        if piece is GAP and parts and parts[-1] is GAP:
                            continue
                        if isinstance(piece, str) and parts and isinstance(parts[-1], str):
                            parts[-1] += piece
                        else:
                            parts.append(piece)
                    found.append(parts)
            out[fn.name] = found
    assert set(out) == set(names), f"functions not found: {set(names) - set(out)}"
    return out


def _follows(line: str, parts: list[str | None]) -> bool:
    """Whether ``line`` starts as the template does: its literal parts in order, the first at the start,
    anything (the values) between them. A template may be followed by more text (composed lines)."""
    pos = 0
    for i, part in enumerate(parts):
        if part is GAP:
            continue
        at = line.find(part, pos)
        if at < 0 or (i == 0 and at != 0):
            return False
        pos = at + len(part)
    return True


def _significant(parts: list[str | None]) -> bool:
    # starts with words, not a value, and says something: "  {line}" alone would match any line
    return isinstance(parts[0], str) and len(parts[0].strip()) >= 5


def _code_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, body) of every fenced block, in order."""
    blocks, info, body = [], None, []
    for line in text.splitlines():
        if line.startswith("```"):
            if info is None:
                info, body = line[3:].strip(), []
            else:
                blocks.append((info, "\n".join(body)))
                info = None
        elif info is not None:
            body.append(line)
    return blocks


def _doc_sample() -> list[str]:
    samples = [b for info, b in _code_blocks(DOC.read_text()) if not info and b.startswith(f"{cli.PROG}: ")]
    assert len(samples) == 1, "docs/autotune.md should hold one sample of the command's output"
    return samples[0].rstrip("\n").splitlines()


def test_autotune_doc_sample_follows_the_current_output_format():
    printed = _templates(cli, ("_print_answer",))["_print_answer"]
    rep = _templates(report, ("_verdict", "_rent_words", "headline", "winner_line"))
    lines = _doc_sample()
    assert len(lines) >= 5, lines

    # first line: the program's name, then the verdict; the others: indented, from the report or the CLI
    first = [[f"{cli.PROG}: " + p[0], *p[1:]] for p in rep["_verdict"] if _significant(p)]
    others = {name: [["  " + p[0], *p[1:]] for p in ts if _significant(p)]
              for name, ts in rep.items() if name != "_verdict"}
    others["cli"] = [p for p in printed if _significant(p)]
    assert any(_follows(lines[0], t) for t in first), f"first line follows no verdict of report/words.py: {lines[0]}"
    used = set()
    for line in lines[1:]:
        hits = [name for name, ts in others.items() if any(_follows(line, t) for t in ts)]
        assert hits, f"docs/autotune.md sample line follows no format string of cli.py / report/words.py: {line!r}"
        used.update(hits)
    # every run of the documented command (with --local-steps) prints these
    assert {"headline", "cli", "winner_line"} <= used, used
    for must in ("  Wrote ", "  Wall time: "):
        tmpl = [t for t in printed if t[0] == must]
        assert tmpl, f"cli._print_answer no longer prints {must.strip()!r}: update this test and the doc"
        assert any(_follows(line, tmpl[0]) for line in lines), f"the doc's sample lacks the {must.strip()!r} line"


def test_autotune_doc_sample_comes_from_the_documented_command():
    blocks = _code_blocks(DOC.read_text())
    target = cli.EXAMPLE_TARGET
    assert (ROOT / target.split(":")[0]).is_file()
    at = next(i for i, (info, b) in enumerate(blocks) if not info and b.startswith(f"{cli.PROG}: "))
    info, command = blocks[at - 1]  # the block right before the sample is its command
    assert info == "bash" and command.strip().startswith(f"fastml-autotune {target} "), command
    out = re.search(r"--out (\S+)", command).group(1)
    assert f"Wrote {out}/plan.json" in blocks[at][1]


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # argparse wraps at the terminal width: one line per option


def test_help_names_only_files_that_exist_and_no_contradictory_default(wide):
    text = cli.build_parser().format_help()
    files = set(re.findall(r"[\w./-]+\.py", text)) - {"path/to/file.py"}  # the TARGET placeholder
    assert files, text
    for f in files:
        assert (ROOT / f).is_file(), f"--help names {f}, which does not exist"
    assert cli.EXAMPLE_TARGET in text
    options = re.split(r"\n  (?=-)", text)[1:]  # one block per option
    for block in options:
        assert "(default: None)" not in block and "(default: True)" not in block \
            and "(default: False)" not in block, block
        assert len(re.findall(r"\bdefault\b", block, re.I)) <= 1, f"two defaults in one option's help: {block}"
        assert not re.search(r"\(default\)", block), f"a default with no value: {block}"
