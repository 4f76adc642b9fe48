"""The documented shape of ``results.json`` (``docs/compare.md``) and a checker for it."""

from __future__ import annotations

from .evaluate import EVALUATIONS
from .train import MODEL_KINDS

TOP_LEVEL = {
    "schema_version": int, "created": str, "versions": dict, "preset": dict, "seeds": list, "needle_task": dict,
    "models": dict, "runs": dict, "comparison": dict, "wall_s": float, "this_run": dict, "plots": dict,
}
TRAIN_KEYS = {"kind": str, "seed": int, "config": dict, "parameters": int, "steps": int, "history": list,
              "wall_s": float, "cpu_s": float}
COMPARISON_KEYS = {"label": str, "lower_is_better": bool, "unit": str, "diff": list, "baseline": list,
                   "diff_mean": float, "baseline_mean": float, "paired": dict, "verdict": str}
PAIRED_KEYS = ("mean", "low", "high", "n", "confidence", "excludes_zero")
VERSION_KEYS = ("difftx", "torch", "python", "platform")


def _check(obj: dict, spec: dict, where: str) -> None:
    for k, t in spec.items():
        if k not in obj:
            raise ValueError(f"results.json: {where} lacks {k!r}")
        ok = isinstance(obj[k], (int, float)) if t is float else isinstance(obj[k], t)
        if not ok:
            raise ValueError(f"results.json: {where}.{k} should be {t.__name__}, got {type(obj[k]).__name__}")


def validate_results(results: dict) -> None:
    """Raise ``ValueError`` naming the first field that does not follow the schema."""
    _check(results, TOP_LEVEL, "top level")
    for k in VERSION_KEYS:
        if k not in results["versions"]:
            raise ValueError(f"results.json: versions lacks {k!r}")
    for k in MODEL_KINDS:
        if k not in results["models"] or "config" not in results["models"][k]:
            raise ValueError(f"results.json: models lacks {k!r} or its config")
    for s in results["seeds"]:
        run = results["runs"].get(str(s))
        if run is None:
            raise ValueError(f"results.json: runs lacks seed {s}")
        for k in MODEL_KINDS:
            if k not in run:
                raise ValueError(f"results.json: runs.{s} lacks {k!r}")
            _check(run[k]["train"], TRAIN_KEYS, f"runs.{s}.{k}.train")
            for e in EVALUATIONS:
                if e not in run[k]["evals"]:
                    raise ValueError(f"results.json: runs.{s}.{k}.evals lacks {e!r}")
    if not results["comparison"]:
        raise ValueError("results.json: comparison is empty")
    for key, c in results["comparison"].items():
        _check(c, COMPARISON_KEYS, f"comparison.{key}")
        if len(c["diff"]) != len(results["seeds"]) or len(c["baseline"]) != len(results["seeds"]):
            raise ValueError(f"results.json: comparison.{key} needs one value per seed")
        for k in PAIRED_KEYS:
            if k not in c["paired"]:
                raise ValueError(f"results.json: comparison.{key}.paired lacks {k!r}")
