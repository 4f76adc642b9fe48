"""Named settings of ``difftx compare``: model shape, training budget and evaluation sizes.

A :class:`ComparePreset` is plain data: constructing one checks each field on its own. What
follows from several fields (the task space, each arm's model, the schedule) and the rules that
tie fields together are :func:`difftx.compare.plan.resolve`'s, which :func:`get_preset` and
:meth:`ComparePreset.with_overrides` call to validate a preset."""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field

from .plan import ComparePlan, preset_error, resolve, task_settings
from .training_tasks import TRAINING_TASKS

MAX_STEPS = 10 ** 9  # a comparison's optimizer steps: far beyond any run this tool trains, small enough to plan for
MAX_PROBES = 100_000  # probes (or held-out curve points) along one model's training
# a preset's model where it gives none, each also spelled flat (``dim=64``, ``--set n_layers=4``) as ``model.dim``;
# differential heads n_heads (the baseline: 2x as many standard heads of the same width d), init "normal" N(0, 0.02)
MODEL_DEFAULTS = {"dim": 64, "n_layers": 2, "n_heads": 2, "init": "normal"}
PLAN_MODEL_FIELDS = ("vocab_size", "max_seq_len", "attention")  # the plan's: the tasks' vocabulary and lengths, the arm
# a preset's schedule (how and when along training: optimizer, learning-rate schedule, log records, probes, held-out
# curve) and its execution (how it runs, not what it computes), each field with its default and also spelled flat
# (lr=1e-3, --set lr=1e-3, preset.lr) as schedule.lr; written flat (to_dict)
SCHEDULE_DEFAULTS = {
    "steps": 1500, "batch_size": 32, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 100, "weight_decay": 0.1,
    "grad_clip": 1.0,
    "lambda_warmup": 0,  # differential arms: lambda ramped linearly from 0 to the model's own over this many steps
    "log_every": 25,
    # retrieval during training: every probe_every steps (0: no probes), needle accuracy on probe_samples fixed
    # prompts per grid cell (depth 50%) and recall accuracy on probe_samples fixed examples
    "probe_every": 0, "probe_samples": 10,
    # held-out loss along training: at curve_points log-spaced steps (0: no curve), on curve_windows fixed windows
    "curve_points": 10, "curve_windows": 8}
EXECUTION_DEFAULTS = {
    "threads": None,  # torch threads per process (None: leave as is)
    "workers": 1,  # models trained in parallel processes (2 on a 2-core CPU: one thread each)
    "stack": 0,  # seeds of one arm trained together as one stacked model in a process (0: auto, 1: never, K: at most K)
    "device": "auto"}  # auto, cpu or cuda
# the parts whose fields a preset also takes, reads and --set spells flat: {part: its flat-spelled fields}
FLAT_PARTS = {"model": tuple(MODEL_DEFAULTS), "schedule": tuple(SCHEDULE_DEFAULTS),
              "execution": tuple(EXECUTION_DEFAULTS)}


def training_spelling() -> dict:
    """``{preset spelling: (task, setting)}`` of every setting of every registered training task's settings
    (:attr:`~difftx.compare.training_tasks.TrainingTask.Settings`): ``lm_every`` is the LM task's ``every``."""
    return {spelled: (task.name, name) for task in TRAINING_TASKS.values() if task.Settings is not None
            for spelled, name in task.Settings.spelling().items()}


def model_fields() -> list[str]:
    """The :class:`~difftx.config.ModelConfig` fields a preset's ``model`` may set (all but the plan's own)."""
    from ..config import ModelConfig

    return [f.name for f in dataclasses.fields(ModelConfig) if f.name not in PLAN_MODEL_FIELDS]


def check_model(model: dict) -> dict:
    """A preset's ``model`` validated once, by :class:`~difftx.config.ModelConfig` itself (on stand-ins for the
    plan's fields), an error naming ``ComparePreset.model.FIELD``; a field :data:`MODEL_DEFAULTS` does not name is
    kept only where it is not ModelConfig's default (equal presets are equal)."""
    from ..config import ModelConfig

    fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(str(k) for k in model if k not in fields)
    if unknown:
        raise preset_error("model", f"unknown ModelConfig field(s) {unknown}; known: {', '.join(model_fields())}")
    owned = [k for k in PLAN_MODEL_FIELDS if k in model]
    if owned:
        raise preset_error(f"model.{owned[0]}", "is the comparison's own: vocab_size and max_seq_len come from its "
                                                "tasks, each arm's attention from the arm (--arms)")
    try:
        ModelConfig(vocab_size=8, max_seq_len=8, attention="diff", **model)
    except ValueError as e:
        raise ValueError(str(e).replace("ModelConfig.", "ComparePreset.model.")) from None
    return {k: v for k, v in model.items() if k in MODEL_DEFAULTS or v != fields[k]}


def _unknown(part: str, given: dict, known) -> None:
    """Refuse the keys of a preset's ``part`` that are not among ``known``, naming the known ones."""
    if not isinstance(given, dict):
        raise preset_error(part, f"must be a mapping {{field: value}} of {', '.join(known)}, got {given!r}")
    unknown = sorted(str(k) for k in given if k not in known)
    if unknown:
        raise preset_error(part, f"unknown field(s) {unknown}; known: {', '.join(known)}")


def _whole(name: str, v, low: int = 1) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        raise preset_error(name, f"must be a {'positive' if low else 'non-negative'} integer, got {v!r}")


def check_schedule_fields(schedule: dict) -> dict:
    """A preset's ``schedule`` (:data:`SCHEDULE_DEFAULTS` where not given), each field checked on its own, an error
    naming it (``ComparePreset.lr``); the rules that tie them together are
    :func:`difftx.compare.plan.check_schedule`'s. Every field is kept (equal presets are equal)."""
    _unknown("schedule", schedule, SCHEDULE_DEFAULTS)
    s = {**SCHEDULE_DEFAULTS, **schedule}
    for name in ("steps", "batch_size", "log_every", "probe_samples", "curve_windows"):
        _whole(name, s[name])
    for name in ("warmup_steps", "probe_every", "curve_points", "lambda_warmup"):
        _whole(name, s[name], 0)
    for name in ("lr", "min_lr", "weight_decay", "grad_clip"):
        v = s[name]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise preset_error(name, f"must be a finite number, got {v!r}")
    # every structure built from a step count (probe schedules, curve points) is sized here, before it is built
    if s["steps"] > MAX_STEPS:
        raise preset_error("steps", f"{s['steps']:,} is more than a comparison can train (at most {MAX_STEPS:,})")
    if s["probe_every"] and s["steps"] // s["probe_every"] > MAX_PROBES:
        raise preset_error("probe_every", f"{s['probe_every']} probes {s['steps'] // s['probe_every']:,} times in "
                                          f"{s['steps']:,} steps, more than {MAX_PROBES:,}: raise probe_every")
    if s["curve_points"] > MAX_PROBES:
        raise preset_error("curve_points", f"{s['curve_points']:,} is more than {MAX_PROBES:,}")
    return s


def check_execution(execution: dict) -> dict:
    """A preset's ``execution`` (:data:`EXECUTION_DEFAULTS` where not given), each field checked, an error naming
    it (``ComparePreset.workers``). Every field is kept (equal presets are equal)."""
    _unknown("execution", execution, EXECUTION_DEFAULTS)
    e = {**EXECUTION_DEFAULTS, **execution}
    _whole("workers", e["workers"])
    _whole("stack", e["stack"], 0)
    if e["threads"] is not None and (not isinstance(e["threads"], int) or isinstance(e["threads"], bool)
                                     or e["threads"] <= 0):
        raise preset_error("threads", f"must be a positive integer or None, got {e['threads']!r}")
    if e["device"] not in ("auto", "cpu", "cuda"):
        raise preset_error("device", f"must be auto, cpu or cuda, got {e['device']!r}")
    return e


def flat_field(name: str) -> str:
    """A field of the schedule or the execution by its flat spelling: ``schedule.lr`` -> ``lr`` (any other name as
    it is), as ``--sweep`` and ``--tune`` take it."""
    part, dot, rest = name.partition(".")
    return rest if dot and rest and part in ("schedule", "execution") else name


def flat_parts(overrides: dict) -> dict:
    """``overrides`` with the fields given in ``schedule`` and ``execution`` (``--set schedule.lr=1e-3``) spelled
    flat (``lr``), as the commands read them (``--set workers`` is ``--workers``, ``--sweep lr`` brings ``min_lr``
    along); a field given both ways is refused, the model's too (``model.dim`` and ``dim``)."""
    out = dict(overrides)
    model = out.get("model")
    both = sorted(set(model) & set(out) & set(FLAT_PARTS["model"])) if isinstance(model, dict) else []
    if both:  # the model's fields stay a mapping; given both ways the flat spelling would silently win
        raise ValueError(f"--set model.{both[0]} and --set {both[0]}: give it in one place")
    for part in ("schedule", "execution"):
        if part not in out:
            continue
        given = out.pop(part)
        _unknown(part, given, FLAT_PARTS[part])
        both = sorted(set(given) & set(out))
        if both:
            raise ValueError(f"--set {part}.{both[0]} and --set {both[0]}: give it in one place")
        out.update(given)
    return out


OWN_ARM_KEYS = ("from", "model", "description")  # what an arm of your own says (ComparePreset.own_arms)
ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")  # an arm's name: its folder seed{S}/{name}


def check_own_arms(own: dict) -> dict:
    """A preset's ``own_arms`` checked on their own (the derived configs are checked by the plan): each a name of
    its own that is a folder name and no built-in arm's or registered kind's, derived ``from`` an arm (default
    ``diff``) with ``model`` changes (ModelConfig fields, not the plan's own) and an optional ``description``."""
    from ..config import arm_names

    if not isinstance(own, dict):
        raise preset_error("own_arms", f"must be a mapping {{name: {{from, model, description}}}}, got {own!r}")
    out = {}
    for name, spec in own.items():
        at = f"own_arms.{name}"
        if not isinstance(name, str) or not ARM_NAME.fullmatch(name):
            raise preset_error(at, "a name of letters, digits, '_', '.' and '-' (its folder seed{S}/NAME), up to 64")
        if name in arm_names():
            raise preset_error(at, f"{name!r} is a built-in arm or a registered kind: give yours another name")
        if not isinstance(spec, dict) or set(spec) - set(OWN_ARM_KEYS):
            raise preset_error(at, f"must be a mapping with {', '.join(OWN_ARM_KEYS)}, got {spec!r}")
        base, model = spec.get("from", "diff"), spec.get("model") or {}
        if base not in arm_names():
            raise preset_error(f"{at}.from", f"must be an arm of {arm_names()}, got {base!r}")
        if not isinstance(model, dict) or set(model) - set(model_fields()) or "attention" in model:
            raise preset_error(f"{at}.model", f"must be a mapping of ModelConfig fields ({', '.join(model_fields())}), "
                                              f"got {model!r}")
        description = spec.get("description", "")
        if not isinstance(description, str):
            raise preset_error(f"{at}.description", f"must be text, got {description!r}")
        out[name] = {"from": base, "model": dict(model), **({"description": description} if description else {})}
    return out


@dataclass(frozen=True, init=False)
class ComparePreset:
    """Everything one comparison needs besides the seeds and the output folder.

    Training is multi-task on one model: needle batches (the synthetic multi-needle task, mixed
    N/R/depths, loss on the answer tokens) and, every ``lm_every``-th step, a language-modelling
    batch of bundled Shakespeare bytes (token ids shifted past the needle vocabulary, loss on every
    token). ``lm_every = 0`` trains on the needle task alone (no LM evaluation then). Every
    ``icl_every``-th step that is not an LM step is a batch of the synthetic in-context
    classification task (:mod:`difftx.eval.icl`, label maps drawn per sequence, loss on every
    label token); ``icl_every = 0`` trains none and skips the ICL order-robustness evaluation.
    Every ``recall_every``-th step that is neither is a batch of multi-query associative recall
    (:mod:`difftx.eval.recall`: ``recall_vocab`` tokens, ``recall_len`` positions, a pair count of
    ``recall_pairs`` drawn per batch, loss on every query); ``recall_every = 1`` (with no LM or ICL
    steps) trains recall alone, as the ``recall-cpu`` preset does.
    ``data`` (with ``tokenizer`` and ``heldout``) puts your text in place of the Shakespeare bytes;
    :meth:`on_text` also makes every step an LM batch (``difftx compare --data``). Every model
    records its held-out loss at ``curve_points`` log-spaced steps on ``curve_windows`` windows.

    The training tasks' settings are theirs (:attr:`~difftx.compare.training_tasks.TrainingTask.Settings`, each
    field with its preset spelling: ``lm_every`` is the LM task's ``every``): ``training`` holds the ones a preset
    gives (``{task: {setting: value}}``), a preset takes and reads each by its spelling (``ComparePreset(lm_every=3)``,
    ``preset.lm_every``, ``--set lm_every=3`` or ``--set training.lm.every=3``), and :meth:`to_dict` writes them so.

    ``model`` is the DIFF arm's model (:class:`~difftx.config.ModelConfig` fields, validated by ModelConfig; ``dim``,
    ``n_layers``, ``n_heads`` and ``init`` also spelled flat: ``preset.dim``); every arm is derived from it.
    ``schedule`` says how and when along training (:data:`SCHEDULE_DEFAULTS`: steps, batch, learning-rate schedule,
    log records, probes, held-out curve) and ``execution`` how it runs (:data:`EXECUTION_DEFAULTS`: threads, workers,
    stack, device); each of their fields is also spelled flat (``ComparePreset(lr=1e-3)``, ``preset.lr``, ``--set
    lr=1e-3`` or ``--set schedule.lr=1e-3``), and :meth:`to_dict` writes them flat.
    ``primary`` is the pair a verdict answers first.

    Construction checks each field on its own; :func:`difftx.compare.plan.resolve` checks the rest
    (:func:`get_preset` and :meth:`with_overrides` return validated presets).
    """

    name: str = "custom"
    description: str = ""
    # -- model (DIFF; the baseline is difftx.config.baseline_config of it) -------------------------
    # the arms trained for every seed (names of difftx.arm_table.ARMS or registered kinds; the primary pair among them)
    arms: tuple = ("baseline", "diff")
    # the DIFF arm's model: ModelConfig fields ({"dim": 64, "lambda_init": 0.3, ...}; MODEL_DEFAULTS where not given,
    # the plan gives vocab_size, max_seq_len and each arm's attention); every arm is derived from it (arm_config)
    model: dict = field(default_factory=dict)
    # the pair a verdict answers first: (DIFF, its parameter-matched baseline); both must be among the arms
    primary: tuple = ("diff", "baseline")
    # arms of your own, as data: {name: {"from": an arm's name (default diff), "model": {ModelConfig field: value},
    # "description": text}}; each is that arm's config with the model fields changed, trained where `arms` names it
    # (with_overrides adds the ones it is given to the arms, unless it is given the arms too)
    own_arms: dict = field(default_factory=dict)
    # -- the training tasks' settings given ({task name: {setting: value}}; the rest: their defaults) --
    training: dict = field(default_factory=dict)
    # -- how and when along training (SCHEDULE_DEFAULTS where not given; each field also spelled flat: lr=1e-3) --
    schedule: dict = field(default_factory=dict)
    # -- how it runs, not what it computes (EXECUTION_DEFAULTS where not given; also flat: workers=2) -------------
    execution: dict = field(default_factory=dict)
    # -- your own text (difftx compare --data): LM batches of this corpus instead of Shakespeare bytes --
    data: str | None = None  # what `difftx train --data` takes: a text file, a folder, a JSONL file
    tokenizer: str | None = None  # "byte" (None: byte) or a tokenizer.json / folder
    heldout: str | None = None  # a held-out text file scored whole (None: the corpus's validation split)
    # -- a pretrained source (difftx compare --from): the source fine-tuned against its conversion --------
    source: str | None = None  # a difftx 'standard' model / run folder or a transformers Llama folder
    convert_method: str = "mirror"  # the conversion's method (difftx convert --method)
    convert_lambda_init: float = 0.0  # the converted arm's lambda offset (difftx convert --lambda-init)
    # -- evaluation: per-task settings overrides ({task name: {field: value}}, see difftx.tasks) -----
    tasks: dict = field(default_factory=dict)

    def __init__(self, **given) -> None:
        """The fields by name, and each training task's setting by its spelling (``lm_every=3``) or in
        ``training``; the spelling wins over ``training``."""
        spelled = training_spelling()
        training = given.pop("training", None) or {}
        if not isinstance(training, dict) or not all(isinstance(v, dict) for v in training.values()):
            raise preset_error("training", f"must be a mapping {{task: {{setting: value}}}}, got {training!r}")
        training = {task: dict(vals) for task, vals in training.items()}
        for name in [k for k in given if k in spelled]:
            task, setting = spelled[name]
            training.setdefault(task, {})[setting] = given.pop(name)
        parts = {}  # model, schedule, execution: each given as a mapping and by its fields' flat spellings (these win)
        for part, flat in FLAT_PARTS.items():
            vals = given.pop(part, None) or {}
            if not isinstance(vals, dict):
                raise preset_error(part, f"must be a mapping {{field: value}}, got {vals!r}")
            parts[part] = {**(MODEL_DEFAULTS if part == "model" else {}), **vals,
                           **{k: given.pop(k) for k in flat if k in given}}
        fields = {f.name: f for f in dataclasses.fields(self)}
        unknown = sorted(set(given) - set(fields))
        if unknown:
            raise TypeError(f"ComparePreset: unknown field(s) {unknown}")
        for name, f in fields.items():
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            object.__setattr__(self, name, given.get(name, default))
        object.__setattr__(self, "training", training)
        for part, vals in parts.items():
            object.__setattr__(self, part, vals)
        self.__post_init__()

    def __getattr__(self, name: str):
        # a field of the model, the schedule or the execution by its flat spelling (preset.dim, preset.lr) and a
        # training task's setting by its preset spelling (preset.lm_every); only called for names not found
        for part, flat in FLAT_PARTS.items():
            if name in flat and part in self.__dict__:
                return self.__dict__[part][name]
        spelled = training_spelling()
        if name in spelled and "training" in self.__dict__:
            task, setting = spelled[name]
            return getattr(self.training_settings()[task], setting)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def training_settings(self) -> dict:
        """``{task name: its Settings}`` of every registered training task, in registry order: its defaults with
        this preset's ``training`` (None: a task that keeps its settings on its instance)."""
        return {name: task.Settings(**self.training.get(name, {})) if task.Settings is not None else None
                for name, task in TRAINING_TASKS.items()}

    def __post_init__(self) -> None:
        unknown = sorted(set(self.training) - {n for n, t in TRAINING_TASKS.items() if t.Settings is not None})
        if unknown:
            raise preset_error("training", f"unknown training task(s) {unknown}; with settings: "
                                           f"{[n for n, t in TRAINING_TASKS.items() if t.Settings is not None]}")
        for name, vals in self.training.items():
            known = {f.name for f in dataclasses.fields(TRAINING_TASKS[name].Settings)}
            if set(vals) - known:
                raise preset_error(f"training.{name}", f"unknown setting(s) {sorted(set(vals) - known)}; known: "
                                                       f"{sorted(known)}")
        # each setting checked on its own; kept where it is not the task's default (equal presets are equal)
        settings, normal = self.training_settings(), {}
        for name, vals in self.training.items():
            default = TRAINING_TASKS[name].Settings()
            given = {k: getattr(settings[name], k) for k in vals if getattr(settings[name], k) != getattr(default, k)}
            if given:
                normal[name] = given
        object.__setattr__(self, "training", normal)
        object.__setattr__(self, "model", check_model(self.model))
        object.__setattr__(self, "schedule", check_schedule_fields(self.schedule))
        object.__setattr__(self, "execution", check_execution(self.execution))
        for name in ("data", "tokenizer", "heldout", "source"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise preset_error(name, f"must be a path (text), got {v!r}")
        from ..interop.convert import METHODS

        if self.convert_method not in METHODS:
            raise preset_error("convert_method", f"must be one of {list(METHODS)}, got {self.convert_method!r}")
        v = self.convert_lambda_init
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
            raise preset_error("convert_lambda_init", f"must be a number in [0, 1), got {v!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise preset_error("device", f"must be auto, cpu or cuda, got {self.device!r}")
        from ..config import arm_names

        object.__setattr__(self, "own_arms", check_own_arms(self.own_arms))
        arms, known = self.arms, [*arm_names(), *self.own_arms]
        if isinstance(arms, str) or not isinstance(arms, (tuple, list)) or len(set(arms)) < 2 or \
                len(set(arms)) != len(arms) or not set(arms) <= set(known):
            raise preset_error("arms", f"need two or more distinct names of {known} (own_arms: arms of your own), "
                                       f"got {arms!r}")
        object.__setattr__(self, "arms", tuple(arms))
        primary = self.primary
        if isinstance(primary, str) or not isinstance(primary, (tuple, list)) or len(primary) != 2 or \
                primary[0] == primary[1] or not set(primary) <= set(self.arms):
            raise preset_error("primary", f"need two distinct arms of {list(self.arms)} (the pair a verdict answers "
                                          f"first), got {primary!r}")
        object.__setattr__(self, "primary", tuple(primary))
        if not isinstance(self.tasks, dict):
            raise preset_error("tasks", f"must be a mapping {{task: {{setting: value}}}}, got {self.tasks!r}")

    def on_text(self, data: str, tokenizer: str | None = None, heldout: str | None = None, *,
                synthetic: bool = False) -> ComparePreset:
        """This preset on your own text (:func:`text_overrides`)."""
        return self.with_overrides(**text_overrides({}, data, tokenizer, heldout, synthetic=synthetic))

    def task_settings(self) -> dict:
        """``{task name: its Settings}`` (:func:`difftx.compare.plan.task_settings`)."""
        return task_settings(self.tasks)

    def resolve(self) -> ComparePlan:
        """This preset as plain parts (:func:`difftx.compare.plan.resolve`)."""
        return resolve(self)

    def replace(self, **changes) -> ComparePreset:
        return dataclasses.replace(self, **changes)

    @classmethod
    def field_defaults(cls) -> dict:
        """``{field: default}`` of every field a preset is given: its own (``training`` aside), the fields of its
        model, schedule and execution by their flat spellings (``dim``, ``lr``, ``workers``) and each training task's
        setting by its spelling (``lm_every``)."""
        own = {f.name: f.default_factory() if f.default is dataclasses.MISSING else f.default
               for f in dataclasses.fields(cls) if f.name != "training"}
        settings = {spelled: getattr(TRAINING_TASKS[task].Settings, name)
                    for spelled, (task, name) in training_spelling().items()}
        return {**own, **MODEL_DEFAULTS, **SCHEDULE_DEFAULTS, **EXECUTION_DEFAULTS, **settings}

    def with_overrides(self, **overrides) -> ComparePreset:
        """This preset with field overrides; ``tasks`` and ``training`` overrides merge into the preset's per-task
        settings (``tasks={"needle": {"samples_per_cell": 20}}`` keeps the needle's other settings), ``model``,
        ``schedule`` and ``execution`` overrides into its model, schedule and execution (``model={"lambda_init":
        0.3}``, ``schedule={"lr": 1e-3}``, or ``dim=128``, ``lr=1e-3`` by their flat spellings), and an arm of your
        own into the preset's arm of that name (its ``model`` changes merged)."""
        known = {*self.field_defaults(), "training"}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"unknown compare preset field(s) {unknown}; known: {sorted(known)}")
        for part in ("tasks", "training", "own_arms"):
            if part not in overrides:
                continue
            given, shape = overrides[part], ("{name: {from, model, description}}" if part == "own_arms" else
                                             "{task: {setting: value}}")
            if not isinstance(given, dict):
                raise preset_error(part, f"must be a mapping {shape}, got {given!r}")
            merged = {k: dict(v) for k, v in getattr(self, part).items()}
            for name, vals in given.items():
                if not isinstance(vals, dict):
                    raise preset_error(f"{part}.{name}", f"must be a mapping ({shape}), got {vals!r}")
                arm = merged.setdefault(name, {})
                if part == "own_arms" and isinstance(vals.get("model"), dict):  # an arm's model changes merge too
                    vals = {**vals, "model": {**(arm.get("model") or {}), **vals["model"]}}
                arm.update(vals)
            overrides = {**overrides, part: merged}
        if "own_arms" in overrides and "arms" not in overrides:  # arms of your own given here are trained too
            overrides["arms"] = tuple(dict.fromkeys([*self.arms, *overrides["own_arms"]]))
        for part, flat in FLAT_PARTS.items():
            vals = overrides.pop(part, {})
            if not isinstance(vals, dict):
                raise preset_error(part, f"must be a mapping {{field: value}}, got {vals!r}")
            overrides[part] = {**getattr(self, part), **vals, **{k: overrides.pop(k) for k in flat if k in overrides}}
        preset = self.replace(**overrides)
        resolve(preset)  # the rules that tie fields together
        return preset

    def to_dict(self) -> dict:
        """JSON-ready (tuples become lists), each training task's settings by their spellings in the place of
        ``training``, and the schedule's and the execution's fields flat (``lr``, ``workers``);
        :meth:`from_dict` reads it back."""
        import json

        out = {}
        for f in dataclasses.fields(self):
            if f.name in ("schedule", "execution"):
                out.update(getattr(self, f.name))
                continue
            if f.name != "training":
                out[f.name] = getattr(self, f.name)
                continue
            for settings in self.training_settings().values():
                if settings is not None:
                    out.update((x.metadata["preset"], getattr(settings, x.name)) for x in dataclasses.fields(settings))
        return json.loads(json.dumps(out))

    @classmethod
    def from_dict(cls, data: dict) -> ComparePreset:
        """A preset from :meth:`to_dict`'s form, validated as :meth:`with_overrides` validates."""
        known = {*cls.field_defaults(), "training"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ComparePreset: unknown field(s) {unknown}")
        preset = cls(**data)
        resolve(preset)
        return preset


MIXTURE_FIELDS = ("lm_every", "icl_every", "probe_every", "recall_every")


def text_overrides(overrides: dict, data: str, tokenizer: str | None = None, heldout: str | None = None, *,
                   synthetic: bool = False) -> dict:
    """``overrides`` (preset fields) for a comparison on your own text: LM batches of ``data`` (what
    ``difftx train --data`` takes) with ``tokenizer``, scored on every token of ``heldout`` (a file)
    or of the corpus's validation split (``tasks.lm.windows = 0`` unless given). LM only (every
    step an LM batch: no needle or ICL batches, no needle probes), unless ``synthetic``: then the
    preset's mixture is kept (and may be overridden), the text in place of Shakespeare bytes."""
    overrides = flat_parts(overrides)  # schedule={"probe_every": ...} is probe_every
    if not synthetic:
        given = sorted(set(MIXTURE_FIELDS) & set(overrides))
        if given:
            raise ValueError(f"--set {', '.join(given)}: --data trains on the text alone; add --synthetic to mix in "
                             "the needle, ICL and recall tasks")
    out = {**overrides, "data": data, "tokenizer": tokenizer, "heldout": heldout}
    if not synthetic:
        out.update(lm_every=1, icl_every=0, probe_every=0, recall_every=0)
        out.setdefault("description", "a pretrained source fine-tuned as it is and converted to differential "
                                      "attention (compare --from), on your text alone: every step an LM batch"
                       if overrides.get("source") else "language modelling on your text alone (compare --data): the "
                                                       "preset's model and schedule, every step an LM batch")
    tasks = dict(overrides.get("tasks", {}))
    tasks["lm"] = {"windows": 0, **tasks.get("lm", {})}  # every held-out token once, in windows of the training length
    return {**out, "tasks": tasks}


PRESETS: dict[str, ComparePreset] = {
    # for tests: seconds per model, numbers are meaningless
    "smoke": ComparePreset(
        name="smoke", description="pipeline check only (tiny models, a few steps; numbers are meaningless)",
        dim=32, n_layers=1, n_heads=1, context_len=48, n_keys=16, n_filler=32, max_needles=4, steps=12,
        batch_size=8, warmup_steps=2, lm_every=3, lm_seq_len=32, log_every=4, icl_every=4, probe_every=6,
        probe_samples=2, threads=None,
        tasks={"needle": {"samples_per_cell": 2, "grid": ((1, 1), (2, 2), (4, 2)), "depths": (0.0, 1.0),
                          "heatmap_cell": (2, 2)},
               "lm": {"windows": 4, "extrapolation_factors": (1, 2), "extrapolation_windows": 2},
               "attention": {"samples": 1, "cells": ((1, 1), (2, 2)), "depths": (0.0, 1.0)},
               "outliers": {"tokens": 256},
               "quant": {"bits": (8, 3), "cells": ((1, 1), (2, 2)), "needle_samples": 1, "lm_windows": 2,
                         "depths": (0.0, 1.0)},
               "icl": {"instances": 4, "queries": 2, "orders": 2}, "diagnostics": {"cell": (2, 2)}}),
    # the make-demo default (8 seeds, each arm's seeds one stack, two stacks side by side on 2 CPU cores; see
    # docs/compare.md "What `make demo` finds")
    "cpu": ComparePreset(
        name="cpu", description="~0.18M-parameter models, needle task (context 64) + 1 LM batch and 1 ICL batch in 8, "
                                "about 3 min per seed on 2 CPU cores (8 seeds: 25 min)",
        dim=64, n_layers=2, n_heads=2, context_len=64, steps=4500, batch_size=16, lr=3e-3, min_lr=3e-4,
        warmup_steps=300, lm_every=8, lm_seq_len=128, icl_every=4, probe_every=250, probe_samples=10,
        threads=1, workers=2,
        tasks={"needle": {"samples_per_cell": 50, "heatmap_lengths": (48, 64, 128)}, "attention": {"samples": 10},
               "lm": {"windows": 512, "extrapolation_windows": 32}, "outliers": {"tokens": 4096},
               "quant": {"needle_samples": 4}, "icl": {"instances": 40, "queries": 10, "orders": 4}}),
    # associative recall alone (MQAR, Zoology's definition): where the recall frontier of DIFF moves against the
    # baseline and against lambda_init 0.8 (docs/compare.md "Associative recall"; the grid: results log 2026-11-28)
    "recall-cpu": ComparePreset(
        name="recall-cpu", description="~0.1M-parameter models trained on multi-query associative recall alone (4, 8 "
                                       "and 16 pairs at length 64), scored on a grid past training",
        arms=("baseline", "diff", "diff_lambda_0.8"), dim=64, n_layers=2, n_heads=2, steps=2400, batch_size=32,
        lr=3e-3, min_lr=3e-4, warmup_steps=150, lm_every=0, icl_every=0, probe_every=100, probe_samples=32,
        recall_every=1, recall_vocab=256, recall_len=64, recall_pairs=(4, 8, 16), log_every=50, threads=1, workers=2,
        stack=4,
        tasks={"recall": {"samples": 128, "pairs": (4, 8, 16, 24, 32), "lengths": (64, 128, 256)}}),
    # compare --from SRC --data TEXT: a small pretrained source and its conversion fine-tuned alike (the model comes
    # from the source). Its mixture of LM and recall batches is used with --synthetic; without it, LM batches alone
    # (text_overrides). Measured with the mixture: results log 2026-11-28, docs/compare.md (then at lr 1e-3, 100
    # warm-up steps). Its schedule is the finetune training preset's (lr 2e-4 to 2e-5, 20 warm-up steps), as
    # `difftx train --init-from` fine-tunes: a pretraining rate moves the trained weights (and λ) far at once.
    "from-cpu": ComparePreset(
        name="from-cpu", description="a pretrained source fine-tuned as it is and converted to differential "
                                     "attention: 1,200 steps of batch 16, LM batches of your text and recall batches "
                                     "(4 and 8 pairs at length 64, 64 ids of the source's vocabulary) in turn",
        steps=1200, batch_size=16, lr=2e-4, min_lr=2e-5, warmup_steps=20, lm_every=2, icl_every=0, recall_every=1,
        recall_vocab=64, recall_len=64, recall_pairs=(4, 8), lm_seq_len=128, probe_every=100, probe_samples=32,
        log_every=25, threads=1, workers=2, curve_points=6,
        tasks={"recall": {"samples": 64, "pairs": (4, 8, 12, 16), "lengths": (64, 128)},
               "lm": {"extrapolation_factors": (1,)}, "outliers": {"tokens": 4096},
               "quant": {"lm_windows": 16}}),
    # GPU presets: written for users with hardware, NOT run on this project's machines
    "gpu-small": ComparePreset(
        name="gpu-small", description="~100M parameters (untested here: no GPU on the development machine)",
        dim=768, n_layers=12, n_heads=6, context_len=1024, n_keys=512, n_filler=8192, steps=5000, batch_size=32,
        lr=6e-4, min_lr=6e-5, warmup_steps=300, lm_every=2, lm_seq_len=1024, icl_every=3, probe_every=250,
        probe_samples=20, device="auto",
        tasks={"needle": {"samples_per_cell": 50, "heatmap_lengths": (256, 512, 1024)}, "attention": {"samples": 20},
               "lm": {"windows": 512, "extrapolation_windows": 64}, "outliers": {"tokens": 65536},
               "quant": {"needle_samples": 20, "lm_windows": 64}}),
}


def lr_overrides(base: "ComparePreset", lr: float) -> dict:
    """The overrides that set ``lr`` and bring ``min_lr`` along in ``base``'s ratio, so that the schedule
    keeps its shape (a sweep's or a tuning grid's value of ``lr``)."""
    return {"lr": lr, "min_lr": lr * base.min_lr / base.lr}


def get_preset(name: str, **overrides) -> ComparePreset:
    """A named preset with field overrides (validated)."""
    if name not in PRESETS:
        raise ValueError(f"unknown compare preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].with_overrides(**overrides)
