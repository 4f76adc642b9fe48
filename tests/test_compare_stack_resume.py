"""A stack of seeds interrupted while it writes its checkpoints (one model after the other) re-runs to
an uninterrupted run's numbers (issue 31 item 2). Before, a cut there left the models at different
steps; the re-run trained the stragglers apart from the others and their numbers differed.

The interrupt comes from a hook in ``save_checkpoint`` (the second model's write of a step): a
Ctrl-C (SIGINT to this process), which the stack holds until every model wrote the step, or an
exception standing for a kill (nothing after it runs in the trainer)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from difftx.cli import main
from difftx.training import checkpointing
from test_compare import FAST, as_sets

TIMED = {"train_tokens_per_s", "loss_at_equal_time"}  # wall-clock measurements: differ from run to run


def primary(res: dict) -> dict:
    """The DIFF-vs-baseline comparisons of a ``results.json`` object."""
    return res["comparisons"]["diff vs baseline"]["metrics"]


def _cmd(out: Path) -> list[str]:
    # 3 seeds, one worker: each arm's seeds train as one stack of 3; checkpoints at steps 3 and 6
    return ["compare", "--preset", "smoke", "--seeds", "3", "--out", str(out), "--workers", "1", "--no-progress",
            *as_sets(FAST)]


class Killed(BaseException):
    """Stands for SIGKILL: raised from inside the checkpoint writes, caught by nothing in difftx."""


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("clean") / "run"
    assert main(_cmd(out)) == 0
    return json.loads((out / "results.json").read_text())


def _hook(monkeypatch, step: int, action) -> list:
    """Call ``action()`` once, right after the first model of the first stack wrote checkpoint ``step``."""
    original, fired = checkpointing.save_checkpoint, []

    def save(run_dir, at, **kw):
        path = original(run_dir, at, **kw)
        if at == step and not fired:
            fired.append(str(run_dir))
            action()
        return path

    monkeypatch.setattr(checkpointing, "save_checkpoint", save)
    return fired


def _same(got: dict, want: dict) -> None:
    for s in want["runs"]:
        for arm in want["runs"][s]:
            g, w = got["runs"][s][arm]["train"], want["runs"][s][arm]["train"]
            assert g["stacked"] == w["stacked"] == 3
            strip = lambda h: [{k: v for k, v in r.items() if k != "time_s"} for r in h]  # noqa: E731
            assert strip(g["history"]) == strip(w["history"]), (s, arm)  # losses and lambda, exactly
    for key, c in primary(want).items():
        if key not in TIMED:
            assert primary(got)[key]["values"] == c["values"], key


@pytest.fixture
def ctrl_c_raises():
    """SIGINT handled as Python's default (KeyboardInterrupt) for the test: a shell starts a background job with
    SIGINT ignored, and an ignored Ctrl-C would interrupt nothing."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, old)


def test_ctrl_c_inside_the_checkpoint_writes_is_held_until_all_are_written(tmp_path, uninterrupted, monkeypatch,
                                                                           ctrl_c_raises):
    out = tmp_path / "run"
    fired = _hook(monkeypatch, 3, lambda: os.kill(os.getpid(), signal.SIGINT))
    assert main(_cmd(out)) == 130 and fired
    steps = {str(p.relative_to(out)) for p in out.glob("seed*/baseline/train/checkpoints/step_*")}
    assert steps == {f"seed{s}/baseline/train/checkpoints/step_00000003" for s in range(3)}, steps  # all of them
    monkeypatch.undo()
    assert main(_cmd(out)) == 0
    _same(json.loads((out / "results.json").read_text()), uninterrupted)


@pytest.mark.parametrize("step", [3, 6])  # the stack's first checkpoint, and a later one
def test_a_kill_inside_the_checkpoint_writes_resumes_exactly(tmp_path, uninterrupted, monkeypatch, step):
    out = tmp_path / "run"

    def kill():
        raise Killed

    fired = _hook(monkeypatch, step, kill)
    with pytest.raises(Killed):
        main(_cmd(out))
    assert fired
    latest = [checkpointing.latest_checkpoint(out / f"seed{s}" / "baseline" / "train") for s in range(3)]
    assert latest[0].name == f"step_{step:08d}" and {p and p.name for p in latest[1:]} != {latest[0].name}
    monkeypatch.undo()
    assert main(_cmd(out)) == 0
    _same(json.loads((out / "results.json").read_text()), uninterrupted)
