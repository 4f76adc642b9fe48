"""``difftx map``: the regime map as one command. A map spec (JSON; :func:`load_spec`, the shipped one
``configs/maps/regime-map.json``) names each cell by its axes (the initialisation, the depth, the width and the task;
``lambda_init``, the output scale and the per-head norm are each arm's, read off its config), and each cell is one
``difftx compare`` folder, ``OUT/<cell name>``, with the compare arguments those axes give.

:func:`run_map` trains only the cells whose folder is missing or unfinished (by :func:`difftx.compare.run_compare`
itself: a folder is reused and resumed as compare does; with ``shard`` every (cell, seed, arm) model is spread over
the invocations as ``difftx scale`` spreads its sizes'), reads every finished folder, and writes ``map.json``
(:func:`build_map`), ``map.md`` (opening with the answer per task, :func:`answer_lines`) and ``map.png``
(:func:`plot_map`). Cells measured before, whose folders were not kept, are recorded in a file of the same schema
(the spec's ``recorded``; the shipped one is ``docs/regime-map.json``): a recorded cell stands in for a missing
folder when it has the seeds and arms the spec asks for, and a finished folder always wins. Every cell says where
its numbers come from (``source``: ``folder`` or ``recorded``, with its ``provenance``).

Nothing is estimated here: every difference, interval and verdict is its compare's (:mod:`.scale_recall` reads them
out of ``results.json``), and the verdict's words are :func:`difftx.compare.summary.short_verdict`'s.
"""

from __future__ import annotations

import json
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..arm_table import PRIMARY
from ..overrides import dotted_items, value_text

REFERENCE = PRIMARY[1]  # the arm every cell's other arms are read against (the spec's arms always hold it)
MAP_SCHEMA = "difftx.map"
MAP_VERSION = 1
ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SPEC = ROOT / "configs" / "maps" / "regime-map.json"
DEFAULT_OUT = Path("runs/map")

# the axes a map names: a cell's own, and those each arm carries (its config's)
CELL_AXES = ("init", "depth", "width", "task")
ARM_AXES = ("lambda_init", "output_scale", "head_norm")
AXIS_FIELDS = {"init": "init", "depth": "n_layers", "width": "dim"}  # the preset field each cell axis sets
# per task: the compare metric a cell is read on
METRICS = {"recall": ("recall_frontier", "frontier"), "lm": ("lm_nll", "held-out NLL")}
SPEC_KEYS = ("title", "recorded", "tasks", "defaults", "cells")
TASK_KEYS = ("preset", "set")
CELL_KEYS = ("name", "axes", "arms", "seeds", "set", "heads", "note")
DEFAULT_KEYS = ("seeds", "arms", "task")
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._=-]*")

# what a cell's folder holds (:func:`cell_status`)
PRESENT, PARTIAL, MISSING = "present", "partial", "missing"


class SpecError(ValueError):
    """A map spec that cannot be used: one line naming the file, the cell and what is wrong."""


@dataclass
class Cell:
    """One cell of a map: a compare folder (``OUT/name``) and the arguments it is trained with."""

    name: str
    task: str
    axes: dict  # {init, depth, width, task}: this cell's coordinates
    preset: str  # the compare preset
    overrides: dict  # ComparePreset fields on top of it (the task's, the axes', the cell's; arms)
    seeds: int
    arms: tuple
    note: str = ""

    def compare_preset(self):
        """The :class:`~difftx.compare.presets.ComparePreset` this cell's folder is trained with."""
        from ..compare.presets import get_preset

        return get_preset(self.preset, **self.overrides)

    def seeds_warning(self, out: Path | str, seeds: Optional[int] = None) -> str:
        """One line where ``seeds`` (default the cell's) cannot give a verdict among this cell's comparisons at the
        look its folder ``out/name`` would be (:func:`difftx.compare.results.seeds_note`); "" where they can."""
        from ..compare.results import seeds_note

        note = seeds_note(Path(out) / self.name, range(seeds or self.seeds), self.arms,
                          self.compare_preset().primary)
        return f"{self.name}: {note}" if note else ""

    def command(self, out: Path | str, seeds: Optional[int] = None) -> str:
        """The ``difftx compare`` command that trains this cell into ``out/name``."""
        from ..compare.presets import get_preset

        parts = ["difftx compare", f"--preset {self.preset}", f"--seeds {seeds or self.seeds}"]
        if tuple(self.arms) != tuple(get_preset(self.preset).arms):
            parts.append("--arms " + ",".join(self.arms))
        parts += [f"--set {k}={value_text(v)}" for k, v in dotted_items({k: v for k, v in self.overrides.items()
                                                                         if k != "arms"})]
        parts.append(f"--out {Path(out) / self.name}")
        return " ".join(parts)


@dataclass
class MapSpec:
    title: str
    cells: list
    recorded: Optional[Path] = None
    path: Optional[Path] = None
    tasks: dict = field(default_factory=dict)


# -- the spec ---------------------------------------------------------------------------------------------------


def load_spec(path: Optional[Path | str] = None) -> MapSpec:
    """The map spec at ``path`` (default :data:`DEFAULT_SPEC`), validated (:func:`parse_spec`)."""
    path = Path(path) if path is not None else DEFAULT_SPEC
    if path.is_dir():
        raise SpecError(f"--spec {path}: a folder; give the map spec's JSON file (configs/maps/regime-map.json in a "
                        f"checkout)")
    if not path.is_file():
        raise SpecError(f"--spec {path}: not found" + ("" if path != DEFAULT_SPEC else
                                                       " (the shipped map spec lives in a checkout's configs/; give "
                                                       "your own with --spec FILE)"))
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise SpecError(f"--spec {path}: not JSON ({e})") from None
    return parse_spec(data, where=str(path), base=path.parent)


def _unknown(where: str, got, known: tuple, what: str) -> None:
    bad = [k for k in got if k not in known]
    if bad:
        raise SpecError(f"{where}: unknown {what} {', '.join(map(repr, bad))}; known: {', '.join(known)}")


def _positive_int(where: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise SpecError(f"{where}: must be a positive integer, got {v!r}")
    return v


def _arms(where: str, got) -> tuple:
    """Arm names (a list, or the name of an arm set: ``regime``, ...), the baseline and DIFF first."""
    from ..config import ARM_SETS, arm_names

    if isinstance(got, str):
        names = list(ARM_SETS[got]) if got in ARM_SETS else [a.strip() for a in got.split(",") if a.strip()]
    elif isinstance(got, list) and all(isinstance(a, str) for a in got):
        names = got
    else:
        raise SpecError(f"{where}: arms must be a list of arm names or an arm set's name, got {got!r}")
    unknown = [a for a in names if a not in arm_names()]
    if unknown or not names:
        raise SpecError(f"{where}: unknown arm(s) {unknown}; see `difftx info --arms` (sets: {', '.join(ARM_SETS)})")
    return tuple(dict.fromkeys([*PRIMARY[::-1], *names]))


def parse_spec(data, where: str = "map spec", base: Optional[Path] = None) -> MapSpec:
    """A :class:`MapSpec` from the spec's JSON object, every cell checked before anything trains: known keys and
    axes, each cell named once (a folder name), each axis value valid, the arms known, and the preset each cell
    gives valid (its error, prefixed by the cell). Raises :class:`SpecError`."""
    from ..config import INITS
    from ..compare.presets import PRESETS, get_preset

    if not isinstance(data, dict):
        raise SpecError(f"{where}: a map spec is a JSON object with {', '.join(SPEC_KEYS)}")
    _unknown(where, data, SPEC_KEYS, "key")
    tasks = data.get("tasks") or {}
    if not isinstance(tasks, dict) or not tasks:
        raise SpecError(f"{where}: tasks: give each task's compare preset, e.g. {{\"recall\": {{\"preset\": "
                        "\"recall-cpu\"}}")
    for t, body in tasks.items():
        if t not in METRICS:
            raise SpecError(f"{where}: tasks: unknown task {t!r}; a map's tasks are {', '.join(METRICS)}")
        if not isinstance(body, dict):
            raise SpecError(f"{where}: tasks.{t}: an object with {', '.join(TASK_KEYS)}")
        _unknown(f"{where}: tasks.{t}", body, TASK_KEYS, "key")
        if body.get("preset") not in PRESETS:
            raise SpecError(f"{where}: tasks.{t}.preset: {body.get('preset')!r} is not a compare preset; choose from "
                            f"{', '.join(sorted(PRESETS))}")
        if not isinstance(body.get("set", {}), dict):
            raise SpecError(f"{where}: tasks.{t}.set: an object of preset fields")
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise SpecError(f"{where}: defaults: an object with {', '.join(DEFAULT_KEYS)}")
    _unknown(f"{where}: defaults", defaults, DEFAULT_KEYS, "key")
    cells_in = data.get("cells")
    if not isinstance(cells_in, list) or not cells_in:
        raise SpecError(f"{where}: cells: give a list of cells, each {{\"name\": ..., \"axes\": {{...}}}}")
    cells, seen = [], set()
    for i, c in enumerate(cells_in):
        if not isinstance(c, dict):
            raise SpecError(f"{where}: cells[{i}]: a cell is an object with {', '.join(CELL_KEYS)}")
        name = c.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in (".", ".."):
            raise SpecError(f"{where}: cells[{i}]: name must be a folder name (letters, digits, . _ = -), "
                            f"got {name!r}")
        at = f"{where}: cell {name!r}"
        if name in seen:
            raise SpecError(f"{at}: duplicate cell (each cell is one folder, named once)")
        seen.add(name)
        _unknown(at, c, CELL_KEYS, "key")
        axes = c.get("axes") or {}
        if not isinstance(axes, dict):
            raise SpecError(f"{at}: axes: an object such as {{\"init\": \"torch\", \"depth\": 4}}")
        for k in axes:
            if k in ARM_AXES:
                raise SpecError(f"{at}: axis {k!r} is each arm's (its config's), not the cell's: choose the arms "
                                "(e.g. diff_lambda_0.8, diff_out_0.2, diff_no_head_norm)")
        _unknown(at, axes, CELL_AXES, "axis")
        task = axes.get("task", defaults.get("task", next(iter(tasks))))
        if task not in tasks:
            raise SpecError(f"{at}: axis task: {task!r} is not one of the spec's tasks ({', '.join(tasks)})")
        if "init" in axes and axes["init"] not in INITS:
            raise SpecError(f"{at}: axis init: {axes['init']!r} is not one of {', '.join(INITS)}")
        for k in ("depth", "width"):
            if k in axes:
                _positive_int(f"{at}: axis {k}", axes[k])
        sets = c.get("set") or {}
        if not isinstance(sets, dict):
            raise SpecError(f"{at}: set: an object of preset fields")
        for k in sets:
            if k in ("seeds", "arms", *AXIS_FIELDS.values()):
                axis = {v: a for a, v in AXIS_FIELDS.items()}.get(k)
                raise SpecError(f"{at}: set {k}: give it as " + (f"the axis {axis!r}" if axis else f"the cell's {k!r}"))
        body = tasks[task]
        preset = body["preset"]
        try:
            base_p = get_preset(preset, **body.get("set", {}))
        except (ValueError, TypeError) as e:
            raise SpecError(f"{where}: tasks.{task}: {e}") from None
        overrides = dict(body.get("set", {}))
        for axis, fld in AXIS_FIELDS.items():
            if axis in axes and axes[axis] != getattr(base_p, fld):
                overrides[fld] = axes[axis]
        width = axes.get("width", base_p.dim)
        if "heads" in c:
            overrides["n_heads"] = _positive_int(f"{at}: heads", c["heads"])
        elif width != base_p.dim:  # the preset's head width kept
            heads = width * base_p.n_heads / base_p.dim
            if heads != int(heads):
                raise SpecError(f"{at}: width {width} keeps no whole number of the preset's heads of width "
                                f"{base_p.dim // base_p.n_heads}: give \"heads\"")
            overrides["n_heads"] = int(heads)
        overrides.update(sets)
        seeds = _positive_int(f"{at}: seeds", c.get("seeds", defaults.get("seeds", 7)))
        arms = _arms(f"{at}: arms", c.get("arms", defaults.get("arms", list(base_p.arms))))
        overrides["arms"] = arms
        try:
            p = get_preset(preset, **overrides)
            p.resolve()
        except (ValueError, TypeError) as e:
            raise SpecError(f"{at}: {e}") from None
        coords = {"init": p.init, "depth": p.n_layers, "width": p.dim, "task": task}
        cells.append(Cell(name, task, coords, preset, overrides, seeds, arms, str(c.get("note") or "")))
    recorded = data.get("recorded")
    if recorded is not None and not isinstance(recorded, str):
        raise SpecError(f"{where}: recorded: a path (relative to the spec) to recorded cells, got {recorded!r}")
    rec = None if recorded is None else (base or Path(".")) / recorded
    return MapSpec(str(data.get("title") or "The regime map"), cells, rec, None if base is None else Path(where),
                   tasks)


# -- what a cell's folder holds -----------------------------------------------------------------------------------


def cell_status(cell: Cell, folder: Path, seeds: Optional[int] = None) -> tuple[str, str]:
    """``(status, detail)``: :data:`PRESENT` (a ``results.json`` with every seed and arm asked), :data:`PARTIAL`
    (a compare folder without them: it resumes) or :data:`MISSING` (no compare folder). Reads JSON only."""
    want = seeds or cell.seeds
    results, meta = folder / "results.json", folder / "compare.json"
    if results.is_file():
        try:
            data = json.loads(results.read_text(encoding="utf-8"))
            got_seeds, got_arms = len(data["seeds"]), list(data["arms"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            return PARTIAL, f"results.json unreadable ({type(e).__name__}): compare rewrites it"
        lacking = [a for a in cell.arms if a not in got_arms]
        if got_seeds >= want and not lacking:
            return PRESENT, f"results.json: {_seeds(got_seeds)}, {len(got_arms)} arms"
        why = [f"{got_seeds} of {want} seeds"] if got_seeds < want else []
        why += [f"lacks {', '.join(lacking)}"] if lacking else []
        return PARTIAL, "results.json with " + "; ".join(why)
    if meta.is_file():
        done = sum(1 for s in range(want) for a in cell.arms if (folder / f"seed{s}" / a / "train.json").is_file())
        return PARTIAL, f"{done} of {want * len(cell.arms)} models trained, no results.json yet"
    return MISSING, "no compare folder"


def _covers(recorded: dict, cell: Cell, seeds: int) -> bool:
    """Whether a recorded cell has the seeds and arms the spec asks of ``cell``."""
    return (recorded.get("seeds") or 0) >= seeds and all(a in (recorded.get("arms") or {}) for a in cell.arms)


def load_recorded(path: Optional[Path]) -> dict:
    """``{cell name: cell}`` of a recorded map (``map.json``'s schema), or ``{}`` without one."""
    if path is None:
        return {}
    if not Path(path).is_file():
        raise SpecError(f"recorded cells {path}: not found (the spec's \"recorded\")")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except ValueError as e:
        raise SpecError(f"recorded cells {path}: not JSON ({e})") from None
    if not isinstance(data, dict) or data.get("schema") != MAP_SCHEMA or not isinstance(data.get("cells"), list):
        raise SpecError(f"recorded cells {path}: not a map (schema {MAP_SCHEMA!r} with a list of cells)")
    if data.get("schema_version") != MAP_VERSION:
        raise SpecError(f"recorded cells {path}: map schema version {data.get('schema_version')!r}; this difftx "
                        f"reads {MAP_VERSION}")
    out = {}
    for c in data["cells"]:
        if not isinstance(c, dict) or not isinstance(c.get("name"), str) or c["name"] in out:
            raise SpecError(f"recorded cells {path}: each cell an object with a name, once")
        out[c["name"]] = {**c, "source": "recorded"}
    return out


@dataclass
class Plan:
    """What :func:`run_map` does with each cell: ``(cell, status, detail, use)``, ``use`` one of ``folder``
    (read it), ``recorded`` (the recorded cell stands in), ``train`` (compare trains or resumes it) or ``none``."""

    rows: list
    out: Path
    seeds: Optional[int]


def check_cells(spec: MapSpec, names) -> Optional[frozenset]:
    """``--cells``: the names given, each a cell of ``spec`` (None: every cell); an unknown one is refused with
    the spec's names."""
    if names is None:
        return None
    names = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)]
    known = [c.name for c in spec.cells]
    unknown = [n for n in names if n not in known]
    if unknown:
        what = ", ".join(repr(n) for n in unknown if n) or "an empty name"
        raise SpecError(f"--cells: {what} is not a cell of the spec; its cells: {', '.join(known)}")
    return frozenset(names)


def plan_map(spec: MapSpec, out: Path, seeds: Optional[int] = None, recorded: Optional[dict] = None,
             train: bool = True, cells: Optional[frozenset] = None) -> Plan:
    """Each cell's status and what is done with it (see :class:`Plan`). With ``cells`` (:func:`check_cells`) only
    those cells are trained; the others are read as with ``train=False``."""
    recorded = recorded or {}
    rows = []
    for cell in spec.cells:
        train_it = train and (cells is None or cell.name in cells)
        status, detail = cell_status(cell, out / cell.name, seeds)
        rec = recorded.get(cell.name)
        if status == PRESENT:
            use = "folder"
        elif status == MISSING and rec is not None and _covers(rec, cell, seeds or cell.seeds):
            use = "recorded"
        elif train_it:
            use = "train"
        else:
            use = "recorded" if rec is not None else "none"
        rows.append((cell, status, detail, use))
    return Plan(rows, out, seeds)


def dry_run_lines(plan: Plan, recorded: dict) -> list[str]:
    """``--dry-run``: every cell, its folder's status, where its numbers would come from, and its command."""
    lines = []
    for cell, status, detail, use in plan.rows:
        rec = recorded.get(cell.name)
        what = {"folder": "read from its folder",
                "recorded": "recorded (" + _provenance_text(rec) + ")" if rec else "recorded",
                "train": "to train" + (" (resumes)" if status == PARTIAL else "")
                         + (f"; the recorded cell ({rec.get('seeds')} seeds) does not have the seeds and arms asked"
                            if rec is not None and status == MISSING else ""),
                "none": "not measured"}[use]
        lines.append(f"{cell.name}: {status} ({detail}): {what}")
        lines.append(f"  {cell.command(plan.out, plan.seeds)}")
        note = cell.seeds_warning(plan.out, plan.seeds) if use == "train" else ""
        if note:
            lines.append(f"  note: {note}")
    counts = {s: sum(1 for r in plan.rows if r[1] == s) for s in (PRESENT, PARTIAL, MISSING)}
    todo = sum(1 for r in plan.rows if r[3] == "train")
    lines.append(f"{len(plan.rows)} cells: {counts[PRESENT]} present, {counts[PARTIAL]} partial, {counts[MISSING]} "
                 f"missing ({sum(1 for r in plan.rows if r[3] == 'recorded')} of them recorded); {todo} to train")
    return lines


def _provenance_text(c: Optional[dict]) -> str:
    p = (c or {}).get("provenance") or {}
    if c and c.get("source") == "folder":
        return f"read from {p.get('folder')}, results of {p.get('created') or 'an unknown date'}"
    entry = p.get("results_log")
    return (f"results log {entry!r}" if entry else "recorded") + (f"; folder {p['folder']}" if p.get("folder") else "")


# -- reading a folder -------------------------------------------------------------------------------------------


def arm_axes(cfg) -> dict:
    """An arm's own axes from its config: ``lambda_init`` per layer (``None`` for a kind without one), the head
    output scale per layer and whether a per-head norm runs."""
    from ..attention.modules import head_output_scale
    from ..compare.regime import regime

    if cfg.attention == "diff":
        r = regime(cfg, None, 1)
        lams, scales = r["lambda_init"], r["out_scale"]
    else:
        lams, scales = None, [head_output_scale(cfg.out_scale, i, 1.0) for i in range(cfg.n_layers)]
    rnd = (lambda xs: None if xs is None else [round(float(x), 4) for x in xs])
    return {"lambda_init": rnd(lams), "output_scale": rnd(scales), "head_norm": bool(cfg.uses_head_norm)}


def _ratio_at_init(res, arm: str) -> Optional[list]:
    """Each layer's attention output against the residual stream at step 0's probe, mean over seeds (``None``
    where a seed has no such probe)."""
    rows = []
    for s in res.seeds:
        probes = res.run(s, arm).train.get("probes") or []
        got = next((p.get("attention_output_ratio") for p in probes if p.get("step") == 0), None)
        if not got:
            return None
        rows.append(got)
    return [round(statistics.fmean(col), 4) for col in zip(*rows)]


def _learned_steps(res, arm: str) -> tuple[Optional[int], Optional[list]]:
    """How many seeds learned recall, and the range of the steps at which they did (``None, None`` without probes)."""
    from .scale_recall import learned_steps

    steps = learned_steps(res, arm)
    if steps is None:
        return None, None
    got = [x for x in steps if x is not None]
    return len(got), ([min(got), max(got)] if got else None)


def read_cell(cell: Cell, folder: Path) -> dict:
    """A finished folder's cell as ``map.json`` holds it (see :func:`build_map`)."""
    from ..config import ModelConfig
    from .scale_recall import _arm_reading, _difference, comparison
    from ..compare.schema import read_results

    res = read_results(folder / "results.json")
    key, label = METRICS[cell.task]
    arms, vs = {}, {}
    for arm in res.arms:
        c = None if arm == REFERENCE else comparison(res, arm, key, REFERENCE)
        vs_arm = None if c is None else _difference(c)
        if arm != REFERENCE:
            vs[arm] = vs_arm
        learned, steps = _learned_steps(res, arm) if cell.task == "recall" else (None, None)
        arms[arm] = {**arm_axes(ModelConfig.from_dict(res.arms[arm].config)), "metric": None,
                     "learned": learned, "learned_of": None if learned is None else len(res.seeds),
                     "learned_steps": steps, "ratio_at_init": _ratio_at_init(res, arm)}
    for arm in (a for a in res.arms if a != REFERENCE):  # each arm's reading from its comparison with the baseline
        c = comparison(res, arm, key, REFERENCE)
        if c is not None:
            for x in (arm, REFERENCE):
                if arms[x]["metric"] is None:
                    arms[x]["metric"] = _arm_reading(c, x)
    found = next((c for c in vs.values() if c), None)
    metric = {"key": key, "label": found["label"] if found else label, "lower_is_better": cell.task == "lm",
              "unit": found.get("unit") if found else None, "digits": 3}
    return {"name": cell.name, "task": cell.task, "axes": dict(cell.axes), "source": "folder",
            "provenance": {"folder": str(folder), "created": res.created, "difftx": res.versions.get("difftx"),
                           "commit": (res.looks[-1].get("commit") if res.looks else None)},
            "metric": metric, "seeds": len(res.seeds), "arms": arms, "vs_baseline": vs}


# -- the map ---------------------------------------------------------------------------------------------------


def build_map(spec: MapSpec, out: Path, seeds: Optional[int] = None, recorded: Optional[dict] = None,
              folders: bool = True) -> dict:
    """``map.json``: ``cells`` in the spec's order, each ``{name, task, axes, status, source, provenance, command,
    metric, seeds, arms: {arm: {lambda_init, output_scale, head_norm, metric: {mean, low, high}, learned,
    learned_of, learned_steps, ratio_at_init}}, vs_baseline: {arm: comparison | None}}`` (``source`` ``folder``,
    ``recorded`` or ``None`` where neither has numbers), and ``answer`` (:func:`answers`). ``folders=False``: the
    spec and its recorded cells alone, whatever ``out`` holds (:func:`docs_map`)."""
    recorded = recorded or {}
    cells = []
    for cell in spec.cells:
        status, detail = cell_status(cell, out / cell.name, seeds) if folders else (MISSING, "folders not read")
        if status == PRESENT:
            got = read_cell(cell, out / cell.name)
        elif cell.name in recorded:  # recorded numbers stand in for a folder that is not (yet) finished
            got = {**recorded[cell.name], "source": "recorded"}
        else:
            got = {"name": cell.name, "task": cell.task, "axes": dict(cell.axes), "source": None, "provenance": None,
                   "metric": None, "seeds": 0, "arms": {}, "vs_baseline": {}}
        p = cell.compare_preset()
        got.update(status=status, status_detail=detail, folder=str(out / cell.name),
                   command=cell.command(out, seeds), asked={"seeds": seeds or cell.seeds, "arms": list(cell.arms),
                                                            "steps": p.steps, "batch_size": p.batch_size})
        for c in (got.get("vs_baseline") or {}).values():
            if c is not None:  # in the words of this difftx, recorded cells too
                c["short_verdict"] = _verdict(c)
        cells.append(got)
    m = {"schema": MAP_SCHEMA, "schema_version": MAP_VERSION, "title": spec.title,
         "spec": None if spec.path is None else str(spec.path), "created": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                                         time.gmtime()),
         "axes": {"cell": list(CELL_AXES), "arm": list(ARM_AXES)}, "cells": cells}
    m["answer"] = answers(m)
    return m


def docs_map(spec: Optional[MapSpec] = None) -> dict:
    """The map docs/compare.md's table is rendered from (:func:`map_table`): the spec (default the shipped one) and
    its recorded cells alone, no folder read, every command at :data:`DEFAULT_OUT`."""
    spec = spec or load_spec()
    return build_map(spec, DEFAULT_OUT, recorded=load_recorded(spec.recorded), folders=False)


def _verdict(c: dict) -> str:
    """A comparison's verdict in the compare's words (:func:`difftx.compare.summary.short_verdict`); a recorded
    comparison whose test was not transcribed says so."""
    from ..compare.summary import short_verdict

    if c.get("not_recorded"):
        return f"test not recorded: {c['not_recorded']}"
    return short_verdict(c)


# -- the answer -------------------------------------------------------------------------------------------------

BETTER, WORSE, AHEAD, BEHIND = "better", "worse", "ahead in most seeds", "behind in most seeds"
NEITHER, NO_VERDICT, NOT_MEASURED = "neither learns", "no verdict", "not measured"


def classify(cell: dict, arm: str) -> str:
    """Where ``arm`` stands against the baseline in ``cell``: :data:`BETTER` or :data:`WORSE` where the mean
    difference is established (``mean_better``: a bounded metric's test of the mean), :data:`AHEAD` or
    :data:`BEHIND` where only the test of exchangeability rejects (the arms are not interchangeable, and the seeds
    lie on that side; the mean not established), :data:`NEITHER` (neither model learned the task in any seed, or the
    comparison was gated on it), :data:`NO_VERDICT`, or :data:`NOT_MEASURED` (no numbers for this arm)."""
    arms = cell.get("arms") or {}
    if arm not in arms or REFERENCE not in arms:
        return NOT_MEASURED
    c = (cell.get("vs_baseline") or {}).get(arm)
    learned = [arms[x].get("learned") for x in (arm, REFERENCE)]
    if learned == [0, 0] or (c is not None and str(c.get("gated") or "").startswith("not learned by either")):
        return NEITHER
    if c is None:
        return NOT_MEASURED if arms[arm].get("metric") is None else NO_VERDICT
    if c.get("mean_better"):
        return BETTER if c["mean_better"] == arm else WORSE
    if c.get("better"):
        return AHEAD if c["better"] == arm else BEHIND
    return NO_VERDICT


def answers(m: dict) -> dict:
    """``{task: {arm: {category: [cell names]}}}`` over every non-baseline arm the spec asks for (:func:`classify`)."""
    out: dict = {}
    for cell in m["cells"]:
        for arm in (a for a in cell["asked"]["arms"] if a != REFERENCE):
            out.setdefault(cell["task"], {}).setdefault(arm, {}).setdefault(classify(cell, arm), []).append(
                cell["name"])
    return out


TASK_WORDS = {"recall": ("Recall (the frontier, mean accuracy over the plain-MQAR cells)", "recalls"),
              "lm": ("Language modelling (held-out NLL, nats; lower is better)", "models the held-out text")}


def _join(xs: list[str]) -> str:
    return xs[0] if len(xs) == 1 else ", ".join(xs[:-1]) + " and " + xs[-1]


def answer_lines(m: dict) -> list[str]:
    """``map.md``'s opening: per task and arm, where it does better or worse than the baseline on average, where it
    is ahead or behind in most seeds (not interchangeable, the mean not established), where neither
    learns, where there is no verdict and where it was not measured; each cell with its difference and the
    compare's verdict."""
    by_name = {c["name"]: c for c in m["cells"]}
    lines = []
    for task, per_arm in m["answer"].items():
        head, verb = TASK_WORDS[task]
        lines.append(f"**{head}.**\n")
        for arm, where in per_arm.items():
            def shown(name: str) -> str:
                c = (by_name[name].get("vs_baseline") or {}).get(arm)
                if c is None:
                    return f"`{name}`"
                diff = _difference_text(c)
                return f"`{name}` ({'' if diff == '-' else diff + ': '}{c.get('short_verdict', '-')})"

            parts = []
            for cat, words in ((BETTER, f"{verb} better than the baseline on average in"),
                               (WORSE, "worse on average in"),
                               (AHEAD, "not interchangeable with the baseline, ahead in most seeds, in"),
                               (BEHIND, "not interchangeable with the baseline, behind in most seeds, in"),
                               (NEITHER, "neither it nor the baseline learns in"), (NO_VERDICT, "no verdict in"),
                               (NOT_MEASURED, "not measured in")):
                if where.get(cat):
                    parts.append(f"{words} {_join([shown(n) for n in where[cat]])}")
            if BETTER not in where:
                parts.insert(0, f"{verb} better than the baseline on average in no cell")
            lines.append(f"- `{arm}` {'; '.join(parts)}.")
        lines.append("")
    return lines


def _difference_text(c: dict) -> str:
    from ..compare.summary import difference_text

    return difference_text(c)


# -- the table (map.md and docs/compare.md) -----------------------------------------------------------------------


def _per_layer(xs: Optional[list]) -> str:
    if not xs:
        return "-"
    if len(set(xs)) == 1:
        return f"{xs[0]:g}"
    return ", ".join(f"{x:.2f}" for x in xs[:2]) + (f" .. {xs[-1]:.2f}" if len(xs) > 2 else "")


def _reading(r: Optional[dict], digits: int = 3) -> str:
    if not r or r.get("mean") is None:
        return "-"
    ci = "" if r.get("low") is None else f" [{r['low']:.{digits}f}, {r['high']:.{digits}f}]"
    return f"{r['mean']:.{digits}f}{ci}"


def _learned_text(a: dict) -> str:
    if a.get("learned") is None:
        return "-"
    steps = a.get("learned_steps")
    span = "" if not steps else f" ({steps[0]:,}-{steps[1]:,})" if steps[0] != steps[1] else f" ({steps[0]:,})"
    return f"{a['learned']} of {a['learned_of']}{span}"


def _cell_text(c: dict) -> str:
    ax, asked = c["axes"], c.get("asked") or {}
    budget = f", {asked['steps']:,} steps of {asked['batch_size']}" if asked.get("steps") else ""
    return f"`{c['name']}` ({ax['init']}, {ax['depth']} x {ax['width']}, {c['task']}{budget})"


def map_table(m: dict) -> str:
    """One row per cell and arm: the arm's axes, its seeds that learned, its reading, its difference from the
    baseline with the compare's interval and verdict, its first layer's output/residual at initialisation; a cell
    without numbers is one row saying so. Then where each cell's numbers come from."""
    rows = ["| cell (init, layers x width, task, budget) | arm | λ_init | output scale | norm | learned (seeds) | "
            "frontier or NLL [95%] | arm - baseline [95%] | verdict | output/residual at init, layer 0 |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for c in m["cells"]:
        if not c.get("arms"):
            rows.append(f"| {_cell_text(c)} | {', '.join(a for a in c['asked']['arms'])} | | | | | | | "
                        f"{'unfinished' if c.get('status') == PARTIAL else NOT_MEASURED} | |")
            continue
        first = True
        for arm, a in c["arms"].items():
            d = (c.get("vs_baseline") or {}).get(arm)
            diff = ["", ""] if arm == REFERENCE else ["-", NOT_MEASURED] if d is None else \
                [_difference_text(d), d.get("short_verdict", "-")]
            ratio = a.get("ratio_at_init")
            rows.append(f"| {_cell_text(c) if first else ''} | {arm} | {_per_layer(a.get('lambda_init'))} | "
                        f"{_per_layer(a.get('output_scale'))} | {'yes' if a.get('head_norm') else 'no'} | "
                        f"{_learned_text(a)} | {_reading(a.get('metric'))} | {diff[0]} | {diff[1]} | "
                        f"{'-' if not ratio else f'{ratio[0]:.2f}'} |")
            first = False
    notes = [f"- `{c['name']}`: " + source_text(c) for c in m["cells"]]
    return "\n".join(rows) + "\n\n" + "\n".join(notes) + "\n"


def _seeds(n: int) -> str:
    return f"{n} seed{'' if n == 1 else 's'}"


def source_text(c: dict) -> str:
    """Where a cell's numbers come from, in one line."""
    p = c.get("provenance") or {}
    if c.get("source") == "folder":
        return f"read from its folder {p.get('folder')} (results of {p.get('created') or 'an unknown date'}), " \
               f"{_seeds(c['seeds'])}."
    if c.get("source") == "recorded":
        kept = f"; folder {p['folder']}" if p.get("folder") else ""
        note = f" {p['note']}" if p.get("note") else ""
        where = f"the results log, {p['results_log']}" if p.get("results_log") else \
            f"a folder read at {p.get('created') or 'an unknown date'} (no results-log entry named)"
        return f"recorded from {where}{kept}; {_seeds(c['seeds'])}.{note}"
    if c.get("status") == PARTIAL:
        return f"unfinished ({c.get('status_detail')}): `{c['command']}`."
    return f"not measured: `{c['command']}`."


# -- outputs ----------------------------------------------------------------------------------------------------


def render_map(m: dict) -> str:
    """``map.md``: the answer per task, the table, where each cell comes from, the figure."""
    out = [f"# {m['title']}\n", *answer_lines(m),
           "Each cell is one `difftx compare` folder; every difference, interval and verdict is its compare's "
           "(Holm within each cell's compare, not across cells). Recall differences are in the frontier, LM ones in "
           "held-out NLL (nats). A recorded cell is one measured before and kept in the spec's recorded file (transcribed "
           "from the results log, or read from a folder with `--record`), its folder not read; a finished folder wins "
           "over a recorded cell.\n", map_table(m)]
    if m.get("plot"):
        out.append(f"![the map: each cell's arm - baseline with its verdict]({m['plot']})\n")
    return "\n".join(out)


CATEGORY_COLORS = {BETTER: "#5cb270", WORSE: "#e06666", AHEAD: "#b7e1c0", BEHIND: "#f6c6c6", NEITHER: "#bdbdbd",
                   NO_VERDICT: "#dde8f5", NOT_MEASURED: "#ffffff"}


def plot_map(path: Path, m: dict) -> Optional[str]:
    """``map.png``: one row per cell, one column per arm asked besides the baseline; each tile the arm minus the
    baseline and the compare's verdict, coloured by where the arm stands (:func:`classify`). ``None`` without
    matplotlib."""
    try:
        from ..eval.plots import _plt, _save
        plt = _plt()
    except ImportError:
        return None
    from matplotlib.patches import Patch, Rectangle

    cells = m["cells"]
    arms = list(dict.fromkeys(a for c in cells for a in c["asked"]["arms"] if a != REFERENCE))
    if not cells or not arms:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.9 * len(arms) + 2.5), 0.8 * len(cells) + 1.6))
    for i, c in enumerate(cells):
        for j, arm in enumerate(arms):
            if arm not in c["asked"]["arms"]:
                continue
            cat = classify(c, arm)
            ax.add_patch(Rectangle((j, i), 1, 1, facecolor=CATEGORY_COLORS[cat], edgecolor="#888888", lw=0.6,
                                   hatch="//" if c.get("source") == "recorded" else None))
            d = (c.get("vs_baseline") or {}).get(arm)
            if d is None:
                text = cat
            else:
                diff = _difference_text(d).split(" [")[0].split(";")[0]
                verdict = "test not recorded" if d.get("not_recorded") else d.get("short_verdict", "")
                text = ("" if diff == "-" else diff + "\n") + _short(verdict)
            ax.text(j + 0.5, i + 0.5, text, ha="center", va="center", fontsize=6.5)
    ax.set_xlim(0, len(arms))
    ax.set_ylim(len(cells), 0)
    ax.set_xticks([j + 0.5 for j in range(len(arms))], [f"{a}\n- baseline" for a in arms], fontsize=7)
    ax.set_yticks([i + 0.5 for i in range(len(cells))],
                  [f"{c['name']} ({c['axes']['init']}, {c['axes']['depth']}x{c['axes']['width']}, {c['task']})"
                   for c in cells], fontsize=7)
    ax.tick_params(length=0)
    handles = [Patch(facecolor=col, edgecolor="#888888", label=cat) for cat, col in CATEGORY_COLORS.items()]
    handles.append(Patch(facecolor="white", edgecolor="#888888", hatch="//", label="recorded (folder not read)"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_title(f"{m['title']}: each arm minus the baseline (frontier; LM: held-out NLL) and its verdict",
                 fontsize=9)
    _save(fig, path)
    return Path(path).name


def _short(text: str, width: int = 24) -> str:
    """A verdict broken into lines of about ``width`` characters for a tile."""
    words, lines, line = text.split(), [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}".strip()
    return "\n".join(lines + [line])


def write_map(out: Path, m: dict) -> None:
    """``map.json``, ``map.md`` and ``map.png`` into ``out``."""
    from ..io import atomic_write, dumps_strict

    out.mkdir(parents=True, exist_ok=True)
    m["plot"] = plot_map(out / "map.png", m)
    atomic_write(out / "map.json", lambda p: Path(p).write_text(dumps_strict(m, indent=1) + "\n"))
    atomic_write(out / "map.md", lambda p: Path(p).write_text(render_map(m)))


def record_cells(m: dict, path: Path, cells: Optional[frozenset] = None) -> list[str]:
    """Add the cells this map read from folders (those in ``cells`` alone, when given) to the recorded map at
    ``path`` (created if missing), replacing a recorded cell of the same name: the folder's numbers, kept when the
    folder is not. A recorded cell of the same run (its provenance's ``created`` is the folder's) keeps its
    provenance's words (results log entry, note, commit), so recording again loses nothing written by hand.
    Returns their names."""
    from ..io import atomic_write, dumps_strict

    data = {"schema": MAP_SCHEMA, "schema_version": MAP_VERSION, "title": m["title"], "cells": []}
    if Path(path).is_file():
        load_recorded(Path(path))  # checked
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    keep = ("name", "task", "axes", "source", "provenance", "metric", "seeds", "arms", "vs_baseline")
    names = []
    before = {x.get("name"): x for x in data["cells"]}
    for c in m["cells"]:
        if c.get("source") != "folder" or cells is not None and c["name"] not in cells:
            continue
        new = {k: c[k] for k in keep}
        new["source"] = "recorded"
        old = (before.get(c["name"]) or {}).get("provenance") or {}
        if old.get("created") and old.get("created") == new["provenance"].get("created"):
            new["provenance"] = {**new["provenance"], **old}
        data["cells"] = [x for x in data["cells"] if x.get("name") != c["name"]] + [new]
        names.append(c["name"])
    order = {c["name"]: i for i, c in enumerate(m["cells"])}
    data["cells"].sort(key=lambda x: order.get(x.get("name"), len(order)))
    atomic_write(path, lambda p: Path(p).write_text(dumps_strict(data, indent=1, ensure_ascii=False) + "\n",
                                                    encoding="utf-8"))
    return names


# -- the command --------------------------------------------------------------------------------------------------


def _map_entry(entry: Path) -> bool:
    """Whether ``entry`` of a map's folder is the map's own: its report or plot, or a cell (a compare folder, its
    results alone, or an empty folder)."""
    if entry.is_dir():
        return any((entry / f).is_file() for f in ("compare.json", "results.json")) or not any(entry.iterdir())
    return entry.name in ("map.md", "map.png")


def run_map(spec: MapSpec, out: Path, *, seeds: Optional[int] = None, workers: Optional[int] = None,
            shard: Optional[tuple[int, int]] = None, use_recorded: bool = True, train: bool = True,
            progress: bool = True, cells: Optional[frozenset] = None, log=print) -> Optional[dict]:
    """Train the cells that need it (see :func:`plan_map`; only those in ``cells`` when given), then write and
    return the map (:func:`write_map`).
    With ``shard`` (K, N) this invocation trains only its share of every cell's models (every N-th (cell, seed,
    arm) over the spec's cells in order, so the share depends on the spec alone) and writes no map: run once more
    without it to finish the cells' reports and write the map."""
    from ..compare.folder import check_study_folder
    from ..compare.run import run_compare
    from ..compare.workers import refuse_in_worker_start

    refuse_in_worker_start("run_map")
    check_study_folder(out, "--out", "map.json", "a regime map", _map_entry)
    recorded = load_recorded(spec.recorded) if use_recorded else {}
    plan = plan_map(spec, out, seeds, recorded, train=train, cells=cells)
    offset = 0
    for cell, status, detail, use in plan.rows:
        n = seeds or cell.seeds
        if use == "train":
            log(f"map: cell {cell.name} ({status}: {detail}): {cell.command(out, seeds)}")
            run_compare(cell.compare_preset(), n, out / cell.name, progress=progress, workers=workers, shard=shard,
                        shard_offset=offset)
        offset += n * len(cell.arms)
    if shard is not None:
        return None
    m = build_map(spec, out, seeds, recorded)
    write_map(out, m)
    return m
