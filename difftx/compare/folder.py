"""What a comparison's folder holds and may reuse: ownership, its ``compare.json``, the text it was trained on,
and the training request a finished model must match."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from ..io import MODEL_MARKERS, WORK_MARKERS, atomic_write, dumps_strict, read_json, work_marker
from ..tasks.subject import TRAIN_RECORD, TrainRecord
from .plan import ComparePlan
from .presets import ComparePreset
from .schema import FOLDER_VERSION, check_version, model_dotted, preset_record

# preset fields a resume may change: how a comparison runs, not what it computes, and which arms it
# trains (each arm's models live in their own folders)
EXECUTION_FIELDS = ("workers", "threads", "device", "description", "arms", "stack", "primary", "own_arms")
# what a resume may change besides: what is recorded along training (the held-out curve; models trained
# before keep theirs), and the paths of your text, which is checked by its content instead (text_identity)
RECORDING_FIELDS = ("curve_points", "curve_windows", "data", "tokenizer", "heldout")
# preset fields an older difftx recorded in compare.json, with the one value they always had
REMOVED_FIELDS = {"extra": {}}
# preset fields a newer difftx added, with the value that means what an older compare.json without them did
ADDED_FIELDS = {"recall_every": 0, "recall_vocab": 256, "recall_len": 64, "recall_pairs": [4, 8, 16],
                "lambda_warmup": 0, "source": None, "convert_method": "mirror", "convert_lambda_init": 0.0}
COMPARE_FILE = "compare.json"  # the preset and seeds of a comparison's folder


TRAIN_RUN_FILES = ("train_config.json", "checkpoints", "metrics.jsonl")  # what marks a `difftx train` run folder


def check_owned(out: Path, plan: ComparePlan) -> None:
    """Refuse, before anything is read or written, an ``out`` that compare does not own: a file, a
    ``difftx train`` run folder, any other non-empty folder without ``compare.json`` (its files would
    be replaced), and a folder inside the ``--data`` folder (its outputs would be read back as text)."""
    if plan.text is not None and Path(plan.text.source).is_dir():
        data, where = Path(plan.text.source), out.expanduser().resolve()
        if where == data or data in where.parents:
            raise ValueError(f"--out {out}: inside the --data folder {data} (the comparison's files would be read "
                             "back as training text); choose an --out outside it")
    if not out.exists() and not out.is_symlink() or (out / COMPARE_FILE).is_file():
        return
    if not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder; choose a folder for the comparison")
    # hidden entries are never compare's to replace (.DS_Store; compare.json being written by a concurrent shard)
    entries = sorted(e.name for e in out.iterdir() if not e.name.startswith("."))
    if any(name in TRAIN_RUN_FILES for name in entries):
        raise ValueError(f"--out {out}: a `difftx train` run folder, not a comparison; choose another --out")
    if entries:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise ValueError(f"--out {out}: not empty ({shown}) and holds no comparison (no {COMPARE_FILE}); compare "
                         "writes only into a new or empty folder or its own, so choose another --out")


def check_study_folder(out: Path, flag: str, marker: str, what: str, own_entry: Callable[[Path], bool]) -> None:
    """Refuse, before anything is read or written, an ``out`` that a study (``what``: "a scale study") does not own:
    a file; a folder that holds a training run, a model, a comparison or another study at its top level; any other
    non-empty folder whose entries are not the study's own (``own_entry``) and that has no ``marker`` (scale.json,
    map.json). Compare refused such folders; a study wrote into them."""
    out = Path(out)
    if not out.exists() and not out.is_symlink() or (out / marker).is_file():
        return
    if not out.is_dir():
        raise ValueError(f"{flag} {out}: exists and is not a folder; choose a folder for {what}")
    held = work_marker(out, {**WORK_MARKERS, **MODEL_MARKERS}, below=False)
    if held is not None:
        raise ValueError(f"{flag} {out}: holds {held[1]} ({held[0]}), not {what}; choose another {flag}")
    strangers = sorted(e.name for e in out.iterdir() if not e.name.startswith(".") and not own_entry(e))
    if strangers:
        shown = ", ".join(strangers[:4]) + (", ..." if len(strangers) > 4 else "")
        raise ValueError(f"{flag} {out}: not empty ({shown}) and not the folder of {what} (no {marker}); a study "
                         f"writes only into a new or empty folder or its own, so choose another {flag}")


def _check_folder(out: Path, preset: ComparePreset, text: dict | None = None) -> None:
    meta, new = out / COMPARE_FILE, preset.to_dict()
    if meta.is_file():
        data = read_json(meta, "the settings of a comparison")
        try:
            old = data["preset"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{meta}: unreadable ({e}); remove it or use another --out") from None
        check_version(data, str(meta))
        if data.get("schema_version") == 2 and old.get("source") is not None:
            raise ValueError(f"{meta}: a comparison from a source written when its arms were named baseline and diff "
                             "(folder version 2); this difftx names them source and converted and does not reuse "
                             "its models: compare into a new --out (the old folder stays as it is, and its "
                             "results.json still reads)")
        _check_text(meta, data.get("text"), text)
        old = preset_record({**ADDED_FIELDS, **{k: v for k, v in old.items()
                                                 if k not in REMOVED_FIELDS or v != REMOVED_FIELDS[k]}})
        old, new = model_dotted(old), model_dotted(new)
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in EXECUTION_FIELDS
                         and k not in RECORDING_FIELDS)
        if changed:
            raise ValueError(f"{meta}: this folder holds a comparison with other settings (differs in {changed}); "
                             "use another --out to keep both")


def _record_folder(out: Path, preset: ComparePreset, text: dict | None = None) -> None:
    """Write ``compare.json`` (after :func:`_check_folder` and :func:`check_reuse`)."""
    meta, new = out / COMPARE_FILE, preset.to_dict()
    out.mkdir(parents=True, exist_ok=True)
    record = {"schema_version": FOLDER_VERSION, "preset": new}
    text = dumps_strict({**record, "text": text} if text is not None else record, indent=1)
    atomic_write(meta, lambda p: Path(p).write_text(text + "\n"))


def _check_text(meta: Path, old: dict | None, new: dict | None) -> None:
    """Refuse a folder trained on other text (or on the bundled corpus, or on text where now there is
    none): the training and held-out tokens and the tokenizer must be the same."""
    def what(t: dict | None) -> str:
        if t is None:
            return "the bundled Shakespeare"
        held = f"--heldout {t['heldout']}" if t["heldout"] else "its validation split held out"
        return f"--data {t['source']} ({held}, tokenizer {t['tokenizer']}, {t['train_tokens']:,} training tokens)"

    keys = ("tokenizer", "train_sha256", "heldout_sha256")
    if (old is None) != (new is None) or (old and any(old.get(k) != new.get(k) for k in keys)):
        now = what(new)
        if now == what(old):  # the same paths and sizes: say which content changed
            changed = [{"train_sha256": "training", "heldout_sha256": "held-out"}[k] for k in keys[1:]
                       if old.get(k) != new.get(k)]
            now = f"the same paths and sizes, whose {' and '.join(changed)} text changed (SHA-256)"
        raise ValueError(f"{meta}: this folder holds a comparison on {what(old)}, not on {now}; use another "
                         "--out (or the same --data, --tokenizer and --heldout to continue it)")


# preset fields that do not decide a model's weights: a finished model is reused whatever they are
NOT_TRAINING_FIELDS = (*EXECUTION_FIELDS, *RECORDING_FIELDS, "name", "tasks")


def kinds_code(plan: ComparePlan) -> dict:
    """``{kind: {"file", "sha256"}}`` for every attention kind of the plan's arms that is not built into difftx
    (:func:`difftx.attention.registry.kind_code`), so that a model trained with that code is not reused once the file
    is edited (:func:`check_reuse`)."""
    from ..attention.registry import kind_code

    codes = {cfg.attention: kind_code(cfg.attention) for cfg in plan.arms.values()}
    return {k: v for k, v in codes.items() if v is not None}


def tasks_code(plan: ComparePlan) -> dict:
    """``{task: {"file", "sha256", "settings"}}`` for every registered training task (not a built-in one) the plan's
    mixture gives steps: the file that defines its class and the task's own settings (its instance's attributes),
    so that a model trained on it is not reused once either changes (:func:`check_reuse`). The same code at another
    path is the same task."""
    from ..attention.registry import code_digest
    from .training_tasks import BUILTIN

    return {task.name: {**code_digest(type(task), bytecode=True),
                        "settings": {k: repr(v) for k, v in sorted(vars(task).items())}}
            for task in plan.mixture.tasks if task.name not in BUILTIN and task.every(plan.mixture)}


def training_request(preset: ComparePreset, text: dict | None, source: dict | None = None,
                     kinds: dict | None = None, tasks: dict | None = None) -> dict:
    """What a model is trained with, kept in its ``train.json`` (with its seed and arm): the preset
    fields that decide its weights, its text (tokenizer and the hash of the training tokens;
    None: the bundled corpus) and, from a source (``--from``), the source's folder and the hash of its
    config and weights (:func:`difftx.compare.source.source_identity`), the code of the attention kinds not built
    into difftx (``kinds``, :func:`kinds_code`), the code and settings of registered training tasks (``tasks``,
    :func:`tasks_code`) and the difftx version. A later run reuses the model only
    if it asks for the same (:func:`check_reuse`; the version is recorded, not compared)."""
    from .. import __version__

    fields = {k: v for k, v in preset.to_dict().items() if k not in NOT_TRAINING_FIELDS}
    out = {"preset": fields, "text": None if text is None else {k: text[k] for k in ("tokenizer", "train_sha256")},
           "difftx": __version__}
    if kinds:
        out["kinds"] = kinds
    if tasks:
        out["tasks"] = tasks
    return {**out, "source": source} if source is not None else out


def check_reuse(plan: ComparePlan, jobs: list[tuple], request: dict) -> None:
    """Refuse (``ValueError`` naming the field) to reuse a finished model of ``jobs`` whose
    ``train.json`` says it was trained otherwise than asked: its arm, seed, steps or model config,
    and every field of :func:`training_request` (where the record has it: older ones do not)."""
    for arm, seeds, folders in jobs:
        for seed, f in zip(seeds, folders):
            if not (Path(f) / TRAIN_RECORD).is_file():
                continue
            rec = TrainRecord.read(f)  # an older record's "kind" is its arm
            cfg = plan.arms[arm].to_dict()
            asked = {"arm": arm, "seed": seed, "steps": plan.schedule.steps, **{f"config.{k}": cfg[k] for k in cfg}}
            got = {"arm": rec.arm, "seed": rec.seed, "steps": rec.steps,
                   **{f"config.{k}": (rec.config or {}).get(k) for k in cfg}}
            if rec.request is not None:
                old, new = rec.request.get("preset") or {}, request["preset"]
                old = preset_record(old) if old else old
                got.update({k: old[k] for k in old if k in new}, text=rec.request.get("text"),
                           source=rec.request.get("source"))
                asked.update({k: new[k] for k in old if k in new}, text=request["text"], source=request.get("source"))
                attention = plan.arms[arm].attention
                was = (rec.request.get("kinds") or {}).get(attention)
                if was is not None:  # a kind of your own: its file's content as it was when this model trained
                    now = (request.get("kinds") or {}).get(attention)
                    got["code"], asked["code"] = was, (was if now is not None and now.get("sha256") == was.get(
                        "sha256") else now)  # the same code at another path is the same kind
                had = rec.request.get("tasks")
                if had is not None or request.get("tasks"):  # registered training tasks: code (by content), settings
                    def content(tasks):
                        return {n: (t.get("sha256"), t.get("settings")) for n, t in (tasks or {}).items()}

                    got["training tasks"], asked["training tasks"] = content(had), content(request.get("tasks"))
            wrong = [k for k in asked if got[k] != asked[k]]
            if wrong:
                k = wrong[0]
                show = {"text": lambda t: "the bundled corpus" if t is None else
                        f"text {t['train_sha256'][:12]}... (tokenizer {t['tokenizer']})",
                        "source": lambda t: "no source" if t is None else
                        f"{t['folder']} (config and weights {t['sha256'][:12]}...)",
                        "code": lambda t: "no file" if t is None else
                        f"{t['file']} (SHA-256 {str(t['sha256'])[:12]}...)",
                        "training tasks": lambda t: "none of your own" if not t else "; ".join(
                            f"{n}: code {str(c)[:12]}..., settings {st}" for n, (c, st) in t.items())}.get(k, repr)
                raise ValueError(f"{Path(f) / TRAIN_RECORD}: this model was trained with {k} {show(got[k])}, not "
                                 f"{show(asked[k])} as asked (differs in {wrong}); use another --out, or delete "
                                 f"{f} to train it again")


def text_identity(plan: ComparePlan, progress: bool = False) -> dict | None:
    """Your text as a comparison uses it, checked before anything is written: its source, tokenizer,
    held-out text and their token counts and hashes (recorded in ``compare.json``, so a resume on other
    text is refused). Raises ``ValueError`` (one line) for a corpus smaller than one batch of LM
    windows or a held-out text shorter than one window; None without ``--data``."""
    import hashlib

    import numpy as np

    t = plan.text
    if t is None:
        return None
    data = t.prepare(progress)  # tokenized once into the cache (a progress bar with progress)
    T, B = plan.mixture.settings["lm"].seq_len, plan.mixture.batch_size
    if len(data.train) < (B + 1) * T:  # the data package's rule (PackedLoader): one batch of windows must fit
        raise ValueError(f"--data {t.source}: its training split has {len(data.train):,} tokens, fewer than one batch "
                         f"needs: (batch {B} + 1) x lm_seq_len {T} = {(B + 1) * T:,} tokens; give more text")
    held, source = t.heldout_tokens()
    leak = _heldout_in_data(t.heldout, t.source) if t.heldout else None
    if leak:
        print(f"difftx compare: warning: --heldout {t.heldout}: {leak}, so the models train on the text they are "
              "scored on (leakage); give held-out text that is not in --data", file=sys.stderr, flush=True)
    if len(held) < T + 1:
        where = f"--heldout {t.heldout}" if t.heldout else f"--data {t.source}: its validation split"
        raise ValueError(f"{where} has {len(held):,} tokens, shorter than one window of {T + 1} (the training length "
                         f"{T} + 1); give {'a longer file' if t.heldout else 'more text or --heldout FILE'}")

    def sha(tokens) -> str:  # in chunks: a corpus may be larger than memory
        h = hashlib.sha256()
        for i in range(0, len(tokens), 1 << 22):
            h.update(np.asarray(tokens[i:i + (1 << 22)]).astype("<u4").tobytes())
        return h.hexdigest()

    return {**t.to_dict(), "tokenizer": data.tokenizer.name, "heldout_source": source,
            "train_tokens": len(data.train), "heldout_tokens": len(held), "train_sha256": sha(data.train.tokens),
            "heldout_sha256": sha(held)}


def _heldout_in_data(heldout: str, source: str) -> str | None:
    """Why the held-out file is training text too (None if it is not): it is the ``--data`` file, lies
    in the ``--data`` folder, or has the content of one of its files."""
    import filecmp

    held, src = Path(heldout), Path(source)
    size = held.stat().st_size
    if src.is_dir():
        if src in held.resolve().parents:
            return f"it lies inside the --data folder {src}"
        files = (f for f in sorted(src.rglob("*")) if f.is_file() and f.stat().st_size == size)
        same = next((f for f in files if filecmp.cmp(f, held, shallow=False)), None)
        return None if same is None else f"it has the content of {same}, a file of --data"
    if src.is_file() and src.stat().st_size == size and filecmp.cmp(src, held, shallow=False):
        return "it has the content of the --data file"
    return None

