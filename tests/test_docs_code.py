"""The code in README.md and docs/*.md is true to the code: every Python block is valid Python, and every option
a `difftx` command line there gives is one that command accepts (its parser, not a list kept by hand)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from difftx.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(page: Path, languages: tuple[str, ...]):
    text = page.read_text(encoding="utf-8")
    for m in BLOCK.finditer(text):
        if m.group(1) in languages:
            yield text.count("\n", 0, m.start()) + 2, m.group(2)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_python_block_is_python(page):
    for line, code in _blocks(page, ("python",)):
        try:
            compile(code, f"{page.name}:{line}", "exec")
        except SyntaxError as e:
            pytest.fail(f"{page.name}, the block at line {line}: {e}")


def _options(parser: argparse.ArgumentParser, prefix: str = "") -> set[str]:
    """Every option string of ``parser``, and of its sub-commands as ``NAME:--option``."""
    out = set()
    for action in parser._actions:
        out |= {prefix + o for o in action.option_strings}
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out |= _options(sub, f"{prefix}{name}:")
    return out


def _command_lines(page: Path):
    """(line, text) of each `difftx ...` command: the lines of shell blocks, and inline code spans elsewhere."""
    text = page.read_text(encoding="utf-8")
    shell = {m.start(2): m.group(2) for m in BLOCK.finditer(text) if m.group(1) in ("bash", "sh", "")}
    for start, code in shell.items():
        for i, row in enumerate(code.splitlines()):
            yield text.count("\n", 0, start) + 1 + i, row.split("#", 1)[0]
    for m in re.finditer(r"`([^`\n]*difftx [^`\n]*)`", BLOCK.sub("", text)):
        yield None, m.group(1)


def test_every_option_a_command_line_gives_exists():
    parser = build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    top = _options(parser) - {f for f in _options(parser) if ":" in f}
    wrong, seen = [], 0
    for page in PAGES:
        for line, row in _command_lines(page):
            for m in re.finditer(r"\bdifftx((?:\s+--kinds\s+\S+)?)\s+([a-z_]+)\b([^|;&]*)", row):
                if m.group(2) not in subs:
                    continue
                options = _options(subs[m.group(2)])
                words = m.group(3).split()
                nested = words[0] if words and not words[0].startswith("-") else ""  # eval TASK, tokenizer ACTION
                for option in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", m.group(3)):
                    seen += 1
                    if option not in options | top and f"{nested}:{option}" not in options:
                        wrong.append(f"{page.name}:{line or '(inline)'}: difftx {m.group(2)} {option}")
    assert seen > 500, seen  # the pages' command lines were found (782 when this test was written)
    assert not wrong, "\n".join(wrong)
