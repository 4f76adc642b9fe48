"""A comparison resolved into plain parts: :func:`resolve` checks a
:class:`~difftx.compare.presets.ComparePreset` (the rules that tie its fields together) and turns
it into a :class:`ComparePlan`, and each later step receives only its part:

- ``space`` (:class:`~difftx.tasks.subject.TaskSpace`): the shared vocabulary of the needle, LM,
  ICL and recall tasks;
- ``arms``: the model config of every arm (``{"baseline": ..., "diff": ..., ...}``, see
  :data:`difftx.arm_table.ARMS`);
- ``schedule`` (:class:`Schedule`): optimizer and learning-rate schedule, read by the trainer;
- ``mixture`` (:class:`Mixture`): which kind of batch each optimizer step draws, read by the
  batch source (:class:`difftx.compare.stream.CompareStream`);
- ``probes`` (:class:`Probes`): the needle probes taken during training;
- ``curve`` (:class:`Curve`): the held-out loss measured along training;
- ``text`` (:class:`~difftx.tasks.subject.TextData` or None): your own corpus, tokenizer and
  held-out text (``--data``);
- ``tasks``: every registered evaluation task's validated settings;
- ``execution`` (:class:`Execution`): threads, parallel workers and device (how it runs, not
  what it computes);
- ``source`` (:class:`~difftx.compare.source.Source` or None): ``--from``'s pretrained model, whose
  config, vocabulary and tokenizer the two arms take (:func:`resolve_from`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from ..config import ModelConfig, arm_config
from ..eval.icl import ICLBlock
from ..eval.needle import NeedleBlock
from ..eval.recall import RecallBlock
from ..tasks import TASKS, settings_from_dict
from ..tasks.subject import BYTE_VOCAB, TaskSpace, TextBlock, TextData, first_free
from .arms import PRIMARY, Arm
from .training_tasks import BUILTIN as BUILTIN_TRAINING, TrainingTask

if TYPE_CHECKING:
    from ..training.config import TrainConfig
    from .source import Source

@dataclass(frozen=True)
class Curve:
    """Held-out loss along training: at ``steps`` (log-spaced, the last step included), the mean
    NLL of ``windows`` fixed held-out windows of the LM training length (none: no curve)."""

    steps: tuple
    windows: int


def curve_of(preset: Any, lm: bool = True) -> Curve:
    """The held-out curve of ``preset`` (its schedule's ``curve_points`` and ``curve_windows``; no steps without
    LM batches, ``lm`` false)."""
    s = preset.schedule
    return Curve(curve_steps(s["steps"], s["curve_points"]) if lm else (), s["curve_windows"])


def curve_steps(total: int, points: int) -> tuple:
    """``points`` steps spaced geometrically from ~1% of ``total`` to ``total`` (rounded,
    duplicates dropped: fewer for a short run; ``()`` for ``points = 0``)."""
    if points <= 0:
        return ()
    first = max(1, round(total / 100))
    if points == 1 or first >= total:
        return (total,)
    ratio = (total / first) ** (1 / (points - 1))
    return tuple(sorted({min(total, round(first * ratio ** i)) for i in range(points - 1)} | {total}))


@dataclass(frozen=True)
class Mixture:
    """Which batch optimizer step ``s`` (from 1) draws, by the training tasks' registry
    (:data:`difftx.compare.training_tasks.TRAINING_TASKS`, as it is when the mixture is made): the first
    task, in registry order, whose ``every`` divides ``s``, else the task that takes the rest (``rest``).
    ``settings`` holds each registered task's settings (``{task name: its Settings}``, None: a task that keeps
    its settings on its instance), which its ``every`` and its batches read; ``batch_size`` is the global batch
    (all processes together)."""

    batch_size: int
    settings: dict

    def __post_init__(self) -> None:
        from .training_tasks import TRAINING_TASKS

        # the registry now (not a field)
        object.__setattr__(self, "tasks", tuple(TRAINING_TASKS.values()))
        missing = [t.name for t in self.tasks if t.Settings is not None and t.name not in self.settings]
        if missing:
            raise ValueError(f"Mixture: no settings for training task(s) {missing}")

    def task_of(self, step: int) -> TrainingTask:
        """The training task of optimizer step ``step`` (from 1)."""
        rest = None
        for task in self.tasks:
            if task.rest:
                rest = task
            else:
                every = task.every(self)
                if every and step % every == 0:
                    return task
        assert rest is not None, "no training task takes the rest of the steps"
        return rest

    def step_kind(self, step: int) -> str:
        """The kind of batch of optimizer step ``step`` (from 1): its task's name."""
        return self.task_of(step).name

    def kinds(self) -> tuple:
        """Every task's name, in registry order."""
        return tuple(t.name for t in self.tasks)

    def shares(self) -> dict[str, float]:
        """Share of the training steps of each batch kind (over one period of the schedule), in registry order."""
        period = math.lcm(*(t.every(self) or 1 for t in self.tasks if not t.rest))
        kinds = [self.step_kind(s) for s in range(1, period + 1)]
        return {k: kinds.count(k) / period for k in self.kinds()}

    def to_dict(self) -> dict:
        """What ``results.json`` records of it: the batch size, the settings each task records with the mixture
        (by their preset spellings) and the shares."""
        out = {"batch_size": self.batch_size}
        for settings in self.settings.values():
            if settings is not None:
                out.update(settings.mixture_record())
        return {**out, "shares": self.shares()}


@dataclass(frozen=True)
class Schedule:
    """Optimizer and schedule of every model: AdamW, linear warmup then cosine decay to ``min_lr``
    over ``steps``, a log record every ``log_every`` steps."""

    steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    log_every: int
    lambda_warmup: int = 0

    def train_config(self, *, model: ModelConfig, batch_size: int, seed: int, out_dir: str | os.PathLike,
                     device: str = "auto", world_size: int = 1, progress: bool = False) -> TrainConfig:
        """The trainer's config of one model: ``batch_size`` is the global batch
        (``batch_size // world_size`` per process); a checkpoint every ~10% of the steps (a multiple
        of ``log_every``, so a resumed run logs the same records); no validation passes."""
        from ..training.config import TrainConfig

        if batch_size % world_size:
            raise ValueError(f"ComparePreset.batch_size: {batch_size} is not divisible by the {world_size} "
                             "processes (each takes an equal share of every batch)")
        ckpt_every = max(1, round(self.steps / 10 / self.log_every)) * self.log_every
        return TrainConfig(model=model.to_dict(), seq_len=model.max_seq_len, batch_size=batch_size // world_size,
                           steps=self.steps, lr=self.lr, min_lr=self.min_lr, warmup_steps=self.warmup_steps,
                           decay="cosine", weight_decay=self.weight_decay, grad_clip=self.grad_clip, seed=seed,
                           lambda_warmup=self.lambda_warmup,
                           eval_interval=0, log_interval=self.log_every, ckpt_interval=ckpt_every, keep_last=1,
                           out_dir=str(out_dir), tensorboard=False, progress=progress, device=device)


@dataclass(frozen=True)
class Probes:
    """Needle accuracy on ``samples`` fixed prompts per ``grid`` cell, and recall accuracy on ``samples``
    fixed examples (the training length, the most training pairs), every ``every`` steps of training
    (0: none)."""

    every: int
    samples: int
    grid: tuple


@dataclass(frozen=True)
class Execution:
    """How models are run: torch threads per process (None: as is), models trained side by side
    in separate processes, device, and the largest stack of one arm's seeds trained as one model
    (0: chosen by :func:`difftx.compare.jobs.stack_size`; 1: none)."""

    threads: Optional[int]
    workers: int
    device: str
    stack: int = 0


@dataclass(frozen=True)
class ComparePlan:
    """A preset resolved (see the module doc)."""

    name: str
    space: TaskSpace
    arms: dict
    schedule: Schedule
    mixture: Mixture
    probes: Probes
    tasks: dict
    execution: Execution
    curve: Curve = Curve((), 0)
    text: Optional[TextData] = None
    source: Optional["Source"] = None  # compare --from: the pretrained model both arms start from
    primary: tuple = PRIMARY  # the pair a verdict answers first: the preset's; --from: (converted, source)
    descriptions: dict = dataclasses.field(default_factory=dict)  # what each arm of your own is (own_arms)

    def arm(self, name: str) -> Arm:
        """The arm ``name`` as one value (its config, label and description; its source under ``--from``)."""
        if self.source is not None:
            return Arm.from_source(name, self.arms[name], self.source.path, self.source.method,
                                   converted=name == self.primary[0])
        if name in self.descriptions:
            return Arm(name, self.arms[name].to_dict(), None, name, self.descriptions[name])
        return Arm.of(name, self.arms[name])


def own_arm_config(base, name: str, spec: dict):
    """The config of the arm of your own ``name`` (``spec``: :func:`check_own_arms`'), from the DIFF config
    ``base``: its ``from`` arm's config with its ``model`` fields, validated by ModelConfig."""
    try:
        return arm_config(base, spec["from"]).replace(**spec["model"])
    except ValueError as e:
        raise ValueError(str(e).replace("ModelConfig.", f"ComparePreset.own_arms.{name}.model.")) from None


def own_arm_description(spec: dict) -> str:
    """What an arm of your own is: its ``description``, else ``from`` and its changes."""
    changes = ", ".join(f"{k}={v}" for k, v in spec["model"].items()) or "no changes"
    return spec.get("description") or f"{spec['from']} with {changes} (an arm of your own)"


def preset_error(name: str, rule: str) -> ValueError:
    """The error of a preset field (or fields) that breaks ``rule``."""
    return ValueError(f"ComparePreset.{name}: {rule}")


def task_settings(tasks: dict) -> dict:
    """``{task name: its Settings}``: each registered task's defaults with a preset's ``tasks``
    overrides (validated; unknown tasks or fields are named)."""
    unknown = sorted(set(tasks) - set(TASKS))
    if unknown:
        raise preset_error("tasks", f"unknown task(s) {unknown}; known: {list(TASKS)}")
    out = {}
    for name, task in TASKS.items():
        given = tasks.get(name, {})
        if not isinstance(given, dict):
            raise preset_error(f"tasks.{name}", f"must be a mapping of settings, got {given!r}")
        try:
            out[name] = settings_from_dict(task.Settings, given, f"ComparePreset.tasks.{name}")
        except (TypeError, ValueError) as e:
            raise ValueError(str(e)) from None
    return out


def check_schedule(preset: Any) -> Schedule:
    """The optimisation schedule of ``preset`` (its ``schedule``), checked by the trainer's own rules (a
    ``ValueError`` naming the field: ``lr=inf`` or ``weight_decay=-1`` is refused here, before anything is
    trained)."""
    s = preset.schedule
    if s["warmup_steps"] > s["steps"]:
        raise preset_error("warmup_steps", f"{s['warmup_steps']} must not exceed steps={s['steps']}")
    if not (s["lr"] > 0 and 0 <= s["min_lr"] <= s["lr"]):
        raise preset_error("lr/min_lr", f"need lr > 0 and 0 <= min_lr <= lr, got {s['lr']}, {s['min_lr']}")
    plan = Schedule(**{f.name: s[f.name] for f in dataclasses.fields(Schedule)})
    try:  # every rule TrainConfig has for these fields (finite numbers, ...), on a stand-in model
        plan.train_config(model=ModelConfig(vocab_size=8, dim=8, n_layers=1, n_heads=1, max_seq_len=8),
                          batch_size=s["batch_size"], seed=0, out_dir="unused")
    except ValueError as e:
        raise ValueError(str(e).replace('TrainConfig.', 'ComparePreset.')) from None
    return plan


def execution_of(preset: Any) -> Execution:
    """How the models of ``preset`` are run (its ``execution``)."""
    return Execution(**preset.execution)


def probes_of(preset: Any, mixture: Mixture, space: TaskSpace, grid: tuple) -> Probes:
    """The probes of ``preset`` along training (its schedule's ``probe_every`` and ``probe_samples``; none
    where no task of ``mixture`` with batches in ``space`` probes)."""
    s = preset.schedule
    return Probes(every=s["probe_every"] if probed(mixture, space) else 0, samples=s["probe_samples"], grid=grid)


def mixture_of(preset: Any) -> Mixture:
    """The batch mixture of ``preset``."""
    return Mixture(batch_size=preset.schedule["batch_size"], settings=preset.training_settings())


def mixture_task(mixture: Mixture, name: str) -> TrainingTask:
    """The training task ``name`` of ``mixture``."""
    return next(t for t in mixture.tasks if t.name == name)


def registered_blocks(preset: Any, mixture: Mixture, space: TaskSpace) -> TaskSpace:
    """``space`` with the ids of each registered training task (not a built-in one) that ``mixture`` gives
    steps, after every other task's (``ids(preset)`` of them, :class:`~difftx.compare.training_tasks.TrainingTask`)."""
    shares = mixture.shares()
    for task in mixture.tasks:
        every = task.every(mixture)
        if task.name in BUILTIN_TRAINING or not every:
            continue
        if not shares[task.name]:
            takers = sorted({mixture.step_kind(s) for s in range(every, every * 13, every)} - {task.name})
            raise ValueError(f"training task {task.name!r}: every {every}-th step is already another task's "
                             f"({', '.join(takers)}): choose a period those tasks leave free, or give them fewer "
                             f"steps")
        n = task.ids(preset)
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"training task {task.name!r}: ids(preset) must be a positive number of ids, got {n!r}")
        space = TaskSpace({**space.blocks, task.name: range(space.vocab_size, space.vocab_size + n)})
    return space


def probed(mixture: Mixture, space: TaskSpace) -> bool:
    """Whether a task of ``mixture`` that has batches in ``space`` probes the model during training."""
    return any(t.has_probe() and t.block(space) is not None for t in mixture.tasks)


def check_recall(preset: Any, tasks: dict) -> Optional[RecallBlock]:
    """The recall block of ``preset`` (None without recall batches; its ids from 0), checked with the recall
    evaluation's grid: each pair count, length and variant of ``tasks["recall"]`` must fit the vocabulary."""
    mixture = mixture_of(preset)
    r = mixture.settings["recall"]
    if not r.every:
        return None
    if not mixture.shares()["recall"]:
        raise preset_error("recall_every", f"{r.every}: every recall step would be an LM or ICL step")
    try:
        block = RecallBlock(vocab_size=r.vocab, seq_len=r.seq_len, pairs=r.pairs)
    except ValueError as e:
        raise preset_error("recall_vocab/recall_len/recall_pairs", str(e)) from None
    try:
        tasks["recall"].grid(block)
    except ValueError as e:
        raise preset_error("tasks.recall", str(e)) from None
    return block


def check(preset: Any) -> tuple[dict, NeedleBlock, Optional[ICLBlock]]:
    """Raise ``ValueError`` naming the fields when ``preset``'s fields do not fit together (each
    field alone was checked when it was made). Returns what the checks build: the task settings,
    the needle task and the ICL task (None without ICL batches; its ids from 0)."""
    p = preset
    check_schedule(p)
    if p.data is None and (p.tokenizer not in (None, "byte") or p.heldout is not None):
        raise preset_error("tokenizer/heldout", "apply to your own text only (--data)")
    tasks = task_settings(p.tasks)
    training = p.training_settings()
    ns, lm, ic = training["needle"], training["lm"], training["icl"]
    grid = tasks["needle"].grid
    for n, r in grid:
        if not 1 <= r <= n <= ns.max_needles:
            raise preset_error("tasks.needle.grid", f"N/R = {n}/{r} needs 1 <= R <= N <= max_needles={ns.max_needles}")
    try:
        needle = NeedleBlock(n_keys=ns.n_keys, n_filler=ns.n_filler, context_len=ns.context_len,
                             max_needles=ns.max_needles, max_query=max(r for _, r in grid))
    except ValueError as e:
        raise preset_error("context_len", str(e)) from None
    if not ic.every:
        return tasks, needle, None
    if ic.every == 1:
        raise preset_error("icl_every", "1 would leave no needle steps")
    if lm.every and ic.every % lm.every == 0:
        raise preset_error("icl_every", f"{ic.every} is a multiple of lm_every={lm.every}: every ICL step "
                                        "would be an LM step")
    try:
        return tasks, needle, ICLBlock(n_classes=ic.classes, features_per_class=ic.features_per_class,
                                       n_features=max(4 * ic.classes * ic.features_per_class, 2 * ic.classes),
                                       input_len=ic.input_len, n_labels=2 * ic.classes, n_demos=ic.demos)
    except ValueError as e:
        raise preset_error("icl_*", str(e)) from None


def resolve(preset: Any) -> ComparePlan:
    """The parts of ``preset`` (a :class:`~difftx.compare.presets.ComparePreset`), after
    :func:`check`; a ``ValueError`` naming the fields when they do not fit together."""
    from pathlib import Path

    from ..data import load_tokenizer

    tasks, needle, icl = check(preset)
    recall = check_recall(preset, tasks)
    if preset.source is not None:
        return resolve_from(preset, tasks, needle, icl, recall)
    grid = tasks["needle"].grid
    mixture = mixture_of(preset)
    if not mixture.shares()["needle"]:  # every step another kind of batch (LM, recall): no needle ids
        needle = None
    lm = mixture.settings["lm"].every > 0
    text, lm_vocab = None, BYTE_VOCAB
    if preset.data is not None:
        tok = preset.tokenizer or "byte"
        text = TextData(str(Path(preset.data).expanduser().resolve()),
                        tok if tok == "byte" else str(Path(tok).expanduser().resolve()),
                        None if preset.heldout is None else str(Path(preset.heldout).expanduser().resolve()))
        lm_vocab = load_tokenizer(text.tokenizer).vocab_size
    blocks: dict = {"needle": needle} if needle is not None else {}  # each block's ids after the ones before it
    if lm:
        blocks["lm"] = TextBlock(first_free(blocks), lm_vocab)
    if icl is not None:
        icl = blocks["icl"] = dataclasses.replace(icl, first_id=first_free(blocks))
    if recall is not None:
        recall = blocks["recall"] = dataclasses.replace(recall, first_id=first_free(blocks))
    space = registered_blocks(preset, mixture, TaskSpace(blocks))
    longest = max(needle.max_seq_len if needle else 0, mixture.settings["lm"].seq_len if lm else 0,
                  icl.prompt_len + 1 if icl else 0, recall.seq_len if recall else 0,
                  *(mixture_task(mixture, name).seq_len(preset) for name in space.blocks if name not in blocks))
    diff = ModelConfig(vocab_size=space.vocab_size, attention="diff", max_seq_len=longest, **preset.model)
    own = preset.own_arms
    return ComparePlan(
        name=preset.name, space=space,
        arms={a: own_arm_config(diff, a, own[a]) if a in own else arm_config(diff, a) for a in preset.arms},
        descriptions={a: own_arm_description(own[a]) for a in preset.arms if a in own},
        schedule=check_schedule(preset),
        mixture=mixture, probes=probes_of(preset, mixture, space, grid), tasks=tasks, execution=execution_of(preset),
        curve=curve_of(preset, lm), text=text, primary=tuple(preset.primary))


def resolve_from(preset: Any, tasks: dict, needle: Optional[NeedleBlock], icl: Optional[ICLBlock],
                 recall: Optional[RecallBlock]) -> ComparePlan:
    """:func:`resolve` for a comparison from a pretrained source (``preset.source``, ``difftx compare --from``):
    the arms are the source and its conversion (:func:`difftx.compare.source.source_arms`; the preset's model
    fields are not used), the text is tokenized with the source's tokenizer unless ``tokenizer`` is given, and
    the batches are LM and recall batches only, recall in the ids ``0 .. recall_vocab - 1`` of the source's
    vocabulary."""
    from pathlib import Path

    from ..data import load_tokenizer
    from ..data.tokenizer import not_the_models_tokenizer
    from .source import FROM_PRIMARY, Source, read_source_model, source_arms

    p = preset
    mixture = mixture_of(p)
    if p.data is None:
        raise preset_error("source", "a comparison from a source trains on your text: give it (--data TEXT)")
    if tuple(p.arms) != type(p)().arms or tuple(p.primary) != type(p)().primary:
        raise preset_error("arms", f"a comparison from a source has two arms of its own, the source and its "
                                   f"conversion (its pair: converted vs source); got arms {list(p.arms)}, primary "
                                   f"{list(p.primary)}")
    own = [t.name for t in mixture.tasks if t.name not in BUILTIN_TRAINING and t.every(mixture)]
    if own:  # registered tasks take ids after the built-in ones, which a source's vocabulary does not have
        raise preset_error("source", f"a comparison from a source trains on LM and recall batches only; the "
                                     f"registered training task(s) {own} would need ids of their own beyond the "
                                     f"source's vocabulary: leave them out of this process (--kinds) or set their "
                                     f"period to 0")
    if any(v for k, v in mixture.shares().items() if k not in ("lm", "recall")) or icl is not None \
            or not mixture.settings["lm"].every:
        raise preset_error("lm_every/icl_every/recall_every", "a comparison from a source trains on LM and recall "
                                                              "batches only (the needle and ICL tasks need ids the "
                                                              "source's vocabulary does not have): every step must be "
                                                              "an LM step or a recall step, with lm_every > 0")
    kind, config, folder, src_tok = read_source_model(p.source)
    where = f"ComparePreset.source: {p.source}"
    tok = p.tokenizer or src_tok
    if tok is None:
        raise preset_error("tokenizer", f"{p.source} has no tokenizer (a difftx tokenizer/ folder, or a transformers "
                                        "folder's tokenizer.json): give the one it was trained with (--tokenizer "
                                        "DIR, or byte)")
    tok = tok if tok == "byte" else str(Path(tok).expanduser().resolve())
    lm_vocab = load_tokenizer(tok).vocab_size
    if p.tokenizer is not None and src_tok is not None:
        other = not_the_models_tokenizer(load_tokenizer(tok), p.tokenizer, src_tok, p.source)
        if other is not None:
            raise preset_error("tokenizer", other)
    if lm_vocab > config.vocab_size:
        raise preset_error("tokenizer", f"{tok} has {lm_vocab} tokens, more than the source's vocab_size "
                                        f"{config.vocab_size}")
    if recall is not None and recall.vocab_size > config.vocab_size:
        raise preset_error("recall_vocab", f"{recall.vocab_size} exceeds the source's vocab_size {config.vocab_size}")
    longest = max(mixture.settings["lm"].seq_len, recall.seq_len if recall is not None else 0)
    if longest > config.max_seq_len:
        raise ValueError(f"{where}: its max_seq_len {config.max_seq_len} is shorter than the training sequences "
                         f"({longest}: lm_seq_len / recall_len)")
    text = TextData(str(Path(p.data).expanduser().resolve()), tok,
                    None if p.heldout is None else str(Path(p.heldout).expanduser().resolve()))
    space = TaskSpace({"lm": TextBlock(0, lm_vocab), **({"recall": recall} if recall is not None else {})})  # recall
    # ids from 0: the source's own
    source = Source(str(Path(p.source).expanduser().resolve()), kind, folder, src_tok, p.convert_method,
                    float(p.convert_lambda_init))
    return ComparePlan(
        name=p.name, space=space, arms=source_arms(config, p.convert_method, p.convert_lambda_init),
        schedule=check_schedule(p),
        mixture=mixture, probes=probes_of(p, mixture, space, tasks["needle"].grid), tasks=tasks,
        execution=execution_of(p), curve=curve_of(p), text=text, source=source, primary=FROM_PRIMARY)
