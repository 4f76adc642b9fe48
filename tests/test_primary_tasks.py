"""Every task section of a report that compares two arms compares the preset's primary pair, whichever arms it
names: one tiny smoke comparison (recall batches added, every arm trained once), reported with the primary pair
("diff_lambda_0.8", "baseline"), then again, from the same models, with ("gated", "baseline"); no DIFF arm."""

import re

import pytest

from difftx.compare import run_compare
from difftx.tasks import BUILTIN, TASKS

ARMS = ("baseline", "diff_lambda_0.8", "gated")  # no "diff": a preset's arms need only hold its primary pair
SMALL = dict(progress=False, arms=ARMS, steps=4, warmup_steps=1, probe_every=2, recall_every=5, recall_vocab=64,
             recall_len=32, recall_pairs=(2, 4),
             tasks={"recall": {"samples": 2, "pairs": (2, 4), "lengths": (32,)},
                    "needle": {"samples_per_cell": 1, "grid": ((1, 1), (2, 2)), "depths": (0.0,),
                               "heatmap_cell": (2, 2)},
                    "attention": {"samples": 1, "cells": ((1, 1),), "depths": (0.0,)},
                    "quant": {"bits": (3,), "cells": ((1, 1),), "needle_samples": 1, "lm_windows": 1,
                              "depths": (0.0,)},
                    "lm": {"windows": 2, "extrapolation_factors": (1, 2), "extrapolation_windows": 1},
                    "icl": {"instances": 2, "queries": 2, "orders": 2}})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    out = tmp_path_factory.mktemp("primary") / "c"
    first = run_compare("smoke", 2, out, primary=("diff_lambda_0.8", "baseline"), **SMALL)
    return out, first


def sections(report: str) -> dict[str, str]:
    """``{title: text}`` of the report's ``## `` sections."""
    parts = re.split(r"^## ", report, flags=re.M)[1:]
    return {p.split("\n", 1)[0]: p for p in parts}


def section_of(found: dict[str, str], task: str) -> str:
    title = TASKS[task].title
    hits = [text for head, text in found.items() if head.startswith(title)]
    assert len(hits) == 1, f"no section {title!r} in {list(found)}"
    return hits[0]


def rows_of(text: str) -> list[str]:
    """The first cell of every table row of a section."""
    return [line.split("|")[1].strip() for line in text.splitlines() if line.startswith("| ")]


def check_pair(out, first: str, second: str) -> None:
    report = (out / "report.md").read_text()
    found = sections(report)
    for task in BUILTIN:
        text = section_of(found, task)
        assert "Not run" not in text and "Not measured" not in text, (task, text[:300])
        assert first in text and second in text, (task, first, second, text[:600])
        assert not any(r.split(",")[0] == "DIFF" or r == "diff" for r in rows_of(text)), (task, rows_of(text))
    for task in ("lm", "outliers", "quant", "icl"):
        assert f"| {first} - {second}: " in section_of(found, task), task
    assert f"{first} - {second} (paired)" in section_of(found, "needle")
    assert f"{first} lambda per layer (final)" in section_of(found, "diagnostics")
    assert f"{second} head redundancy per layer" in section_of(found, "diagnostics")
    assert f"paired difference from the {second}" in section_of(found, "recall")
    assert f"| {first} - {second} |" in section_of(found, "recall") or f" {first} - {second} |" in \
        section_of(found, "recall")
    plots = re.findall(r"\]\((plots/[^)]+\.png)\)", report)
    assert plots and all((out / p).is_file() for p in plots)


def test_a_primary_pair_of_two_diff_arms_names_its_arms_in_every_task_section(folder):
    out, res = folder
    assert res.primary.arms == ("diff_lambda_0.8", "baseline")
    check_pair(out, "diff_lambda_0.8", "baseline")
    report = (out / "report.md").read_text()
    assert "diff_lambda_0.8 rows are `A1 - lambda*A2`" in report
    assert "diff_lambda_0.8 logits include both softmax maps" in report
    assert "(plots/lambda_per_layer.png)" in report  # its lambda, per layer


def test_a_primary_pair_with_a_one_map_arm_names_its_arms_and_says_nothing_of_lambda(folder):
    out, _ = folder
    res = run_compare("smoke", 2, out, primary=("gated", "baseline"), **SMALL)  # the same models, reported again
    assert res.primary.arms == ("gated", "baseline")
    check_pair(out, "gated", "baseline")
    report = (out / "report.md").read_text()
    assert "A1 - lambda*A2" not in report and "both softmax maps" not in report  # gated has one softmax map
    assert "(plots/lambda_per_layer.png)" not in report  # no lambda to draw
    diagnostics = section_of(sections(report), "diagnostics")
    assert "| 0 | - | - |" in diagnostics  # the gated arm has no lambda


def test_arms_named_on_the_command_line_put_the_primary_pair_first():
    from difftx.cli.compare import parse_arms

    assert parse_arms("gated") == ("baseline", "diff", "gated")  # the presets' pair: DIFF and its baseline
    assert parse_arms("gated,diff", ("gated", "baseline")) == ("baseline", "gated", "diff")
    # a set's name among names stands for its arms ("unknown arm(s) ['default']" before)
    assert parse_arms("default,gated") == ("baseline", "diff", "gated")
    assert parse_arms("gated,alternatives") == ("baseline", "diff", "gated", "diff_v2", "gated_matched",
                                                "gated_headwise", "no_subtraction")
    assert parse_arms("recall-controls", ("diff_lambda_0.8", "temperature"))[:2] == ("temperature", "diff_lambda_0.8")
