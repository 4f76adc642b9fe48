"""The shape of ``results.json`` (documented in ``docs/compare.md``): versioned, strict JSON
(no NaN or Infinity: a value that cannot be measured is ``null`` and its reason is recorded in
``null_reasons``), validated where it is written."""

from __future__ import annotations

import json

from ..io import dumps_strict

SCHEMA = "difftx.compare.results"
SCHEMA_VERSION = 3  # 3: two estimands (the verdict on exchangeability; the mean's betting test beside it)
READABLE_VERSIONS = (2, 3)  # results.json files this difftx reads (version 2: the verdict's p held the betting p)
SCALE_SCHEMA, SCALE_VERSION = "difftx.compare.scale", 3  # scale.json (difftx scale)
FOLDER_VERSION = 2  # compare.json: what the models and evaluations of a folder are (reused while it is the same)

TOP_LEVEL = {
    "schema": str, "schema_version": int, "created": str, "versions": dict, "preset": dict, "mixture": dict,
    "seeds": list,
    "arms": dict, "tasks": dict, "runs": dict, "comparison": dict, "null_reasons": dict, "wall_s": float,
}
TRAIN_KEYS = {"kind": str, "seed": int, "config": dict, "parameters": int, "steps": int, "history": list,
              "wall_s": float, "cpu_s": float}
TASK_KEYS = {"title": str, "settings": dict, "metrics": list}
COMPARISON_KEYS = {"task": str, "label": str, "lower_is_better": bool, "unit": str, "primary": bool, "diff": list,
                   "baseline": list, "diff_mean": float, "baseline_mean": float, "paired": dict, "family": str,
                   "verdict": str}
PAIRED_KEYS = ("mean", "low", "high", "p_value", "sign_flip_p", "n", "n_examples", "confidence", "method",
               "unadjusted_excludes_zero")
VERSION_KEYS = ("difftx", "torch", "python", "platform")


def _check(obj: dict, spec: dict, where: str) -> None:
    for k, t in spec.items():
        if k not in obj:
            raise ValueError(f"results.json: {where} lacks {k!r}")
        ok = isinstance(obj[k], (int, float)) if t is float else isinstance(obj[k], t)
        if not ok:
            raise ValueError(f"results.json: {where}.{k} should be {t.__name__}, got {type(obj[k]).__name__}")


def check_version(data: dict, where: str) -> None:
    """Refuse a comparison folder (``compare.json``) of another version with a clear message."""
    found = data.get("schema_version", 1)
    if found != FOLDER_VERSION:
        raise ValueError(f"{where}: written by a difftx with comparison folder version {found}; this difftx reads "
                         f"version {FOLDER_VERSION}. Its models and evaluations are not reused: compare into a new "
                         "--out (the old folder stays as it is)")


def read_results(path) -> dict:
    """A ``results.json`` of any version this difftx reads (:data:`READABLE_VERSIONS`), validated; a version 2
    file's ``paired.p_value`` of a bounded metric is the larger of the exchangeability and betting p-values, and
    it has no ``mean_established``."""
    from pathlib import Path

    from ..io import read_json

    data = read_json(Path(path), "the results of a comparison")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a comparison's results (not a JSON object)")
    validate_results(data, where=str(path))
    return data


def validate_results(results: dict, where: str = "results.json") -> None:
    """Raise ``ValueError`` naming the first field that does not follow the schema (any of
    :data:`READABLE_VERSIONS`)."""
    _check(results, TOP_LEVEL, "top level")
    if results["schema"] != SCHEMA:
        raise ValueError(f"results.json: schema should be {SCHEMA!r}, got {results['schema']!r}")
    if results["schema_version"] not in READABLE_VERSIONS:
        raise ValueError(f"{where}: results schema version {results['schema_version']}; this difftx reads versions "
                         f"{', '.join(map(str, READABLE_VERSIONS))}")
    for k in VERSION_KEYS:
        if k not in results["versions"]:
            raise ValueError(f"results.json: versions lacks {k!r}")
    for name, t in results["tasks"].items():
        _check(t, TASK_KEYS, f"tasks.{name}")
    for arm, a in results["arms"].items():
        if "config" not in a or "parameters" not in a:
            raise ValueError(f"results.json: arms.{arm} lacks its config or parameter count")
    for s in results["seeds"]:
        run = results["runs"].get(str(s))
        if run is None:
            raise ValueError(f"results.json: runs lacks seed {s}")
        for arm in results["arms"]:
            if arm not in run:
                raise ValueError(f"results.json: runs.{s} lacks {arm!r}")
            _check(run[arm]["train"], TRAIN_KEYS, f"runs.{s}.{arm}.train")
            for name in results["tasks"]:
                if name not in run[arm]["tasks"]:
                    raise ValueError(f"results.json: runs.{s}.{arm}.tasks lacks {name!r}")
    if not results["comparison"]:
        raise ValueError("results.json: comparison is empty")
    for pair, comps in results.get("arm_comparisons", {}).items():
        for key, c in comps.items():
            where = f"arm_comparisons.{pair}.{key}"
            if "paired" not in c or "verdict" not in c or len(c.get("arms", ())) != 2:
                raise ValueError(f"results.json: {where} lacks its arms, paired estimate or verdict")
            if any(len(c["values"][a]) != len(results["seeds"]) for a in c["arms"]):
                raise ValueError(f"results.json: {where} needs one value per seed and arm")
    for key, c in results["comparison"].items():
        if c.get("paired", {}).get("method") == "not measured":  # a machine measurement without a value here
            _check(c, {k: t for k, t in COMPARISON_KEYS.items() if t is not float}, f"comparison.{key}")
        else:
            _check(c, COMPARISON_KEYS, f"comparison.{key}")
        if len(c["diff"]) != len(results["seeds"]) or len(c["baseline"]) != len(results["seeds"]):
            raise ValueError(f"results.json: comparison.{key} needs one value per seed")
        for k in PAIRED_KEYS:
            if k not in c["paired"]:
                raise ValueError(f"results.json: comparison.{key}.paired lacks {k!r}")
    json.dumps(results, allow_nan=False)  # strict: raises on NaN / Infinity


def results_json(results: dict) -> str:
    """The text of ``results.json``: strict JSON of ``results`` (:func:`difftx.io.dumps_strict`),
    validated (:func:`validate_results`) before anything is written."""
    data = dumps_strict(results, indent=1)
    validate_results(json.loads(data))
    return data
