"""``--tune FIELD=V1,V2,...``: each arm of a comparison at its own value of one training setting
(the learning rate first of all), chosen without selection bias.

Every arm trains at every value for every seed (each (arm, value) a stack of the seeds). The
preset's own value is always in the grid: its comparison is the folder itself (``out``, a plain
``difftx compare`` folder, so an earlier run there is reused); each other value is a compare
folder ``out/tune/FIELD=VALUE``. Then, for each model, two scores on text it never trained on:

- the **validation loss**, which chooses: the mean NLL over the first half of the training
  corpus's validation split (the whole split when ``--heldout FILE`` gives separate evaluation text);
- the **held-out evaluation**, which is reported: the LM task on the second half of the validation
  split (with ``--heldout FILE``, the model's own evaluation of that file).

So the choice never reads the evaluated text. Where the split's documents are known, the halves are
whole documents (:func:`halves`): the second gets at least ``MIN_BLOCKS`` (4) of them where the
split holds 5 or more, so that its LM interval can be over documents like these; with 2-4
documents the cut is the document start nearest the middle, and ``split_note`` says why its
interval is over windows of this one text instead. For seed ``s`` an arm's value is the one with the
lowest mean validation loss over the *other* seeds (leave-one-seed-out, :func:`choose`): the
difference reported for seed ``s`` carries no selection on its own noise. An arm whose best value
(mean over all seeds) sits at an edge of its grid gets one more value beyond it (x2 or /2), at
most :data:`MAX_EXTENSIONS` times; still at the edge after that, it is flagged.

The tuned comparison (each seed's models at their chosen values) is the primary one; the
comparison at the preset's value, scored on the same held-out half, stands beside it; both use
the comparison's own statistics (:func:`difftx.compare.summary.all_comparisons`). ``tune.json``,
a section at the top of ``report.md`` (with ``results.json`` under ``tune``) and
``plots/tune_FIELD.png`` (validation loss against the value per arm: seeds faint, means bold, each
arm's best value marked) hold the result (:mod:`difftx.studies.tune_report` renders them).

A named setting is tuned the same way (:data:`CHOICE_FIELDS`: ``--tune init=normal,torch`` chooses each
arm's initialisation per seed); its grid is the names given and the preset's, never extended.

On a cluster, ``shard=(K, N)`` spreads the models of every value over the invocations; the run
without ``shard`` trains the extensions (they depend on every seed's scores) and assembles.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
from pathlib import Path
from typing import Optional, Sequence

from ..config import INITS
from ..io import atomic_write, check_record, dumps_strict, own_folder
from ..compare.evaluate import EVALS_DIR, read_eval, write_eval
from ..compare.plan import check
from ..compare.presets import ComparePreset, flat_field, get_preset, lr_overrides
from ..compare.schema import CompareResult, RunRecord
from .tune_report import label, tune_section

TUNE_DIR, TUNE_FILE, SCORE_FILE = "tune", "tune.json", "tune_scores.json"
CHOICE_FIELDS = {"init": INITS}  # preset fields --tune takes by name: {field: its choices}
TUNE_SCHEMA, TUNE_VERSION = "difftx.compare.tune", 1  # a name, not the module's path: written tune.json files read
SCORE_VERSION = 2  # of SCORE_FILE; 2: the validation split cut by documents where they are known
SCORE_FIELDS = {"version": "int", "validation": "number", "heldout": "dict?"}
MAX_EXTENSIONS = 2  # values added beyond an edge of an arm's grid, at most, per arm


def parse_tune(text: str) -> tuple[str, list]:
    """``"lr=1e-3,3e-3"`` (or ``schedule.lr=...``) -> ``("lr", [0.001, 0.003])``; the field must be a numeric
    training field of :class:`ComparePreset` (whole numbers for an integer field) or one of :data:`CHOICE_FIELDS`
    (``"init=normal,torch"``: names from its choices)."""
    from ..compare.folder import NOT_TRAINING_FIELDS

    field, sep, rest = str(text).partition("=")
    field = flat_field(field.strip())  # --tune schedule.lr=... is --tune lr=...
    known = ComparePreset.field_defaults()
    numeric = sorted(n for n, v in known.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
                     and n not in NOT_TRAINING_FIELDS)
    if sep and field in CHOICE_FIELDS:
        values = [v.strip() for v in rest.split(",") if v.strip()]
        bad = [v for v in values if v not in CHOICE_FIELDS[field]]
        if bad or not values or len(set(values)) != len(values):
            raise ValueError(f"--tune {field}: need distinct values from {CHOICE_FIELDS[field]}, got {rest!r}")
        return field, values
    if not sep or field not in numeric:
        raise ValueError(f"--tune {text!r}: expected FIELD=V1,V2,... with FIELD one of "
                         f"{numeric + sorted(CHOICE_FIELDS)}")
    cast = int if isinstance(known[field], int) and field not in ("lr", "min_lr") else float
    try:
        values = [cast(v) for v in rest.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--tune {field}: every value must be a {'whole ' if cast is int else ''}number, "
                         f"got {rest!r}") from None
    if not values or len(set(values)) != len(values):
        raise ValueError(f"--tune {field}: need distinct values, got {rest!r}")
    return field, values


def choose(scores: dict, n_seeds: int) -> list:
    """Leave-one-seed-out choice: ``scores[value][i]`` is seed ``i``'s validation loss at ``value``;
    returns, for each seed ``i``, the value with the lowest mean over the other seeds (ties: the
    first in sorted order). Seed ``i``'s own losses are never read for its own choice."""
    if n_seeds < 2:
        raise ValueError("--tune: leave-one-seed-out needs at least 2 seeds")
    out = []
    for i in range(n_seeds):
        def others(v, i=i):
            return sum(x for j, x in enumerate(scores[v]) if j != i) / (n_seeds - 1)
        out.append(min(sorted(scores), key=others))
    return out


def beyond_edge(values: Sequence, scores: dict) -> Optional[tuple[str, float]]:
    """``("upper" | "lower", new value)`` when the value with the lowest mean loss over all seeds is
    the largest (x2) or the smallest (/2; whole numbers for an integer field, never 0) of
    ``values``; None otherwise, and None for named choices (no value lies beyond them)."""
    if any(isinstance(v, str) for v in values):
        return None
    grid = sorted(values)
    best = min(grid, key=lambda v: sum(scores[v]) / len(scores[v]))
    if best == grid[-1]:
        return "upper", best * 2
    if best == grid[0]:
        new = best // 2 if isinstance(best, int) else best / 2
        return ("lower", new) if new and new not in grid else None
    return None


def point_preset(base: ComparePreset, field: str, value) -> ComparePreset:
    """``base`` at ``field = value`` (``lr`` brings ``min_lr`` along, in the preset's ratio); at the
    preset's own value, ``base`` itself (no rounding of ``min_lr`` may make it another comparison)."""
    if value == getattr(base, field):
        return base
    point = base.with_overrides(**(lr_overrides(base, value) if field == "lr" else {field: value}))
    check(point)  # the fields together, by the trainer's rules too: refused before anything is trained
    return point


def grid_points(base: ComparePreset, tune: tuple[str, Sequence], seeds: list, shard=None) -> dict:
    """``{value: the preset at it}`` for the grid of ``tune`` (its values and the preset's own), every
    point checked as a whole (:func:`point_preset`): a value the trainer would refuse (``lr=inf``,
    ``weight_decay=-1``) is a ``ValueError`` here, before anything is trained or written."""
    field, values = tune
    shared = getattr(base, field)
    grid = sorted(set(values) | {shared})
    if len(grid) < 2:
        raise ValueError(f"--tune {field}: the grid needs a value besides the preset's {shared}")
    if shard is None and len(seeds) < 2:
        raise ValueError("--tune: leave-one-seed-out needs at least 2 seeds")
    if base.lm_every == 0 and base.recall_every == 0:
        raise ValueError("--tune: the choice reads a validation loss, which needs LM batches (lm_every > 0) or "
                         "recall batches (recall_every > 0)")
    return {v: point_preset(base, field, v) for v in grid}


def run_tuned(preset: str | ComparePreset, seeds: int | Sequence[int], out_dir: str | os.PathLike,
              tune: tuple[str, Sequence], *, progress: bool = True, workers: Optional[int] = None,
              shard: Optional[tuple[int, int]] = None, shard_offset: int = 0, **overrides) -> dict:
    """The tuned comparison (see the module doc). Returns a :class:`Tuned`: the results of the comparison at the
    preset's value with ``tune`` added (the tuned and the shared comparison, the choices), and the two comparisons
    as whole results (what :func:`difftx.studies.scale.summarise` reads); with ``shard``, only this invocation's
    share is trained: ``{"shard": [K, N], "models": how many models the grid has}``."""
    from ..compare.run import run_compare
    from ..compare.workers import refuse_in_worker_start

    refuse_in_worker_start("run_tuned")
    base = get_preset(preset, **overrides) if isinstance(preset, str) else preset.with_overrides(**overrides)
    field = tune[0]
    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    points = grid_points(base, tune, seed_list, shard)
    shared, grid = getattr(base, field), sorted(points)
    out = Path(out_dir)
    folder = {v: out if v == shared else out / TUNE_DIR / label(field, v) for v in grid}
    order = [shared] + [v for v in grid if v != shared]  # the folder's own compare first: it owns `out`
    if shard is not None:
        offset = shard_offset
        for v in order:
            run_compare(points[v], seed_list, own_folder(folder[v], below=out), progress=progress, workers=workers,
                        shard=shard, shard_offset=offset)
            offset += len(seed_list) * len(base.arms)
        return {"shard": list(shard), "models": offset - shard_offset}
    results = run_compare(points[shared], seed_list, out, progress=progress, workers=workers)
    for v in order[1:]:
        run_compare(points[v], seed_list, own_folder(folder[v], below=out), progress=progress, workers=workers,
                    report=False)
    arms = list(results.arms)  # the comparison's (compare --from: the source and its conversion)
    grids = {arm: list(grid) for arm in arms}
    scores = {arm: {v: _scores(points[v], folder[v], seed_list, arm, progress) for v in grid} for arm in arms}
    extended: dict = {arm: [] for arm in arms}
    for _ in range(MAX_EXTENSIONS):
        need: dict = {}
        for arm in arms:
            edge = beyond_edge(grids[arm], {v: [s["validation"] for s in scores[arm][v]] for v in grids[arm]})
            if edge is not None:
                need.setdefault(edge[1], []).append(arm)
        added = False
        for v, who in sorted(need.items()):
            try:
                points[v] = point_preset(base, field, v)
            except ValueError:  # beyond what the preset allows (a learning rate under its warmup rule...)
                continue
            folder[v] = out / TUNE_DIR / label(field, v)
            run_compare(points[v], seed_list, own_folder(folder[v], below=out), progress=progress, workers=workers,
                        only_arms=who)
            for arm in who:
                grids[arm] = sorted(grids[arm] + [v])
                extended[arm].append(v)
                scores[arm][v] = _scores(points[v], folder[v], seed_list, arm, progress)
                added = True
        if not added:
            break
    tune_info, tuned, shared_half = assemble(results, points[shared].resolve().tasks, field, shared, grids, folder,
                                             scores, extended, seed_list)
    write_tune(out, results, tune_info, progress)
    return Tuned(results, tuned, shared_half)


@dataclasses.dataclass
class Tuned:
    """What :func:`run_tuned` returns: ``result``, the comparison at the preset's value with its ``tune`` record;
    ``tuned`` and ``shared``, the tuned comparison and the one at the preset's value, both on the held-out half."""

    result: CompareResult
    tuned: CompareResult
    shared: CompareResult


def _scores(p: ComparePreset, folder: Path, seeds: list, arm: str, progress: bool) -> list[dict]:
    """Per seed, the model's ``{"validation": NLL, "heldout": LM result or None}`` (stored in its
    folder as :data:`SCORE_FILE`; computed once)."""
    out = []
    for s in seeds:
        f = folder / f"seed{s}" / arm
        path = f / SCORE_FILE
        got = None
        if path.is_file():
            try:  # sealed and typed: a file changed since, or of an older version, is scored again
                got = check_record(read_eval(path, "tuning scores"), SCORE_FIELDS, str(path))
                got = got if got["version"] == SCORE_VERSION else None
            except ValueError:
                got = None
        if got is None:
            got = write_eval(path, {"version": SCORE_VERSION, **score_model(f, p)})
        out.append(got)
    return out


def score_model(f: Path, p: ComparePreset) -> dict:
    """A trained compare model's validation loss (the mean NLL over the first half of its corpus's
    validation split, or all of it when the held-out text is a separate file) and, where the
    held-out text is that split, the LM task on its second half (else None: its own evaluation);
    ``split``: how the split was cut (:func:`halves`)."""
    from ..tasks import TASKS, load_subject
    from ..tasks.lm import document_offsets
    from ..tasks.runner import run_task
    from ..training.distributed import resolve_device

    settings = p.task_settings()["lm"]
    subject = load_subject(f / "model", device=resolve_device(p.device))
    if not subject.has_text:  # recall alone: the loss on fresh examples of the training mixture
        return recall_validation(subject)
    text = subject.text
    split = None
    if text is not None and text.heldout is not None:
        task = dataclasses.replace(subject.compare, text=dataclasses.replace(text, heldout=None))
        choose_on, report_on = dataclasses.replace(subject, compare=task, _heldout=None).heldout(), None
    else:
        whole = subject.heldout()
        whole = dataclasses.replace(whole, doc_offsets=document_offsets(subject, whole))
        choose_on, report_on, split = halves(whole)
    quick = dataclasses.replace(settings, extrapolation_factors=(1,))
    val = run_task(TASKS["lm"], dataclasses.replace(subject, _heldout=choose_on), quick)
    held = None if report_on is None else run_task(TASKS["lm"], dataclasses.replace(subject, _heldout=report_on),
                                                   settings)
    return {"validation": val["heldout"]["nll"], "validation_source": choose_on.source, "heldout": held,
            "split": split}


VALIDATION_SEED = 98765  # the recall examples --tune chooses on (the evaluation's are EVAL_SEED's)


def recall_validation(subject) -> dict:
    """A compare model trained on recall alone: its validation loss is the mean NLL at every query of 64
    fresh examples of each training pair count at the training length (:data:`VALIDATION_SEED`, never
    the evaluation's examples); the compared evaluation is the model's own recall task."""
    from ..eval.recall import generate, recall_nll

    block, device = subject.recall, next(subject.model.parameters()).device
    losses = [recall_nll(subject.model, block.shifted(generate(spec, 64, seed=VALIDATION_SEED + i)), device=device)
              for i, spec in enumerate(block.specs())]
    return {"validation": sum(losses) / len(losses), "heldout": None, "split": None,
            "heldout_source": "each model's own recall evaluation (the grid's examples, never chosen on)",
            "validation_source": f"the recall loss at the queries of 64 fresh examples of each training pair count "
                                 f"({', '.join(map(str, block.pairs))}) at length {block.seq_len}"}


def halves(h) -> tuple:
    """``(first, second, split)``: the held-out stream ``h`` cut in two, the first to choose on and the
    second to evaluate, and how it was cut. Where its documents are known (``h.doc_offsets``: their
    starts, then the length) and number ``D >= MIN_BLOCKS + 1``, the cut is between documents and the
    second half gets the last ``max(ceil(D / 2), MIN_BLOCKS)`` of them: enough for an interval over
    documents like these, the rest (at least one) to choose on. With 2 to ``MIN_BLOCKS`` documents,
    the cut is at the document start nearest the middle, and neither half has enough (``split["note"]``
    says so). Otherwise (one document, or none known) the cut is at the middle token. ``split``:
    ``{"by": "documents" | "tokens", "documents": [first, second] or None, "note": why the second
    half's interval is over windows of this one text, or None}``."""
    from ..eval.blocks import ESTIMANDS, MIN_BLOCKS

    n = h.tokens.numel()
    starts = None if h.doc_offsets is None else sorted({int(o) for o in h.doc_offsets if 0 <= int(o) < n} | {0})
    count = 0 if starts is None else len(starts)
    if count > MIN_BLOCKS:
        second = max(math.ceil(count / 2), MIN_BLOCKS)
        cut, note = starts[count - second], None
    elif count >= 2:
        cut = min(starts[1:], key=lambda o: (abs(o - n / 2), o))
        note = (f"the validation split holds {count} documents, and the evaluated half would need {MIN_BLOCKS} for "
                f"an interval {ESTIMANDS['documents']} with at least one left to choose on, so the second half's "
                f"intervals are {ESTIMANDS['windows']}")
    else:
        cut = n // 2
        note = (f"the validation split's documents are not known, so the second half's intervals are "
                f"{ESTIMANDS['windows']}" if starts is None else
                f"the validation split is one document, cut at its middle token, so the second half's intervals are "
                f"{ESTIMANDS['windows']}")
    by_docs = count >= 2
    parts = []
    for which, (lo, hi) in enumerate(((0, cut), (cut, n))):
        docs = None
        if starts is not None:
            docs = sorted({0, *(o - lo for o in starts if lo <= o < hi)}) + [hi - lo]
        held = [o for o in (starts or []) if lo <= o < hi]
        what = (f"{'first' if which == 0 else 'second'} half ("
                + (f"documents {starts.index(held[0]) + 1}-{starts.index(held[-1]) + 1} of {count}, "
                   if by_docs else "")
                + f"tokens {lo:,}-{hi:,})")
        parts.append(dataclasses.replace(h, tokens=h.tokens[lo:hi], doc_offsets=docs, source=f"{h.source}, {what}"))
    split = {"by": "documents" if by_docs else "tokens",
             "documents": [sum(1 for o in starts if o < cut), sum(1 for o in starts if o >= cut)] if by_docs else None,
             "note": note}
    return parts[0], parts[1], split


def assemble(results: CompareResult, settings: dict, field: str, shared, grids: dict, folder: dict, scores: dict,
             extended: dict, seeds: list) -> tuple[dict, CompareResult, CompareResult]:
    """``(tune, tuned results, shared results)``: the choices and both comparisons (``settings``: the
    plan's ``{task: Settings}``)."""
    from ..provenance import read_machine
    from ..tasks.subject import TrainRecord
    from ..compare.results import add_comparisons

    task_names = list(results.tasks)
    arms = list(grids)
    chosen = {arm: dict(zip(seeds, choose({v: [x["validation"] for x in scores[arm][v]] for v in grids[arm]},
                                          len(seeds)))) for arm in arms}

    @functools.lru_cache(maxsize=None)
    def entry(v, s, arm) -> dict:  # read once; callers copy what they change
        f = folder[v] / f"seed{s}" / arm
        tasks = {e: read_eval(f / EVALS_DIR / f"{e}.json", e) for e in task_names}
        held = scores[arm][v][seeds.index(s)]["heldout"]
        if held is not None and "lm" in tasks:
            tasks["lm"] = held
        return RunRecord(TrainRecord.read(f).to_dict(), tasks, read_machine(f), {"tune_value": v})

    def comparison(pick) -> CompareResult:
        runs = {(int(s), arm): copy.copy(entry(pick(arm, s), s, arm)) for s in seeds for arm in arms}
        return add_comparisons(dataclasses.replace(results, runs=runs, comparisons={}), settings,
                               results.primary.arms)

    tuned = comparison(lambda arm, s: chosen[arm][s])
    shared_half = comparison(lambda arm, s: shared)
    tasks_at = {arm: {v: [entry(v, s, arm).tasks for s in seeds] for v in grids[arm]} for arm in arms}
    validation = {arm: {v: [x["validation"] for x in scores[arm][v]] for v in grids[arm]} for arm in arms}
    selection_aware(tuned, settings, tasks_at, validation)
    means = {arm: {v: sum(x["validation"] for x in scores[arm][v]) / len(seeds) for v in grids[arm]} for arm in arms}
    best = {arm: min(grids[arm], key=means[arm].get) for arm in arms}
    named = field in CHOICE_FIELDS  # named choices have no edge: nothing lies beyond them
    edge = {arm: (None if named else "upper" if best[arm] == max(grids[arm]) else
                  "lower" if best[arm] == min(grids[arm]) else None) for arm in arms}
    first = scores[arms[0]][shared][0]
    tune = {"schema": TUNE_SCHEMA, "schema_version": TUNE_VERSION, "field": field, "shared_value": shared,
            "grid": {arm: grids[arm] for arm in arms}, "extended": extended, "at_edge": edge, "best": best,
            "validation_source": first["validation_source"], "split": first.get("split"),
            "heldout_estimand": _estimand(first["heldout"]),
            "heldout_source": (first["heldout"] or {}).get("source") if first["heldout"] else
            first.get("heldout_source") or "the comparison's own held-out text (its LM evaluation)",
            "validation_nll": {arm: {label(field, v): [x["validation"] for x in scores[arm][v]] for v in grids[arm]}
                               for arm in arms},
            # the held-out LM NLL of every model (the evaluated half), so a reader can redo the choice
            "heldout_nll": {arm: {label(field, v): [_nll(t) for t in tasks_at[arm][v]] for v in grids[arm]}
                            for arm in arms},
            "chosen": {arm: {str(s): v for s, v in chosen[arm].items()} for arm in arms},
            "tuned": _primary(tuned), "shared": _primary(shared_half)}
    return tune, tuned, shared_half


def _estimand(held: Optional[dict]) -> Optional[dict]:
    """What the held-out half's LM interval is over (:func:`difftx.tasks.lm.estimand`), or None
    (the comparison's own held-out text: its LM section says)."""
    from ..tasks.lm import estimand

    if not held or "skipped" in held:
        return None
    phrase, why = estimand(held)
    return {"phrase": phrase, "note": why, "documents": (held.get("dependence") or {}).get("documents")}


def _nll(tasks: dict) -> Optional[float]:
    lm = tasks.get("lm") or {}
    return None if "skipped" in lm else (lm.get("heldout") or {}).get("nll")


def selection_jackknife(x: dict, val: dict, a: str, b: str, confidence: float = 0.95) -> dict:
    """The tuned paired difference ``a - b`` of one metric with an interval that allows for the
    choice: ``x[arm][value]`` and ``val[arm][value]`` are the seeds' metric values and validation
    losses. The estimate is ``theta(S)``, the mean over the seeds ``s`` of ``S`` of the difference of
    their models at the values chosen leave-one-seed-out within ``S`` (:func:`choose`); its standard
    error is the jackknife's over seeds, the whole procedure (choices included) redone without each
    seed in turn, and the interval and p-value are t on ``n - 1`` degrees of freedom. Choices read
    the other seeds, so the seeds' differences are not independent: a t interval over them is too
    narrow where values nearly tie (``tests/test_tune.py`` simulates it). Needs 3 seeds."""
    from ..eval.stats import round_p, t_quantile, t_two_sided_p

    n = len(next(iter(x[a].values())))

    def theta(idx: list[int]) -> float:
        picks = {arm: choose({v: [val[arm][v][i] for i in idx] for v in val[arm]}, len(idx)) for arm in (a, b)}
        return sum(x[a][picks[a][k]][i] - x[b][picks[b][k]][i] for k, i in enumerate(idx)) / len(idx)

    est = theta(list(range(n)))
    if n < 3:
        return {"mean": est, "low": None, "high": None, "p_value": None, "n": n,
                "note": "the jackknife over seeds needs 3 seeds"}
    jk = [theta([i for i in range(n) if i != j]) for j in range(n)]
    centre = sum(jk) / n
    se = math.sqrt((n - 1) / n * sum((t - centre) ** 2 for t in jk))
    if se == 0:
        return {"mean": est, "low": None, "high": None, "p_value": None, "n": n, "note": "no spread over seeds"}
    half = t_quantile(0.5 + confidence / 2, n - 1) * se
    p = t_two_sided_p(abs(est) / se, n - 1)  # from the tail: never rounded to 0
    return {"mean": est, "low": est - half, "high": est + half, "p_value": round_p(min(1.0, p)), "n": n,
            "note": None}


def selection_aware(results: CompareResult, settings: dict, tasks_at: dict, val: dict) -> None:
    """Make every compared primary metric of the tuned ``results`` allow for the choice: its interval
    the hull of the comparison's own and :func:`selection_jackknife`'s, its p-value the larger of
    the two (kept under ``selection``), then Holm over the primary family again and the verdicts
    rewritten. ``tasks_at[arm][value]``: the seeds' task results at that value."""
    from ..eval.stats import PairedEstimate, holm, look_adjusted, look_factor, verdict
    from ..tasks import TASKS
    from ..compare.summary import ALPHA, _finite, _value

    metrics = {m.key: (name, m) for name, st in settings.items() for m in TASKS[name].metrics(st) if m.primary}
    comps = [c for pair in results.comparisons.values() for c in pair.metrics.values() if c["primary"]]
    family = [c for c in comps if c["gated"] is None and c["paired"]["p_value"] is not None]
    for c in family:
        name, m = metrics[c["key"]]
        a, b = c["arms"]
        x = {arm: {v: [_finite(_value(m.get, r[name])) for r in rows] for v, rows in tasks_at[arm].items()}
             for arm in (a, b)}
        if m.peer or any(v is None for arm in x.values() for row in arm.values() for v in row):
            c["selection"] = {"note": "not computed: the metric is missing at some value, or read against the other "
                                      "arm"}
            continue
        sel = selection_jackknife(x, {arm: val[arm] for arm in (a, b)}, a, b)
        c["selection"] = sel
        pr = c["paired"]
        if sel["low"] is not None and pr["low"] is not None:
            pr["low"], pr["high"] = min(pr["low"], sel["low"]), max(pr["high"], sel["high"])
            if pr.get("median_low") is not None:  # the printed interval of an unbounded metric: widened alike
                pr["median_low"], pr["median_high"] = min(pr["median_low"], sel["low"]), max(pr["median_high"],
                                                                                             sel["high"])
        if sel["p_value"] is not None:
            pr["p_value"] = max(pr["p_value"], sel["p_value"])
        pr["method"] = f"{pr['method']}; hulled with the jackknife over seeds of the choice and the difference"
    look = int(results.look or 1)  # this reading of the folder: its p-values x look_factor(look), as compare's
    for c, p in zip(family, holm([c["paired"]["p_value"] for c in family])):
        name, m = metrics[c["key"]]
        a, b = c["arms"]
        p = look_adjusted(p, look)
        c["p_adjusted"], c["look_factor"] = p, round(look_factor(look), 4)
        fields = {k: v for k, v in c["paired"].items() if k in PairedEstimate.__dataclass_fields__}
        est = PairedEstimate(**fields)
        c["verdict"] = verdict(est, m.label, lower_is_better=m.lower_is_better, adjusted_p=p, alpha=ALPHA,
                               unit=m.unit, digits=max(m.digits, 1), names=(results.label(a), results.label(b)),
                               family_size=len(family), look=look, mean_p=c.get("mean_p_adjusted"))
        c["better"] = None if p >= ALPHA else (a if (est.mean < 0) == m.lower_is_better else b)
        c["mean_better"] = (a if (est.mean < 0) == m.lower_is_better else b) if c.get("mean_established") else None


def _primary(results: CompareResult) -> dict:
    """``{pair: {metric: comparison}}`` of the primary metrics of every pair of arms."""
    return {key: {k: c for k, c in pair.metrics.items() if c["primary"]} for key, pair in results.comparisons.items()}


def write_tune(out: Path, results: CompareResult, tune: dict, progress: bool) -> None:
    """``tune.json``; ``report.md``, ``results.json`` and the plots again, with the tuned section."""
    from ..compare.report import write_outputs

    results.extra["tune"] = tune
    atomic_write(out / TUNE_FILE, lambda p: Path(p).write_text(dumps_strict(tune, indent=1) + "\n"))
    write_outputs(out, results, progress=progress, section=tune_section(tune))
