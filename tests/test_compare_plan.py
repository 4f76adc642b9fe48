"""Where a ``difftx compare`` preset is validated: each field alone at construction
(difftx.compare.presets), the rest in difftx.compare.plan.resolve; the preset is data, and
resolving it is plan's."""

import pytest

from difftx.compare.plan import resolve
from difftx.compare.presets import ComparePreset, get_preset


def test_a_preset_checks_its_fields_alone_and_resolve_the_rest():
    loose = ComparePreset(steps=10, warmup_steps=20)  # each field is fine on its own
    with pytest.raises(ValueError, match="ComparePreset.warmup_steps: 20 must not exceed steps=10"):
        resolve(loose)
    with pytest.raises(ValueError, match="warmup_steps"):
        loose.with_overrides()
    with pytest.raises(ValueError, match="ComparePreset.steps: must be a positive integer"):
        ComparePreset(steps=0)
    p = get_preset("smoke", tasks={"diagnostics": {"cell": (6, 2)}})  # the diagnostics task clips its cell
    assert p.task_settings()["diagnostics"].cell == (6, 2)
    assert resolve(p).space == p.resolve().space


def test_plan_does_not_import_presets():
    """The preset is data; resolving it is plan's: no import from plan back to presets."""
    import ast
    from pathlib import Path

    import difftx.compare.plan as plan

    tree = ast.parse(Path(plan.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("presets")]
