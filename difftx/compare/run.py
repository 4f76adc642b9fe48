"""``run_compare``: train DIFF and its matched baseline over paired seeds, evaluate both, and
write ``results.json``, ``report.md`` and plots. Resumable: each finished part (one model's
training, one evaluation of one model) is a file in the output folder and is not redone, and an
unfinished training continues from its last checkpoint.

Under ``torchrun`` (more than one process) the models are trained one at a time, each by every
process (data parallel, :func:`difftx.training.train`); rank 0 alone evaluates and writes the
outputs while the others wait.

It writes only into a new or empty folder or its own (``compare.json``; :func:`check_owned`), and
reuses a finished model only if its ``train.json`` says it was trained as asked (:func:`check_reuse`).

On a cluster, ``shard=(K, N)`` makes invocation K of N train and evaluate only its share of the
models (every N-th (seed, arm), from the K-th: :func:`plan_models`; it stacks its own) into the
shared folder and write no report; an invocation
without ``shard`` then assembles the results (training whatever is still missing). Each model is
done under an OS lock on ``seed{S}/{arm}/.job.lock``, so no two invocations ever do the same model:
a shard skips a model another process holds; an assembling run waits for it.

Layout of ``out_dir``::

    compare.json                      the preset and seeds of this folder (a re-run must match)
    seed{S}/{diff,baseline}/model/    the trained model (difftx checkpoint: load_model reads it)
    seed{S}/{diff,baseline}/train/    the trainer's run folder (metrics.jsonl; checkpoints until trained)
    seed{S}/{diff,baseline}/train.json   the training record: loss history, lambda, wall/CPU time, request
    seed{S}/{diff,baseline}/machine.json the machine that trained it (difftx.provenance.machine)
    seed{S}/{diff,baseline}/evals/{task}.json  one file per registered task (difftx.tasks.TASKS)
    seed{S}/{diff,baseline}/.job.lock   held while one invocation trains or evaluates that model (its pid, host)
    results.json  report.md  plots/*.png
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from ..io import atomic_write, dumps_strict, open_lock_file, read_json
from ..provenance import machine, read_machine
from ..training.distributed import broadcast_object, on_main
from ..tasks.subject import TRAIN_RECORD, TrainRecord
from .evaluate import EVALS_DIR, evaluate_model
from .plan import ComparePlan, resolve
from .presets import ComparePreset, get_preset
from .schema import SCHEMA, SCHEMA_VERSION, check_version
from .train import train_models

# preset fields a resume may change: how a comparison runs, not what it computes, and which arms it
# trains (each arm's models live in their own folders)
EXECUTION_FIELDS = ("workers", "threads", "device", "description", "arms", "stack")
# what a resume may change besides: what is recorded along training (the held-out curve; models trained
# before keep theirs), and the paths of your text, which is checked by its content instead (text_identity)
RECORDING_FIELDS = ("curve_points", "curve_windows", "data", "tokenizer", "heldout")
# preset fields an older difftx recorded in compare.json, with the one value they always had
REMOVED_FIELDS = {"extra": {}}
COMPARE_FILE = "compare.json"  # the preset and seeds of a comparison's folder


@contextmanager
def job_lock(folder: Path, wait: bool) -> Iterator[bool]:
    """Hold an OS lock on ``folder/.job.lock`` (rank 0 alone, under torchrun) while one model is
    trained and evaluated. Yields False, without the lock, when another process holds it and
    ``wait`` is False; with ``wait`` it says on stderr whom it waits for, and blocks until the other
    is done. The holder writes its pid and host into the file. The OS releases the lock of a
    process that dies."""
    from ..training.distributed import is_initialized

    try:
        import fcntl
    except ImportError:  # pragma: no cover - no flock on this platform: no cross-process guard
        yield True
        return
    if is_initialized() and _rank() != 0:
        yield True
        return
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ".job.lock"
    fd = open_lock_file(path)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not wait:
                yield False
                return
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "pid unknown"
            print(f"difftx compare: waiting for {folder}: another invocation holds it ({holder}; {path})",
                  file=sys.stderr, flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} host {platform.node()}\n".encode(), 0)
        yield True
    finally:
        os.close(fd)  # closing releases the lock


def _job(plan: ComparePlan, kind: str, seeds: tuple, folders: tuple, progress: bool, position: int,
         invocation: str | None = None, wait: bool = True, request: dict | None = None) -> dict[str, dict]:
    """Train (unless finished) and evaluate (what is missing) the models of arm ``kind`` for
    ``seeds`` (in ``folders``), each under its job lock (:func:`job_lock`); the unfinished ones are
    trained as one stack (:func:`difftx.compare.train.train_models`), first put back at their newest
    common checkpoint (:func:`align_stack`). ``request`` (:func:`training_request`) goes into each
    record. Returns ``{"seed{S}/{kind}": what was done}``. Under torchrun (one seed per job) every
    rank calls it: every rank trains, rank 0 alone evaluates."""
    from contextlib import ExitStack

    names = [f"seed{s}/{kind}" for s in seeds]
    done: dict[str, dict] = {}
    with ExitStack() as locks:
        mine = [broadcast_object(locks.enter_context(job_lock(Path(f), wait))) for f in folders]
        for name, held in zip(names, mine):
            if not held:
                done[name] = {"trained": False, "evaluated": [], "skipped": "another invocation holds this model"}
        todo = [(s, Path(f), n) for s, f, n, held in zip(seeds, folders, names, mine) if held]
        if plan.execution.threads:
            import torch

            torch.set_num_threads(plan.execution.threads)
        untrained = broadcast_object([i for i, (_, f, _) in enumerate(todo) if not (f / TRAIN_RECORD).is_file()])
        runs = [todo[i][1] / "train" for i in untrained]
        groups = on_main(lambda: align_stack(runs), share=True) if untrained else []
        for group in groups:
            train_models(kind, plan, [todo[untrained[g]][0] for g in group], [todo[untrained[g]][1] for g in group],
                         progress=progress, position=position, invocation=invocation, request=request)
        for i, (_, f, name) in enumerate(todo):
            done[name] = {"trained": i in untrained, "evaluated": _evaluate_missing(plan, f, progress, position)}
    return done


def align_stack(runs: list[Path]) -> list[list[int]]:
    """The unfinished models of one stack (their run folders) as the groups that train together
    (indices into ``runs``): one group, after putting every run back at the newest checkpoint they
    all have (a kill while a stack writes its checkpoints, one model after the other, can leave some
    a checkpoint ahead; the stacked trainer keeps each model's previous checkpoint until every model
    wrote the new one, and holds Ctrl-C until then), so the stack resumes together. Checkpoints past
    it are deleted: they are computed again, the same; a stack killed in its first checkpoint starts
    over. Otherwise, without a checkpoint in common (a fresh stack has none; other stacks' models,
    after --workers or --set stack=... changed) one group per latest checkpoint, each a stack of its own."""
    import shutil

    from ..training import checkpointing as ckpt

    latest, usable = [], []  # per run: `latest`, and its checkpoints up to it (past it: an unfinished save)
    for run in runs:
        last = ckpt.latest_checkpoint(run) if ckpt.checkpoints_dir(run).is_dir() else None
        latest.append(None if last is None else last.name)
        usable.append({p.name for p in ckpt.list_checkpoints(run) if last is not None and p.name <= last.name})
    common = set.intersection(*usable) if usable else set()
    if not common and not _first_save_cut(runs, latest):
        groups: dict = {}
        for i, name in enumerate(latest):
            groups.setdefault(name, []).append(i)
        return list(groups.values())
    keep = max(common) if common else None  # step_00000200: zero-padded, so the names sort by step
    for run, last in zip(runs, latest):
        if keep is None:  # a stack cut in its first checkpoint: every model starts over
            shutil.rmtree(ckpt.checkpoints_dir(run), ignore_errors=True)
            continue
        if last != keep:  # the pointer first: a kill in between leaves it at an intact checkpoint
            atomic_write(ckpt.checkpoints_dir(run) / ckpt.LATEST, lambda t: Path(t).write_text(keep + "\n"))
        for p in ckpt.list_checkpoints(run):
            if p.name > keep:
                shutil.rmtree(p)
    return [list(range(len(runs)))]


def _first_save_cut(runs: list[Path], latest: list) -> bool:
    """Whether these runs are a stack killed while it wrote its first checkpoint: some have none,
    the others only that one (their first ``ckpt_interval`` step)."""
    from ..training import checkpointing as ckpt

    saved = [(run, name) for run, name in zip(runs, latest) if name is not None]
    if not saved or len(saved) == len(runs) or len({name for _, name in saved}) != 1:
        return False
    run, name = saved[0]
    try:
        every = read_json(ckpt.checkpoints_dir(run) / name / ckpt.TRAIN_CONFIG_NAME, "a checkpoint's config")
        every = every["ckpt_interval"]
    except (ValueError, KeyError, TypeError):
        return False
    return all(len(ckpt.list_checkpoints(r)) == 1 for r, _ in saved) and int(name.split("_")[1]) <= every


def _evaluate_missing(plan: ComparePlan, f: Path, progress: bool, position: int) -> list[str]:
    """Run the evaluations of ``f`` whose file is missing, or unreadable (then redone, with a line that says
    so: an evaluation gives the same result again); returns their names."""
    def usable(task: str) -> bool:
        path = f / EVALS_DIR / f"{task}.json"
        if not path.is_file():
            return False
        try:
            data = read_json(path, f"the {task} evaluation of a compare model")
            if not isinstance(data, dict) or not data:
                raise ValueError(f"{path}: empty or not a JSON object")
        except ValueError as e:
            print(f"difftx compare: redoing an evaluation: {e}", file=sys.stderr, flush=True)
            return False
        return True

    missing = broadcast_object(on_main(lambda: [e for e in plan.tasks if not usable(e)], share=True))
    if missing:
        # evaluation receives its part of the plan alone: the task settings (and the device)
        on_main(lambda: evaluate_model(f, plan.tasks, device=plan.execution.device, progress=progress,
                                       only=tuple(missing), position=position))
    return missing


MAX_STACK = 16  # the largest automatic stack (see stack_size)


def stack_size(plan: ComparePlan, seeds: int, workers: int, distributed: bool) -> int:
    """How many seeds of one arm train as one stacked model. ``plan.execution.stack``: 1 none, K at
    most K, 0 automatic: on a CPU, each worker process holds one stack (an arm's seeds spread evenly
    over ``workers // arms`` processes), at most :data:`MAX_STACK` (the benchmark gains no more past
    5-10) and as many as fit in a quarter of the memory per worker (:func:`_model_bytes`); on a GPU
    none (its presets train in bfloat16, which a stack does not). Never under torchrun (data
    parallel, one model at a time)."""
    from ..training.distributed import resolve_device

    asked = plan.execution.stack
    if distributed or asked == 1 or seeds <= 1:
        return 1
    if asked > 1:
        return asked
    if resolve_device(plan.execution.device).type != "cpu":
        return 1
    per_arm = max(1, workers // len(plan.arms))
    fits = max(1, int(_memory_bytes() / 4 / workers // max(_model_bytes(plan), 1)))  # a quarter of the memory
    return max(1, min(MAX_STACK, -(-seeds // per_arm), fits))


def _model_bytes(plan: ComparePlan) -> int:
    """A generous estimate of one model's training memory in a stack: weights, gradients and two AdamW
    moments (16 bytes a parameter) and float32 activations (about 24 tensors of ``dim`` per token and
    layer, 4 attention maps per head), for the largest arm."""
    worst = 0
    for cfg in plan.arms.values():
        params = 12 * cfg.n_layers * cfg.dim ** 2 + 2 * cfg.vocab_size * cfg.dim
        T, B = cfg.max_seq_len, plan.mixture.batch_size
        acts = 4 * B * T * cfg.n_layers * (24 * cfg.dim + 4 * cfg.n_heads * T)
        worst = max(worst, 16 * params + acts)
    return worst


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 8 << 30


def plan_models(plan: ComparePlan, seeds: list[int], shard: tuple[int, int] | None = None,
                offset: int = 0) -> list[tuple[int, str]]:
    """The models ``(seed, arm)`` of this invocation: every model (seed by seed, each seed's arms in
    order); with ``shard`` (K, N) every N-th of them from the K-th (:func:`shard_jobs`; ``offset``:
    where they start in a longer list, such as one size of a scale run). From the command line
    alone: every shard of N up to the number of models has work."""
    return shard_jobs([(s, arm) for s in seeds for arm in plan.arms], shard, offset)


def plan_jobs(plan: ComparePlan, seeds: list[int], out: Path, k: int, shard: tuple[int, int] | None = None,
              offset: int = 0) -> list[tuple]:
    """``(arm, seeds, folders)`` per job: the models of :func:`plan_models`, each arm's in stacks of
    at most ``k``, the arms interleaved (so that parallel workers train the two arms of a comparison
    side by side)."""
    models = plan_models(plan, seeds, shard, offset)
    chunks = {}
    for arm in plan.arms:
        mine = [s for s, a in models if a == arm]
        chunks[arm] = [mine[i:i + k] for i in range(0, len(mine), k)]
    longest = max((len(c) for c in chunks.values()), default=0)
    return [(arm, tuple(c[i]), tuple(str(out / f"seed{s}" / arm) for s in c[i]))
            for i in range(longest) for arm, c in chunks.items() if i < len(c)]


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


def _check_folder(out: Path, preset: ComparePreset, text: dict | None = None) -> None:
    meta, new = out / COMPARE_FILE, preset.to_dict()
    if meta.is_file():
        data = read_json(meta, "the settings of a comparison")
        try:
            old = data["preset"]
        except (KeyError, TypeError) as e:
            raise ValueError(f"{meta}: unreadable ({e}); remove it or use another --out") from None
        check_version(data, str(meta))
        _check_text(meta, data.get("text"), text)
        old = {k: v for k, v in old.items() if k not in REMOVED_FIELDS or v != REMOVED_FIELDS[k]}
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k) and k not in EXECUTION_FIELDS
                         and k not in RECORDING_FIELDS)
        if changed:
            raise ValueError(f"{meta}: this folder holds a comparison with other settings (differs in {changed}); "
                             "use another --out to keep both")


def _record_folder(out: Path, preset: ComparePreset, text: dict | None = None) -> None:
    """Write ``compare.json`` (after :func:`_check_folder` and :func:`check_reuse`)."""
    meta, new = out / COMPARE_FILE, preset.to_dict()
    out.mkdir(parents=True, exist_ok=True)
    record = {"schema_version": SCHEMA_VERSION, "preset": new}
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


def training_request(preset: ComparePreset, text: dict | None) -> dict:
    """What a model is trained with, kept in its ``train.json`` (with its seed and arm): the preset
    fields that decide its weights, and its text (tokenizer and the hash of the training tokens;
    None: the bundled corpus). A later run reuses the model only if it asks for the same
    (:func:`check_reuse`)."""
    fields = {k: v for k, v in preset.to_dict().items() if k not in NOT_TRAINING_FIELDS}
    return {"preset": fields, "text": None if text is None else {k: text[k] for k in ("tokenizer", "train_sha256")}}


def check_reuse(plan: ComparePlan, jobs: list[tuple], request: dict) -> None:
    """Refuse (``ValueError`` naming the field) to reuse a finished model of ``jobs`` whose
    ``train.json`` says it was trained otherwise than asked: its arm, seed, steps or model config,
    and every field of :func:`training_request` (where the record has it: older ones do not)."""
    for kind, seeds, folders in jobs:
        for seed, f in zip(seeds, folders):
            if not (Path(f) / TRAIN_RECORD).is_file():
                continue
            rec = TrainRecord.read(f)
            cfg = plan.arms[kind].to_dict()
            asked = {"kind": kind, "seed": seed, "steps": plan.schedule.steps, **{f"config.{k}": cfg[k] for k in cfg}}
            got = {"kind": rec.kind, "seed": rec.seed, "steps": rec.steps,
                   **{f"config.{k}": (rec.config or {}).get(k) for k in cfg}}
            if rec.request is not None:
                old, new = rec.request.get("preset") or {}, request["preset"]
                got.update({k: old[k] for k in old if k in new}, text=rec.request.get("text"))
                asked.update({k: new[k] for k in old if k in new}, text=request["text"])
            wrong = [k for k in asked if got[k] != asked[k]]
            if wrong:
                k = wrong[0]
                show = {"text": lambda t: "the bundled corpus" if t is None else
                        f"text {t['train_sha256'][:12]}... (tokenizer {t['tokenizer']})"}.get(k, repr)
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
    T, B = plan.mixture.lm_seq_len, plan.mixture.batch_size
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


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` -> ``(2, 4)``: invocation 2 of 4 (1 <= K <= N)."""
    try:
        k, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ValueError(f"--shard: expected K/N such as 1/4, got {text!r}") from None
    if not 1 <= k <= n:
        raise ValueError(f"--shard {text}: need 1 <= K <= N (invocation K of N)")
    return k, n


def shard_jobs(jobs: list, shard: tuple[int, int] | None, offset: int = 0) -> list:
    """The jobs of invocation K of N: every N-th of the whole job list, from the K-th (``offset``:
    where ``jobs`` starts in a longer list, such as one size of a scale run)."""
    if shard is None:
        return jobs
    k, n = shard
    return [j for i, j in enumerate(jobs) if (offset + i) % n == k - 1]


def run_compare(preset: str | ComparePreset = "smoke", seeds: int | Sequence[int] = 1,
                out_dir: str | os.PathLike = "runs/compare", *, progress: bool = True,
                workers: int | None = None, shard: tuple[int, int] | None = None, shard_offset: int = 0,
                report: bool = True, only_arms: Sequence[str] | None = None, **overrides) -> dict:
    """Train and evaluate DIFF and its parameter-matched baseline for each seed; write
    ``results.json``, ``report.md`` and ``plots/`` into ``out_dir``; return the results.

    preset     a name of :data:`difftx.compare.presets.PRESETS` or a :class:`ComparePreset` (on your
               text: ``get_preset("cpu").on_text("my.txt", heldout="held.txt")``)
    seeds      K (seeds 0..K-1) or an explicit list of seeds
    workers    models trained side by side in separate processes (default: the preset's; 1 under
               torchrun, where every process trains each model in turn)
    shard      ``(K, N)``: train and evaluate only this invocation's share of the models and write
               no report; returns ``{"shard": [K, N], "this_run": ...}`` (see the module doc)
    report     False: train and evaluate, write no report; returns ``{"this_run": ...}``
    only_arms  train and evaluate only these arms' models (no report; ``--tune`` adds a value for one
               arm this way)
    overrides  :class:`ComparePreset` fields applied on top of the preset
    """
    from datetime import timedelta

    from ..training.distributed import destroy_distributed, init_distributed, is_initialized, under_torchrun

    p = get_preset(preset, **overrides) if isinstance(preset, str) else preset.with_overrides(**overrides)
    owns_group = under_torchrun() and not is_initialized()
    # the other ranks wait in a collective while rank 0 evaluates: allow them hours, not torch's default
    if owns_group:
        init_distributed(p.device, timeout=timedelta(hours=12))
    try:
        return _run_compare(p, seeds, out_dir, progress=progress, workers=workers, shard=shard,
                            shard_offset=shard_offset, report=report and only_arms is None, only_arms=only_arms)
    finally:
        if owns_group:
            destroy_distributed()


def _run_compare(p: ComparePreset, seeds: int | Sequence[int], out_dir: str | os.PathLike, *, progress: bool,
                 workers: int | None, shard: tuple[int, int] | None = None, shard_offset: int = 0,
                 report: bool = True, only_arms: Sequence[str] | None = None) -> dict:
    from tqdm.auto import tqdm

    from ..training.distributed import is_initialized

    seed_list = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if not seed_list or (isinstance(seeds, int) and seeds <= 0):
        raise ValueError(f"seeds: need a positive count or a non-empty list, got {seeds!r}")
    if len(set(seed_list)) != len(seed_list):
        raise ValueError(f"seeds: must be distinct, got {seed_list}")
    plan = resolve(p)  # once: every later step receives its part of the plan
    n_workers = plan.execution.workers if workers is None else workers
    if n_workers <= 0:
        raise ValueError(f"workers: must be positive, got {n_workers}")
    distributed = is_initialized()
    main = not distributed or _rank() == 0
    out = Path(out_dir)
    on_main(lambda: check_owned(out, plan))  # a folder compare does not own is refused before any work
    # your text is tokenized (rank 0, into the cache) and checked before anything is written
    text = on_main(lambda: text_identity(plan, progress and main), share=True)
    on_main(lambda: _check_folder(out, p, text))
    if only_arms is not None and not set(only_arms) <= set(plan.arms):
        raise ValueError(f"only_arms: {sorted(set(only_arms) - set(plan.arms))} are not arms of this comparison")
    models = [m for m in plan_models(plan, seed_list, shard, shard_offset) if only_arms is None or m[1] in only_arms]
    most = max((sum(a == arm for _, a in models) for arm in plan.arms), default=0)  # one arm's models here
    k = stack_size(plan, most, n_workers, distributed)  # how this invocation trains its models, not which
    jobs = [j for j in plan_jobs(plan, seed_list, out, k, shard, shard_offset)
            if only_arms is None or j[0] in only_arms]
    request = training_request(p, text)
    on_main(lambda: check_reuse(plan, jobs, request))  # a finished model is reused only as asked
    on_main(lambda: _record_folder(out, p, text))
    if distributed and plan.space.lm:  # rank 0 tokenizes the bundled corpus into the cache before the others read it
        from .stream import lm_streams

        on_main(lambda: lm_streams(text=plan.text))
    t0 = time.time()
    # the id of this invocation, kept with every model it trains (rank 0's is the one written)
    invocation = f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime(t0))}-{os.getpid()}"
    if shard is not None and main:  # the plan of this shard: from the command line alone
        names = ", ".join(f"seed{s}/{a}" for s, a in models[:8]) + (", ..." if len(models) > 8 else "")
        print(f"shard {shard[0]}/{shard[1]}: {len(models)} of the {len(seed_list) * len(plan.arms)} models of {out}"
              + (f": {names}" if models else ""), flush=True)
    wait = shard is None  # a shard skips a model another invocation holds; an assembling run waits for it
    done: dict[str, dict] = {}
    what = "" if shard is None else f", shard {shard[0]}/{shard[1]}"
    stacked = f", stacks of up to {k} seeds" if k > 1 else ""
    bar = tqdm(total=sum(len(j[1]) for j in jobs), desc=f"compare ({p.name}, {len(seed_list)} seed(s){what}{stacked})",
               disable=not (progress and main), dynamic_ncols=True, unit="model")
    if n_workers == 1 or len(jobs) <= 1 or distributed:
        with _sigterm_stops(not distributed):
            for kind, seeds_, folders in jobs:
                done.update(_job(plan, kind, seeds_, folders, progress, 1, invocation, wait, request))
                bar.update(len(seeds_))
    else:
        calls = [(plan, kind, seeds_, folders, progress, 1 + i % n_workers, invocation, wait, request)
                 for i, (kind, seeds_, folders) in enumerate(jobs)]
        _run_pool(calls, n_workers, done, bar)
    bar.close()
    if shard is not None:  # the report is assembled by an invocation without --shard
        return {"shard": list(shard), "this_run": done, "wall_s": time.time() - t0}
    if not report:
        return {"this_run": done, "wall_s": time.time() - t0}

    def finish() -> dict:
        from .report import write_outputs

        results = collect_results(out, p, plan, seed_list)
        results["wall_s"] = time.time() - t0
        results["this_run"] = done
        write_outputs(out, results, progress=progress)
        return results

    return on_main(finish, share=True)


@contextmanager
def _sigterm_stops(active: bool) -> Iterator[None]:
    """SIGTERM (a scheduler) outside training ends the models' loop with
    :class:`~difftx.compare.train.TrainingInterrupted` (exit code 130, one line), not silently (143);
    every file written so far is complete. Inside training the trainer's own handler takes over.
    Main thread only, and only when ``active``."""
    import signal
    import threading

    from .train import TrainingInterrupted

    if not active or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise TrainingInterrupted("stopped by SIGTERM outside training (an evaluation stopped at once; what was "
                                  "finished is kept); run the same command again to continue")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


class JobStopped(RuntimeError):
    """A worker process was asked to stop (SIGTERM) outside training; what it wrote is complete."""


_STOPPING: list[str] = []  # in a worker process: the signal that stopped it (it starts no further job)
_WORKER = {"running": False, "orphaned": False}  # in a worker process: in a job; its parent is gone
ORPHAN_GRACE_S = 20.0  # a worker whose parent died: the time its job has to stop (a checkpoint) before it exits
ORPHAN_POLL_S = 0.5


def _worker_signals() -> None:
    """In each worker process: Ctrl-C is the parent's to handle (it reaches the whole process group),
    and SIGTERM outside training stops the job at once (every file is written atomically); inside
    training the trainer's own handler finishes the step and writes a checkpoint first. A watcher
    thread ends the worker when its parent dies (:func:`_watch_parent`)."""
    import signal
    import threading

    def stop(signum, frame):
        _STOPPING.append(signal.Signals(signum).name)
        raise JobStopped(f"stopped by {_STOPPING[0]}")

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)
    try:  # no cross-process lock for the progress bars: a spawned worker shares none, and a killed one would
        from tqdm.std import TqdmDefaultWriteLock  # leave its named semaphore for the resource tracker to report

        TqdmDefaultWriteLock.mp_lock = None
    except ImportError:  # pragma: no cover - another tqdm
        pass
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True, name="difftx-parent-watch").start()


def _watch_parent(parent: int) -> None:
    """Once the worker's parent is gone (even by SIGKILL: the worker is handed to another parent),
    stop: an idle worker exits at once; a job gets SIGTERM (training finishes its step and writes a
    checkpoint, an evaluation stops), and the worker exits when it has stopped, or after
    :data:`ORPHAN_GRACE_S` at the latest. Never waits for a parent that cannot answer."""
    import signal

    while os.getppid() == parent:
        time.sleep(ORPHAN_POLL_S)
    _WORKER["orphaned"] = True
    if not _WORKER["running"]:
        os._exit(1)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(ORPHAN_GRACE_S)
    os._exit(1)


def _pool_job(*args) -> dict:
    """:func:`_job` in a worker process; once a signal stopped one job, the worker starts no other
    (the pool hands each worker a job ahead, which the parent can no longer cancel). A worker whose
    parent died exits when its job ends."""
    from .train import TrainingInterrupted

    if _STOPPING or _WORKER["orphaned"]:
        raise JobStopped(f"not started: stopped by {_STOPPING[0] if _STOPPING else 'the parent ending'}")
    _WORKER["running"] = True
    try:
        return _job(*args)
    except TrainingInterrupted:
        _STOPPING.append("SIGTERM")
        raise
    finally:
        _WORKER["running"] = False
        if _WORKER["orphaned"]:
            os._exit(1)  # nobody reads the result: the pool's queues would block this process forever


def _run_pool(calls: list[tuple], n_workers: int, done: dict, bar) -> None:
    """Run ``_job(*args)`` for each of ``calls`` in ``n_workers`` spawned processes, filling
    ``done``. A first SIGINT / SIGTERM to this process cancels the jobs not started and passes
    SIGTERM on to the workers: a model in training stops after its current step with a checkpoint,
    an evaluation stops at once; then :class:`TrainingInterrupted` says what to run to continue. A
    second signal kills the workers."""
    import multiprocessing as mp
    import signal
    import threading
    from concurrent.futures import CancelledError, ProcessPoolExecutor, as_completed

    from .train import TrainingInterrupted

    stopped: list[str] = []

    def handle(signum, frame) -> None:
        name = signal.Signals(signum).name
        if stopped:  # the second signal: no more waiting
            for child in mp.active_children():
                child.kill()
            raise KeyboardInterrupt
        stopped.append(name)
        for fut in futs:
            fut.cancel()
        for child in mp.active_children():
            os.kill(child.pid, signal.SIGTERM)

    ctx = mp.get_context("spawn")
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with ProcessPoolExecutor(max_workers=min(n_workers, len(calls)), mp_context=ctx,
                             initializer=_worker_signals) as ex:
        futs = {ex.submit(_pool_job, *args): [f"seed{seed}/{args[1]}" for seed in args[2]] for args in calls}
        main_thread = threading.current_thread() is threading.main_thread()
        if main_thread:
            for sig in old:
                signal.signal(sig, handle)
        try:
            for fut in as_completed(futs):
                try:
                    done.update(fut.result())
                except (CancelledError, TrainingInterrupted, JobStopped):
                    if not stopped:
                        raise
                    continue
                bar.update(len(futs[fut]))
        finally:
            if main_thread:
                for sig, h in old.items():
                    signal.signal(sig, h)
    if stopped:
        unfinished = sorted({name for names in futs.values() for name in names} - set(done))
        raise TrainingInterrupted(f"stopped by {stopped[0]}: {len(done)} model(s) done in this run, {len(unfinished)} "
                                  f"not finished ({', '.join(unfinished)}); the models in training wrote a checkpoint; "
                                  f"run the same command again to continue")


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank()


def execution(device: str) -> dict:
    """How this invocation ran: processes (torchrun's world size), device and process-group backend."""
    import torch.distributed as dist

    from ..training.distributed import is_initialized, resolve_device

    group = is_initialized()
    return {"world_size": dist.get_world_size() if group else 1, "device": str(resolve_device(device)),
            "backend": dist.get_backend() if group else None}


def versions() -> dict:
    import numpy
    import torch

    from .. import __version__

    return {"difftx": __version__, "torch": torch.__version__, "numpy": numpy.__version__,
            "python": sys.version.split()[0], "platform": platform.platform(), "cpu_count": os.cpu_count()}


def collect_results(out: Path, preset: ComparePreset, plan: ComparePlan, seeds: Sequence[int]) -> dict:
    """Read every stored part back into one JSON-ready dict (the ``results.json`` schema, see
    ``docs/compare.md`` and :mod:`difftx.compare.schema`) and add the paired comparisons.
    ``preset`` is recorded as given; ``plan`` is what it resolved to."""
    from ..tasks import TASKS, settings_to_dict

    settings = plan.tasks
    runs: dict = {}
    for s in seeds:
        runs[str(s)] = {}
        for k in plan.arms:
            f = out / f"seed{s}" / k
            evals = {e: read_json(f / EVALS_DIR / f"{e}.json", f"the {e} evaluation of a compare model")
                     for e in settings}
            runs[str(s)][k] = {"train": TrainRecord.read(f).to_dict(), "tasks": evals, "machine": read_machine(f)}
    first = runs[str(seeds[0])]
    how = execution(plan.execution.device)
    results = {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "versions": versions(),
        # the machine that assembled this file (each model's training machine: runs.{seed}.{arm}.machine)
        "machine": machine(how["device"]),
        "execution": how,
        "preset": preset.to_dict(),
        "seeds": list(seeds),
        "needle_task": plan.space.needle.to_dict() if plan.space.needle else None,
        "mixture": {**dataclasses.asdict(plan.mixture), "shares": plan.mixture.shares()},
        "arms": {k: {"config": cfg.to_dict(), "parameters": first[k]["train"]["parameters"]}
                 for k, cfg in plan.arms.items()},
        "tasks": {name: {"title": TASKS[name].title, "settings": settings_to_dict(st),
                         "metrics": [m.describe() for m in TASKS[name].metrics(st)]} for name, st in settings.items()},
        "runs": runs,
        "null_reasons": {},
    }
    if plan.text is not None:  # your text: source, tokenizer, held-out text, token counts (from compare.json)
        results["text"] = read_json(out / COMPARE_FILE, "the settings of a comparison").get("text")
    return add_comparisons(results, settings)


def add_comparisons(results: dict, settings: dict) -> dict:
    """``results`` (every model's training record and evaluations under ``runs``) with its paired
    comparisons: ``comparison`` (DIFF vs baseline), ``arm_comparisons`` (every other pair; Holm over
    all of them) and ``token_efficiency``. ``settings``: ``{task: Settings}`` of the plan."""
    from .summary import all_comparisons, pair_key, token_ratios

    comparisons = all_comparisons(results, settings)  # Holm over every pair of arms
    results["comparison"] = comparisons.pop(pair_key("diff", "baseline"))
    results["arm_comparisons"] = comparisons
    results["token_efficiency"] = token_ratios(results)
    return results
