"""The shape of ``results.json`` (documented in ``docs/compare.md``): versioned, strict JSON
(no NaN or Infinity: a value that cannot be measured is ``null`` and its reason is recorded in
``null_reasons``), validated where it is written."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..io import dumps_strict, read_json
from ..tasks.subject import arm_record

SCHEMA = "difftx.compare.results"
# 4: every comparison keyed by its pair under ``comparisons`` (``{"arms", "primary", "metrics"}``), the arms with
# their label and description; 3: two estimands (the verdict on exchangeability; the mean's betting test beside it)
# 5: the preset's model fields in its "model" and its primary pair in "primary" (preset_record reads older presets);
# a comparison from a source has the arms source and converted (before: baseline and diff, as written in the file)
SCHEMA_VERSION = 5
READABLE_VERSIONS = (2, 3, 4, 5)  # results.json files this difftx reads (version 2: the verdict's p held the betting p)
SCALE_SCHEMA, SCALE_VERSION = "difftx.compare.scale", 3  # scale.json (difftx scale)
# compare.json: what the models and evaluations of a folder are (reused while it is the same); 3: the preset as
# results.json 5 writes it, and a comparison from a source (--from) has the arms source and converted (2: baseline
# and diff)
FOLDER_VERSION = 3
READABLE_FOLDER_VERSIONS = (2, 3)
# the preset fields that compare.json before version 3 and results.json before 5 wrote flat, now in the preset's
# "model"; a field given a value here meant it where the record lacks the field (records before "init")
FLAT_MODEL_FIELDS = {"dim": None, "n_layers": None, "n_heads": None, "init": "normal"}

TOP_LEVEL = {
    "schema": str, "schema_version": int, "created": str, "versions": dict, "preset": dict, "mixture": dict,
    "seeds": list,
    "arms": dict, "tasks": dict, "runs": dict, "null_reasons": dict, "wall_s": float,
}
# a model's training record (difftx.tasks.subject.TrainRecord); files written before it was named "arm" call the
# arm "kind" (read as "arm": arm_record)
TRAIN_KEYS = {"arm": str, "seed": int, "config": dict, "parameters": int, "steps": int, "history": list,
              "wall_s": float, "cpu_s": float}
TASK_KEYS = {"title": str, "settings": dict, "metrics": list}
COMPARISON_KEYS = {"task": str, "label": str, "lower_is_better": bool, "unit": str, "primary": bool, "arms": list,
                   "values": dict, "means": dict, "paired": dict, "family": str, "verdict": str}
# the one pair that files before results.json 5 (and compare.json 3) compared first, always: versions 2 and 3 wrote
# it under "comparison", with flat per-arm fields keyed by its arms' names
OLD_PAIR = ("diff", "baseline")
OLD_COMPARISON_KEYS = {"task": str, "label": str, "lower_is_better": bool, "unit": str, "primary": bool,
                       **{a: list for a in OLD_PAIR}, **{f"{a}_mean": float for a in OLD_PAIR}, "paired": dict,
                       "family": str, "verdict": str}
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
    """Refuse a comparison folder (``compare.json``) of a version this difftx does not read with a clear message."""
    found = data.get("schema_version", 1)
    if found not in READABLE_FOLDER_VERSIONS:
        raise ValueError(f"{where}: written by a difftx with comparison folder version {found}; this difftx reads "
                         f"versions {', '.join(map(str, READABLE_FOLDER_VERSIONS))}. Its models and evaluations are "
                         "not reused: compare into a new --out (the old folder stays as it is)")


def preset_record(preset: dict) -> dict:
    """A preset as any difftx wrote it (``compare.json``, ``results.json``, a model's training request) in today's
    form: the model fields older ones wrote flat (:data:`FLAT_MODEL_FIELDS`) in ``model``, and the primary pair
    they always had (:data:`OLD_PAIR`), where the record has none."""
    if "model" in preset:
        return preset
    model = {k: preset.get(k, v) for k, v in FLAT_MODEL_FIELDS.items() if k in preset or v is not None}
    out = {k: v for k, v in preset.items() if k not in FLAT_MODEL_FIELDS}
    return {**out, "model": model, "primary": list(OLD_PAIR)}


def model_dotted(preset: dict) -> dict:
    """A preset record with its model's fields as ``--set`` spells them: ``{"model": {"dim": 64}}`` ->
    ``{"model.dim": 64}`` (so that a changed model field is named). The schedule's and the execution's fields are
    written flat in every version (``lr``, ``workers``), and named so."""
    return {**{k: v for k, v in preset.items() if k != "model"},
            **{f"model.{k}": v for k, v in (preset.get("model") or {}).items()}}


def read_results(path) -> "CompareResult":
    """A ``results.json`` of any version this difftx reads (:data:`READABLE_VERSIONS`), validated, as a
    :class:`CompareResult` (:func:`from_json`); a version 2 file's ``paired.p_value`` of a bounded metric is the
    larger of the exchangeability and betting p-values, and it has no ``mean_established``."""
    data = read_json(Path(path), "the results of a comparison")
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a comparison's results (not a JSON object)")
    return from_json(data, where=str(path))


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
            _check(arm_record(run[arm]["train"]), TRAIN_KEYS, f"runs.{s}.{arm}.train")
            for name in results["tasks"]:
                if name not in run[arm]["tasks"]:
                    raise ValueError(f"results.json: runs.{s}.{arm}.tasks lacks {name!r}")
    if results["schema_version"] < 4:
        _check(results, {"comparison": dict}, "top level")
        groups = {"comparison": results["comparison"], **{f"arm_comparisons.{k}": v
                                                          for k, v in results.get("arm_comparisons", {}).items()}}
    else:
        _check(results, {"comparisons": dict}, "top level")
        groups = {}
        for key, c in results["comparisons"].items():
            _check(c, {"arms": list, "primary": bool, "metrics": dict}, f"comparisons.{key}")
            groups[f"comparisons.{key}.metrics"] = c["metrics"]
    if not next(iter(groups.values()), None):
        raise ValueError("results.json: no comparison")
    n = len(results["seeds"])
    for group, comps in groups.items():
        old_pairs = group.startswith("arm_comparisons")  # versions 2, 3: the other pairs, checked as they were
        for key, c in comps.items():
            where = f"{group}.{key}"
            if old_pairs and ("paired" not in c or "verdict" not in c):
                raise ValueError(f"results.json: {where} lacks its paired estimate or verdict")
            if not old_pairs:
                spec = OLD_COMPARISON_KEYS if group == "comparison" else COMPARISON_KEYS
                if c.get("paired", {}).get("method") == "not measured":  # a machine measurement without a value
                    spec = {k: t for k, t in spec.items() if t is not float}
                _check(c, spec, where)
                for k in PAIRED_KEYS:
                    if k not in c["paired"]:
                        raise ValueError(f"results.json: {where}.paired lacks {k!r}")
            arms = c.get("arms", list(OLD_PAIR) if group == "comparison" else ())
            values = c.get("values") or {a: c[a] for a in OLD_PAIR}
            if len(arms) != 2 or any(len(values.get(a, ())) != n for a in arms):
                raise ValueError(f"results.json: {where} needs two arms and one value per seed and arm")
    json.dumps(results, allow_nan=False)  # strict: raises on NaN / Infinity


def results_json(result: "CompareResult") -> str:
    """The text of ``results.json``: strict JSON of ``result`` (:func:`to_json`, :func:`difftx.io.dumps_strict`),
    validated (:func:`validate_results`) before anything is written."""
    data = dumps_strict(to_json(result), indent=1)
    validate_results(json.loads(data))
    return data


# -- the types a comparison's results are read as; only this module maps them to and from JSON --

# the flat fields version 2 and 3 gave the DIFF-vs-baseline comparisons (the same numbers as values, means, cis)
_FLAT = (*OLD_PAIR, *(f"{a}_{x}" for a in OLD_PAIR for x in ("mean", "ci")))


def pair_key(a: str, b: str) -> str:
    """``"diff vs baseline"``: the key of the comparison of arm ``a`` against arm ``b`` (the difference is a - b)."""
    return f"{a} vs {b}"


@dataclass
class RunRecord:
    """One model of a comparison (a seed and an arm): its training record, its task results and the machine that
    trained it (``None``: an older difftx recorded none)."""

    train: dict
    tasks: dict
    machine: Optional[dict] = None
    extra: dict = field(default_factory=dict)  # e.g. tune_value: the value a tuned comparison took this model at


@dataclass
class Comparison:
    """Every metric of arm ``arms[0]`` against arm ``arms[1]`` over paired seeds (``metrics``: ``{metric key:
    its statistics}``, each the difference a - b); ``primary``: a pair the plan names as the comparison's own
    question (DIFF vs baseline; for ``--from`` the converted model vs its source)."""

    arms: tuple
    metrics: dict
    primary: bool = False

    @property
    def key(self) -> str:
        return pair_key(*self.arms)


@dataclass
class CompareResult:
    """A comparison's results (``results.json``): the arms, every model's record (keyed by seed and arm), every
    comparison keyed by its pair, and what the comparison was (the other fields, as in ``docs/compare.md``)."""

    preset: dict
    seeds: list
    arms: dict  # name -> Arm (difftx.compare.arms), in the plan's order
    tasks: dict
    runs: dict  # (seed, arm) -> RunRecord
    comparisons: dict = field(default_factory=dict)  # pair key -> Comparison
    mixture: dict = field(default_factory=dict)
    created: str = ""
    versions: dict = field(default_factory=dict)
    null_reasons: dict = field(default_factory=dict)
    wall_s: float = 0.0
    token_efficiency: dict = field(default_factory=dict)
    look: int = 1
    looks: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # the other top-level fields (machine, execution, text, regime, tune...)

    def run(self, seed, arm: str) -> RunRecord:
        return self.runs[(int(seed), arm)]

    @property
    def primary(self) -> Comparison:
        """The first primary pair (DIFF vs baseline; ``--from``: converted vs source)."""
        return next(c for c in self.comparisons.values() if c.primary)

    def pair(self, a: str, b: str) -> Optional[Comparison]:
        return self.comparisons.get(pair_key(a, b))

    def label(self, arm: str) -> str:
        return self.arms[arm].label if arm in self.arms else arm

    def get(self, name: str, default=None):
        """One of the other top-level fields (``extra``): ``machine``, ``execution``, ``text``, ``regime``, ``tune``,
        ``plots``, ``this_run``, ..."""
        return self.extra.get(name, default)


def to_json(result: CompareResult) -> dict:
    """The JSON object of ``result`` (schema version :data:`SCHEMA_VERSION`)."""
    seeds = [str(s) for s in result.seeds]
    return {
        "schema": SCHEMA, "schema_version": SCHEMA_VERSION, "created": result.created, "versions": result.versions,
        **{k: v for k, v in result.extra.items() if k in _BEFORE},
        "preset": result.preset, "seeds": list(result.seeds),
        **{k: v for k, v in result.extra.items() if k in _MIDDLE},
        "mixture": result.mixture,
        "arms": {a.name: {"config": a.config, "parameters": a.parameters, "label": a.label,
                          "description": a.description, **({"source": a.source} if a.source else {})}
                 for a in result.arms.values()},
        "tasks": result.tasks,
        "runs": {s: {arm: {"train": r.train, "tasks": r.tasks, "machine": r.machine, **r.extra}
                     for arm in result.arms for r in [result.run(s, arm)]} for s in seeds},
        "null_reasons": result.null_reasons,
        **{k: v for k, v in result.extra.items() if k == "text"},
        "looks": result.looks, "look": result.look,
        "comparisons": {key: {"arms": list(c.arms), "primary": c.primary, "metrics": c.metrics}
                        for key, c in result.comparisons.items()},
        "token_efficiency": result.token_efficiency, "wall_s": result.wall_s,
        **{k: v for k, v in result.extra.items() if k not in _BEFORE + _MIDDLE + ("text",)},
    }


_BEFORE = ("machine", "execution")  # the order of the top-level fields, as earlier versions wrote them
_MIDDLE = ("needle_task",)
_TYPED = {"schema", "schema_version", "created", "versions", "preset", "seeds", "mixture", "arms", "tasks", "runs",
          "null_reasons", "looks", "look", "comparisons", "comparison", "arm_comparisons", "token_efficiency",
          "wall_s"}


def _unflatten(c: dict) -> dict:
    """A version 2 or 3 DIFF-vs-baseline comparison without its flat fields (an older one: with the per-arm fields
    made of them)."""
    out = {f: v for f, v in c.items() if f not in _FLAT}
    out.setdefault("arms", list(OLD_PAIR))
    out.setdefault("values", {a: c[a] for a in OLD_PAIR})
    out.setdefault("means", {a: c[f"{a}_mean"] for a in OLD_PAIR})
    out.setdefault("cis", {a: c.get(f"{a}_ci", [None, None]) for a in OLD_PAIR})
    return out


def from_json(data: dict, where: str = "results.json") -> CompareResult:
    """A :class:`CompareResult` of a ``results.json`` object of any version this difftx reads (validated). Versions 2
    and 3 kept DIFF vs baseline under ``comparison`` (with flat ``diff``/``baseline`` fields: the same numbers as its
    ``values``, ``means`` and ``cis``) and every other pair under ``arm_comparisons``; they are read as one pair
    each, DIFF vs baseline the primary one, and the arms' labels and descriptions from the arm table."""
    validate_results(data, where)
    from ..arm_table import ARMS
    from .arms import LABELS, Arm  # the labels a version 2 or 3 file did not record

    arms = {name: Arm(name, a["config"], a["parameters"], a.get("label") or LABELS.get(name, name),
                      a.get("description", ARMS.get(name, "")), a.get("source"))
            for name, a in data["arms"].items()}
    runs = {(int(s), arm): RunRecord(arm_record(r["train"]), r["tasks"], r.get("machine"),
                                     {k: v for k, v in r.items() if k not in ("train", "tasks", "machine")})
            for s, run in data["runs"].items() for arm, r in run.items() if arm in arms}
    if "comparisons" in data:
        comparisons = {key: Comparison(tuple(c["arms"]), c["metrics"], bool(c["primary"]))
                       for key, c in data["comparisons"].items()}
    else:  # versions 2 and 3
        first = {k: _unflatten(c) for k, c in data["comparison"].items()}
        comparisons = {pair_key(*OLD_PAIR): Comparison(OLD_PAIR, first, True)}
        for key, comps in (data.get("arm_comparisons") or {}).items():
            pair = next(iter(comps.values()))["arms"] if comps else key.split(" vs ")
            comparisons[key] = Comparison(tuple(pair), comps, False)
    return CompareResult(
        preset=preset_record(data["preset"]), seeds=list(data["seeds"]), arms=arms, tasks=data["tasks"], runs=runs,
        comparisons=comparisons, mixture=data["mixture"], created=data["created"], versions=data["versions"],
        null_reasons=data["null_reasons"], wall_s=data["wall_s"], token_efficiency=data.get("token_efficiency") or {},
        look=int(data.get("look") or 1), looks=list(data.get("looks") or []),
        extra={k: v for k, v in data.items() if k not in _TYPED})
