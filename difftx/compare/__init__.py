"""``difftx compare``: DIFF against its parameter-matched baseline, paired seeds, the paper's
evaluations, a report (see ``docs/compare.md``)."""

from .presets import PRESETS, ComparePreset, get_preset
from .run import run_compare

__all__ = ["PRESETS", "ComparePreset", "get_preset", "run_compare"]
