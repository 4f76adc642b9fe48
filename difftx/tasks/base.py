"""The interface every evaluation task implements, and its settings and metrics.

A task is one of the paper's evaluations (or a training-side record) in one module of
:mod:`difftx.tasks`. It owns:

- ``Settings``: a frozen dataclass of its sizes with defaults, validated on construction;
  ``difftx eval NAME`` gets one flag per field (``--samples-per-cell``) and ``difftx compare``
  one ``--set tasks.NAME.FIELD=VALUE`` override, both generated from the fields;
- ``run(subject, settings)``: the evaluation on one model, returning a JSON-ready dict with
  per-example ``records`` (so paired statistics can resample examples) besides aggregates;
- ``metrics(settings)``: the named scalars read off a result, with direction, unit and
  whether they are primary;
- ``report(ctx)`` and ``plots(ctx, folder)``: its section of ``report.md`` and its PNGs;
- ``print(result)``: what ``difftx eval NAME`` prints.

Runners (compare, ``difftx eval``, the report) iterate :data:`difftx.tasks.TASKS` and never
reach into a task's result themselves.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Optional


@dataclass(frozen=True)
class Metric:
    """A scalar of one model's task result. ``get`` returns ``None`` when the result does not
    have it (not measured, or not meaningful: e.g. ICL best - worst of a model at chance)."""

    key: str
    label: str
    lower_is_better: bool
    get: Callable[[dict], Optional[float]]
    unit: str = ""
    primary: bool = False
    digits: int = 3
    # per-example values whose mean is the metric (the same examples, in the same order, for every
    # model): the interval then includes evaluation-set noise (difftx.eval.stats)
    per_example: Optional[Callable[[dict], list[float]]] = None
    # for each example, the key of the metric that gates it: examples of a gated-out metric (a cell
    # no model learned) are left out of this one
    groups: Optional[Callable[[dict], list[str]]] = None
    # with groups: keep an example where "any" model learned its gating metric, or only where "all" did
    # (attention to the answer is read where both models retrieve)
    gate: str = "any"
    # a metric without per-example values compared only where this metric (a needle cell) was learned
    gated_by: Optional[str] = None
    # the value a model scores without having learned the task (e.g. 1/N for copying a random needle of
    # N): compared only where some model's interval lies above it
    floor: Optional[float] = None
    # ``get(result, peer)``: the value depends on the other model of the seed as well (e.g. a loss read
    # at the smaller of the two models' training budgets)
    peer: bool = False
    # a model "learned" what the metric measures when ``learned(result)`` is true: compared only where
    # some model did (for a metric with no floor, e.g. steps until learned with censored runs)
    learned: Optional[Callable[[dict], bool]] = None
    # a measurement of the machine while the model trained (throughput, loss at equal wall-clock):
    # compared only between models trained by the same invocation (result key "invocation")
    same_run: bool = False
    # the range every value lies in (accuracies and rates: (0, 1)); intervals stay inside it, and one
    # arm's interval holds for any distribution of its seeds (difftx.eval.stats.mean_interval)
    bounds: Optional[tuple[float, float]] = None
    # a metric whose range depends on the run (steps until learned, censored at the last probe):
    # ``bounds_of(result)`` gives each model's ``(low, high)``; the comparison uses their hull
    bounds_of: Optional[Callable[[dict], Optional[tuple[float, float]]]] = None

    def describe(self) -> dict:
        return {"key": self.key, "label": self.label, "lower_is_better": self.lower_is_better, "unit": self.unit,
                "primary": self.primary, "floor": self.floor,
                "digits": self.digits, "peer": self.peer,
                "bounds": None if self.bounds is None else list(self.bounds)}


def setting(default: Any, help: str, parse: Optional[Callable[[str], Any]] = None) -> Any:
    """A settings field with its ``--help`` text (and a parser for its command-line form)."""
    meta = {"help": help, "parse": parse}
    if isinstance(default, (list, dict)):
        raise TypeError("settings defaults must be immutable (use tuples)")
    return dataclasses.field(default=default, metadata=meta)


def positive(obj: Any, *names: str, allow_zero: bool = False) -> None:
    """Raise ``ValueError`` naming ``Class.field`` unless each field is a positive integer."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if allow_zero else 1):
            rule = "a non-negative" if allow_zero else "a positive"
            raise ValueError(f"{type(obj).__qualname__}.{name}: must be {rule} integer, got {v!r}")


def parse_cell(text: str) -> tuple[int, int]:
    """``"4/2"`` -> ``(4, 2)``: N needles, R queried keys."""
    try:
        n, r = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ValueError(f"expected a needle cell N/R such as 4/2, got {text!r}") from None
    if not 1 <= r <= n:
        raise ValueError(f"needle cell {text!r}: need 1 <= R <= N")
    return n, r


def parse_cells(text: str) -> tuple[tuple[int, int], ...]:
    """``"1/1,2/2"`` -> ``((1, 1), (2, 2))``."""
    return tuple(parse_cell(c) for c in str(text).split(",") if c.strip())


def parse_numbers(text: str) -> tuple:
    """``"0,0.5,1"`` -> ``(0, 0.5, 1)`` (ints stay ints); an empty string is ``()``."""
    out = []
    for x in str(text).split(","):
        x = x.strip()
        if not x:
            continue
        try:
            out.append(int(x))
        except ValueError:
            try:
                out.append(float(x))
            except ValueError:
                raise ValueError(f"expected comma-separated numbers, got {text!r}") from None
    return tuple(out)


def parse_setting(field: dataclasses.Field, text: str) -> Any:
    """A settings field's value from its text form (command line or ``--set``)."""
    parse = field.metadata.get("parse")
    if parse is not None:
        return parse(text)
    d = field.default
    if text in ("none", "None", "null") and d is None:
        return None
    if isinstance(d, bool):
        if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"expected true or false, got {text!r}")
        return text.lower() in ("true", "1", "yes")
    if isinstance(d, int) or (d is None and "int" in str(field.type)):
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if isinstance(d, float):
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    if isinstance(d, tuple):
        return parse_numbers(text)
    return text


def format_setting(field: dataclasses.Field, value: Any) -> str:
    """The text form of a settings value, as :func:`parse_setting` reads it back
    (``((1, 1), (2, 2))`` -> ``"1/1,2/2"``, ``(0.0, 1.0)`` -> ``"0.0,1.0"``, a cell ``(4, 2)`` -> ``"4/2"``)."""
    if field.metadata.get("parse") is parse_cell and isinstance(value, tuple):
        return "/".join(map(str, value))
    if isinstance(value, tuple):
        return ",".join("/".join(map(str, x)) if isinstance(x, tuple) else str(x) for x in value)
    return str(value)


def settings_from_dict(cls: type, data: dict, where: str) -> Any:
    """``cls(**data)`` with unknown fields named; lists (from JSON) become tuples."""
    known = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown setting(s) {unknown}; known: {sorted(known)}")
    values = {}
    for k, v in data.items():
        try:
            if isinstance(v, str):
                values[k] = parse_setting(known[k], v)
            elif isinstance(known[k].default, tuple) and isinstance(v, (int, float)) and not isinstance(v, bool):
                values[k] = (v,)  # one value of a list setting: --set tasks.quant.bits=8
            else:
                values[k] = _tupled(v)
        except ValueError as e:
            raise ValueError(f"{where}.{k}: {e}") from None
    return cls(**values)


def _tupled(v: Any) -> Any:
    return tuple(_tupled(x) for x in v) if isinstance(v, list) else v


def settings_to_dict(settings: Any) -> dict:
    """JSON-ready settings (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(settings)))


class Task:
    """Base class of an evaluation task (see the module docstring). Subclasses set ``name``,
    ``title``, ``help`` and ``Settings`` and implement :meth:`run`."""

    name: ClassVar[str]
    title: ClassVar[str]  # report section heading
    help: ClassVar[str]  # one line for `difftx eval --help`
    description: ClassVar[str] = ""  # longer text for `difftx eval NAME --help`
    Settings: ClassVar[type]

    def applies(self, subject: Any, settings: Any) -> Optional[str]:
        """``None`` when the task can run on ``subject``, else the reason it is skipped."""
        return None

    def run(self, subject: Any, settings: Any, *, progress: bool = False) -> dict:
        raise NotImplementedError

    def metrics(self, settings: Any) -> list[Metric]:
        return []

    def report(self, ctx: Any) -> str:
        return ""

    def plots(self, ctx: Any, folder: Path) -> dict[str, Path]:
        return {}

    def print(self, result: dict) -> None:
        """What ``difftx eval NAME`` prints (default: the metrics)."""
        print(json.dumps(result.get("summary", {}), indent=1))

