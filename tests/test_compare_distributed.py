"""``torchrun --nproc_per_node 2 -m difftx compare`` (2 CPU processes, gloo, DDP) against the
single-process comparison with the same settings.

Each rank trains on its half of every global batch (the stream is rank-sliced, the masked loss
is normalised by the global batch's loss positions), so the per-step losses must match the
single-process run up to the order in which DDP sums gradients: **rtol 1e-4** on every logged
loss and gradient norm (measured: ~1e-7). A rank training alone on half the batch, or on other
rows, would give other losses. The evaluations, run by rank 0 on weights equal up to that
rounding, must agree: **rtol 1e-3, atol 1e-6** on every compared metric.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_compare import FAST, as_sets

LOSS_RTOL = 1e-4
METRIC_RTOL, METRIC_ATOL = 1e-3, 1e-6


def _compare_cmd(out: Path) -> list[str]:
    return ["compare", "--preset", "smoke", "--seeds", "1", "--out", str(out), "--no-progress", *as_sets(FAST)]


def test_torchrun_compare_matches_a_single_process(tmp_path):
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    dist_out = tmp_path / "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "difftx",
           *_compare_cmd(dist_out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, check=False, cwd=str(root))
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.stdout.count("wrote ") == 1  # rank 0 alone reports

    from difftx.cli import main

    single_out = tmp_path / "single"
    assert main([*_compare_cmd(single_out), "--workers", "1"]) == 0

    got, want = (json.loads((d / "results.json").read_text()) for d in (dist_out, single_out))
    assert got["execution"] == {"world_size": 2, "device": "cpu", "backend": "gloo"}
    assert want["execution"]["world_size"] == 1
    for arm in ("diff", "baseline"):
        g, w = got["runs"]["0"][arm]["train"], want["runs"]["0"][arm]["train"]
        assert g["world_size"] == 2 and w["world_size"] == 1
        assert [h["step"] for h in g["history"]] == [h["step"] for h in w["history"]] == [3, 6]
        for hg, hw in zip(g["history"], w["history"]):
            for key in hw:
                if key.endswith("_loss") or key == "grad_norm":
                    assert hg[key] == pytest.approx(hw[key], rel=LOSS_RTOL), (arm, hw["step"], key)
        assert [p["step"] for p in g["probes"]] == [p["step"] for p in w["probes"]]
    got, want = (x["comparisons"]["diff vs baseline"]["metrics"] for x in (got, want))
    assert set(got) == set(want)
    timed = {"train_tokens_per_s", "loss_at_equal_time"}  # measured wall-clock: differs from run to run
    for key, c in want.items():
        if key in timed:
            continue
        for arm in ("diff", "baseline"):
            assert got[key]["values"][arm] == pytest.approx(c["values"][arm], rel=METRIC_RTOL, abs=METRIC_ATOL), \
                (key, arm)
    # every model was trained (not only rank 0's share) and its checkpoints cleaned up
    for arm in ("diff", "baseline"):
        assert (dist_out / "seed0" / arm / "model" / "model.safetensors").is_file()
        assert not (dist_out / "seed0" / arm / "train" / "checkpoints").exists()
