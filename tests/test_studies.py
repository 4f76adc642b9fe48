"""The studies stand above the comparison: difftx/compare/ imports nothing from difftx/studies/."""

import ast
from pathlib import Path

import difftx.compare


def _imports(path: Path) -> list[str]:
    """Every module a file imports, lazy imports included, relative ones as written (``..studies.tune``)."""
    tree = ast.parse(path.read_text())
    names = [alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names]
    return names + ["." * n.level + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]


def test_compare_imports_no_study():
    root = Path(difftx.compare.__file__).parent
    found = {str(p.relative_to(root)): m for p in sorted(root.rglob("*.py")) for m in _imports(p)
             if m.startswith("difftx.studies") or m.lstrip(".").split(".")[0] == "studies"}
    assert not found, f"compare imports a study: {found}"


def test_the_tuning_section_reaches_the_report_through_the_hook():
    from difftx.compare.report import Section
    from difftx.studies.tune_report import tune_section

    section = tune_section({"field": "lr"})
    assert isinstance(section, Section) and callable(section.render) and callable(section.plot)
