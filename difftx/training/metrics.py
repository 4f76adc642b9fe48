"""Run metrics: a JSONL file (always) and TensorBoard (when installed), plus learned lambda per layer."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from ..attention.modules import AttentionKind
from ..io import atomic_write, check_record, own_folder
from .distributed import full_tensor

METRICS_NAME = "metrics.jsonl"  # a run folder's log: one JSON record per line


@torch.no_grad()
def lambda_per_layer(model: nn.Module) -> Optional[list[float]]:
    """The learned lambda of each attention layer (its kind's ``lambda_reading``; ``None`` for models whose
    kind has none).

    Uses the gathered lambda vectors, so it also works on FSDP2-sharded models, where it is a
    collective: every rank must call it.
    """
    values = [m.lambda_reading(full_tensor) for m in model.modules() if isinstance(m, AttentionKind)]
    values = [v for v in values if v is not None]
    return values or None


def _clean(value: Any) -> Any:
    """JSON-safe: non-finite floats become strings ("nan", "inf")."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


TENSORBOARD_MISSING = ("difftx train: note: TensorBoard logging skipped (tensorboard is not installed: pip install "
                       "tensorboard, or difftx[train]); metrics.jsonl has every record")


class MetricsLogger:
    """Appends one JSON object per record to ``path``; mirrors scalars to TensorBoard when it is
    installed (``say_if_missing``: a note on stderr when it is not).

    ``resume_step``: records after this step (written by a run that died after its last
    checkpoint) are dropped first, so the file shows one clean trajectory.
    """

    def __init__(self, path: Path, tensorboard_dir: Optional[Path] = None, enabled: bool = True,
                 resume_step: Optional[int] = None, say_if_missing: bool = False):
        self.path, self.enabled, self._tb = Path(path), enabled, None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            kept = []
            try:
                text = self.path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{self.path}: not a metrics log (not UTF-8 text: {e}); move it away to "
                                 f"resume") from None
            for line in text.splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash
                if isinstance(rec, dict) and rec.get("step", 0) <= resume_step:
                    kept.append(line)
            atomic_write(self.path, lambda p: Path(p).write_text("".join(k + "\n" for k in kept)))
        elif resume_step is None and self.path.exists():
            self.path.unlink()
        if self.path.is_symlink():  # a dangling link (a live one was replaced or removed above): never followed
            self.path.unlink()
        self._file = open(self.path, "a", encoding="utf-8")
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter  # optional (difftx[train]), asked for by a flag
            except ImportError:  # tensorboard not installed: JSONL only (said when asked for; see difftx train)
                if say_if_missing:
                        print(TENSORBOARD_MISSING, file=sys.stderr)
            else:
                self._tb = SummaryWriter(str(own_folder(tensorboard_dir)))

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        try:
            self._file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
            self._file.flush()
        except OSError as e:  # a full disk, a file-size limit: name the file (the write's own error does not)
            raise OSError(e.errno, e.strerror or str(e), str(self.path)) from e
        if self._tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if k == "step":
                    continue
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self._tb.add_scalar(k, v, step)
                elif isinstance(v, list) and k == "lambda":
                    for i, x in enumerate(v):
                        self._tb.add_scalar(f"lambda/layer_{i}", x, step)

    def close(self) -> None:
        if not self.enabled:
            return
        try:
            self._file.close()
        except OSError as e:
            raise OSError(e.errno, e.strerror or str(e), str(self.path)) from e
        if self._tb is not None:
            self._tb.close()


# the fields of a metrics record that its readers (`difftx runs`, compare's train.json) rely on
RECORD_FIELDS = {"step": "int", "loss": "number?", "val_loss": "number?", "lr": "number?", "grad_norm": "number?",
                 "tokens": "int?", "tokens_per_s": "number?", "time_s": "number?", "val_tokens": "int?",
                 "lambda": "list?", "grad_norms": "list?", "probe": "dict?", "probe_s": "number?"}


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics JSONL file, each checked against :data:`RECORD_FIELDS` (a
    ``ValueError`` naming the file, the line and the field). A line that is not JSON (cut short by a
    crash, or by a run still writing) is skipped; a missing or unreadable file gives no records."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    out = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        out.append(check_record(rec, RECORD_FIELDS, f"{path} line {i}", "a metrics record"))
    return out
