"""The built-in arms' names are written in one place: the arm table (difftx/arm_table.py, with the derivation of
each arm's config in difftx/config.py's arms section) and the compare presets. Elsewhere the code reads them from there (``PRIMARY``, ``ARM_LABELS``, ``PAPER_MODELS``, ...);
what is left is listed below, each with its reason. The attention kind ``"diff"`` (the registry's name of DIFF V1,
which the ``diff`` arm happens to share) is another thing and is not counted."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "difftx"
NAMES = ("diff", "baseline")
TABLES = ("arm_table.py", "compare/presets.py")
# every arm-name literal left outside the arm table and the presets: (file, text on its line) -> why it stays
ALLOWED = {
    ("compare/schema.py", "OLD_PAIR = "): "the pair every results.json before the named primary pair compared first",
    ("cli/train.py", 'getattr(args, "baseline"'): "train's --baseline flag (argparse's attribute), not an arm",
}


def arm_table_lines() -> range:
    """The lines of difftx/config.py's arms section (its ``# -- arms`` heading to the next top-level section): how
    each arm's config is derived."""
    lines = (ROOT / "config.py").read_text().splitlines()
    start = next(i for i, s in enumerate(lines, 1) if s.startswith("# -- arms"))
    end = next(i for i, s in enumerate(lines, 1) if i > start and s.startswith(("PRESETS", "# --")))
    return range(start, end)


def literal_lines() -> list[tuple[str, int, str]]:
    """``(file, line, text)`` of every string token that is exactly ``"diff"`` or ``"baseline"``."""
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        src = path.read_text()
        lines, seen = src.splitlines(), set()
        for tok in tokenize.generate_tokens(io.StringIO(src).readline):
            if tok.type != tokenize.STRING or tok.start[0] in seen:
                continue
            try:
                value = ast.literal_eval(tok.string)
            except (ValueError, SyntaxError):
                continue
            if value in NAMES:
                seen.add(tok.start[0])
                out.append((path.relative_to(ROOT).as_posix(), tok.start[0], lines[tok.start[0] - 1]))
    return out


def names_kind(file: str, text: str) -> bool:
    """A line that names the attention kind: an ``attention`` field or key, or the kinds' own registry and export."""
    return "attention" in text or file.startswith(("attention/", "interop/"))


def arm_literals() -> list[tuple[str, int, str]]:
    table = arm_table_lines()
    return [(f, n, t) for f, n, t in literal_lines()
            if f not in TABLES and not (f == "config.py" and n in table) and not names_kind(f, t)]


def test_arm_names_live_in_the_arm_table():
    left = arm_literals()
    unexplained = [f"{f}:{n}: {t.strip()}" for f, n, t in left
                   if not any(f == af and at in t for af, at in ALLOWED)]
    assert not unexplained, "arm names written outside the arm table (read them from difftx.arm_table):\n" + \
        "\n".join(unexplained)
    assert len(left) <= 5


def test_every_allowed_literal_is_still_there():
    left = arm_literals()
    stale = [k for k in ALLOWED if not any(f == k[0] and k[1] in t for f, _, t in left)]
    assert not stale, f"allowed literals no longer in the code (remove them from ALLOWED): {stale}"


def test_the_scan_finds_a_literal_and_the_arm_table():
    found = {(f, t.strip()) for f, _, t in literal_lines()}
    assert ("arm_table.py", 'PRIMARY = ("diff", "baseline")') in found  # the scan sees the table itself
    table = arm_table_lines()
    text = (ROOT / "config.py").read_text().splitlines()
    assert any(text[i - 1].startswith("def arm_config(") for i in table)
