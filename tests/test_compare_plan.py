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


@pytest.mark.parametrize("fields, says", [
    (dict(steps=10 ** 12), "ComparePreset.steps: 1,000,000,000,000 is more than a comparison can train"),
    (dict(steps=10 ** 6, probe_every=1), "ComparePreset.probe_every: 1 probes 1,000,000 times"),
    (dict(curve_points=10 ** 6), "ComparePreset.curve_points: 1,000,000 is more than 100,000"),
    (dict(lr=float("inf")), "ComparePreset.lr: must be a finite number, got inf"),
    (dict(grad_clip=float("nan")), "ComparePreset.grad_clip: must be a finite number"),
])
def test_step_counts_and_rates_are_bounded_before_anything_is_built_from_them(fields, says):
    """A step count's probe schedule is sized before it is built (a set of 1.7e11 steps was built once)."""
    with pytest.raises(ValueError, match=says.replace(".", r"\.").replace("(", r"\(")):
        ComparePreset(**fields)


def test_plan_does_not_import_presets():
    """The preset is data; resolving it is plan's: no import from plan back to presets."""
    import ast
    from pathlib import Path

    import difftx.compare.plan as plan

    tree = ast.parse(Path(plan.__file__).read_text())
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").endswith("presets")]
