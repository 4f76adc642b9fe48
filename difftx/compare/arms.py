"""An arm of a comparison as one value: :class:`Arm` (name, model config, label, description and, for ``--from``,
its source), built from the arm table (:data:`difftx.arm_table.ARMS`), a registered attention kind or a source; and the
pairs a comparison compares (:func:`pairs`), the primary one first."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace
from typing import Optional

from ..arm_table import ARM_LABELS as LABELS  # what the report calls the built-in primary arms
from ..arm_table import ARMS, PRIMARY  # PRIMARY: the primary pair unless a preset names another
from ..config import ModelConfig


@dataclass(frozen=True)
class Arm:
    """One arm, the same value from the plan to ``results.json``: ``name`` (its folder ``seed{S}/{name}`` and key in
    ``results.json``), ``config`` (its ModelConfig's fields, as written: :meth:`ModelConfig.to_dict`), ``parameters``
    (its models' count, once trained; None before), ``label`` (what the report calls it), ``description`` (what it
    is: the arm table's line, or a registered kind's docstring) and, for ``--from``, ``source`` (the pretrained model
    it starts from, converted or not)."""

    name: str
    config: dict
    parameters: Optional[int]
    label: str
    description: str = ""
    source: Optional[str] = None

    @classmethod
    def of(cls, name: str, config: ModelConfig) -> "Arm":
        """The arm ``name`` of the arm table, or a registered kind of that name."""
        if name in ARMS:
            return cls(name, config.to_dict(), None, LABELS.get(name, name), ARMS[name])
        return cls(name, config.to_dict(), None, name, kind_description(name))

    @classmethod
    def from_source(cls, name: str, config: ModelConfig, source: str, method: str, converted: bool) -> "Arm":
        """An arm of ``compare --from``: the source as it is or (``converted``) its conversion."""
        what = (f"the source converted by `difftx convert --method {method}` ({config.attention} attention)"
                if converted else f"the source as it is ({config.attention} attention)")
        return cls(name, config.to_dict(), None, name, what, source)

    def counted(self, parameters: int) -> "Arm":
        """This arm with its models' parameter count."""
        return replace(self, parameters=parameters)


def kind_description(name: str) -> str:
    """What a registered attention kind is: the first paragraph of its class's docstring, on one line ("" when the
    kind is not registered in this process or has no docstring)."""
    from ..attention.registry import ATTENTIONS

    kind = ATTENTIONS.get(name)
    doc = inspect.getdoc(kind) if kind is not None and kind.__doc__ else None
    return " ".join(doc.split("\n\n")[0].split()) if doc else ""


def pairs(arms, primary: tuple = PRIMARY) -> list[tuple[str, str]]:
    """The comparisons of a set of arms: the primary pair first (DIFF vs the baseline), then every other arm vs the
    primary's second arm, then its first arm vs every other arm (``(a, b)``: the difference is ``a - b``)."""
    a, b = primary
    others = [x for x in arms if x not in primary]
    return [primary] + [(x, b) for x in others] + [(a, x) for x in others]
