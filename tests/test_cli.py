"""The `difftx` command: help, version, and the foundation's subcommands end to end."""

import json
import subprocess
import sys

import pytest

import difftx
from difftx.bench import BenchRow, format_table
from difftx.cli import SUBCOMMANDS, main


def test_help_and_version_from_a_fresh_process():
    out = subprocess.run([sys.executable, "-m", "difftx", "--help"], capture_output=True, text=True, check=True)
    for name in SUBCOMMANDS:
        assert name in out.stdout
    ver = subprocess.run([sys.executable, "-m", "difftx", "--version"], capture_output=True, text=True, check=True)
    assert ver.stdout.strip() == f"difftx {difftx.__version__}"


def test_every_subcommand_has_help(capsys):
    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as e:
            main([name, "--help"])
        assert e.value.code == 0, name
        assert "usage: difftx" in capsys.readouterr().out


def test_info_prints_config_and_matched_baseline(capsys, tmp_path):
    assert main(["info", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "baseline  attention=standard heads=4" in out
    cfg = difftx.preset("test")
    (tmp_path / "config.json").write_text(cfg.to_json())
    assert main(["info", str(tmp_path)]) == 0
    assert json.loads(capsys.readouterr().out.split("\nmodel")[0]) == cfg.to_dict()
    assert main(["info", "no-such-thing"]) == 2
    assert "neither a preset" in capsys.readouterr().err


def test_info_shows_training_and_compare_presets(capsys):
    """`difftx info finetune|recall-cpu|from-cpu`: the preset's settings and the model it trains, before it runs."""
    assert main(["info", "finetune"]) == 0
    out = capsys.readouterr().out
    assert "training preset 'finetune'" in out and '"lr": 0.0002' in out and "the checkpoint's (--init-from)" in out
    assert "baseline  attention=standard" in out
    assert main(["info", "recall-cpu"]) == 0
    out = capsys.readouterr().out
    assert "compare preset 'recall-cpu'" in out and "its DIFF arm" in out and "model     attention=diff" in out
    assert main(["info", "from-cpu"]) == 0
    assert "compare preset 'from-cpu'" in capsys.readouterr().out


def test_bench_runs_and_writes_json(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert main(["bench", "--seq-lens", "16", "--dim", "32", "--heads", "2", "--repeats", "1",
                 "--backends", "eager", "chunked", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert {r["name"] for r in rows} == {"baseline/sdpa", "diff/eager", "diff/chunked"}
    assert all(r["ms"] > 0 for r in rows)
    assert "| 16 | fwd+bwd | diff/chunked |" in capsys.readouterr().out
    assert main(["bench", "--backends", "nope", "--seq-lens", "8", "--dim", "32", "--heads", "2"]) == 2


def test_bench_leaves_out_a_backend_that_fails_and_says_why(tmp_path, capsys):
    """flex has no backward on CPU: its fwd row is timed, its fwd+bwd row is skipped with the reason."""
    pytest.importorskip("torch.nn.attention.flex_attention")
    path = tmp_path / "bench.json"
    assert main(["bench", "--seq-lens", "16", "--dim", "32", "--heads", "2", "--repeats", "1",
                 "--backends", "chunked", "flex", "--json", str(path)]) == 0
    names = {(r["mode"], r["name"]) for r in json.loads(path.read_text())["rows"]}
    assert ("fwd", "diff/flex") in names and ("fwd+bwd", "diff/flex") not in names
    assert ("fwd+bwd", "diff/chunked") in names
    assert "skipped diff/flex: ValueError: the 'flex' backend has no backward pass on CPU" in capsys.readouterr().out


def test_bench_decode_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path, png = tmp_path / "decode.json", tmp_path / "decode.png"
    assert main(["bench", "--decode", "--seq-lens", "8", "24", "--dim", "32", "--heads", "2", "--layers", "1",
                 "--repeats", "6", "--backends", "eager", "--json", str(path), "--plot", str(png)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["seq_len"], r["name"]) for r in rows] == [(8, "baseline/sdpa"), (8, "diff/eager"),
                                                         (24, "baseline/sdpa"), (24, "diff/eager")]
    assert all(r["mode"] == "decode" and r["ms"] > 0 for r in rows)
    assert [r["ratio"] for r in rows if r["name"] == "baseline/sdpa"] == [1.0, 1.0]
    # round-by-round ratios: the reference's are all 1; 6 rounds give a distribution-free 95% interval
    assert all((r["paired"], r["paired_low"], r["paired_high"]) == (1.0, 1.0, 1.0)
               for r in rows if r["name"] == "baseline/sdpa")
    assert all(r["paired_low"] <= r["paired"] <= r["paired_high"] for r in rows)
    # the KV cache of T+1 tokens, 1 layer, float32: DIFF k 2Hkv=4 sub-heads of d=8, v Hkv=2 of 2d=16; the
    # baseline k and v 4 heads of 8 each: the same bytes
    for r in rows:
        assert r["mem_mib"] == pytest.approx((r["seq_len"] + 1) * (4 * 8 + 2 * 16) * 4 / 2 ** 20)
    assert png.stat().st_size > 1000
    assert "| 24 | decode | diff/eager |" in capsys.readouterr().out
    assert "| 24 | decode | baseline/sdpa | " in format_table([BenchRow(**r) for r in rows])
    assert "| 1.000 [1.000, 1.000] |" in format_table([BenchRow(**r) for r in rows])
    with pytest.raises(SystemExit) as e:  # refused by the parser: "argument --layers: must be a positive integer"
        main(["bench", "--decode", "--layers", "0", "--seq-lens", "8", "--dim", "32", "--heads", "2"])
    assert e.value.code == 2


def test_demo_smoke(capsys):
    assert main(["demo", "--steps", "3", "--no-progress", "--pairs", "2", "--seq-len", "16"]) == 0
    out = capsys.readouterr().out
    assert "| diff |" in out and "| standard |" in out and "lambda per layer" in out


def test_workers_through_set_is_the_workers_option(tmp_path, capsys, monkeypatch):
    """`--set workers=N` is `--workers N` (issue 41: it was a TypeError, 'multiple values'); both at once, or a
    bad value, is a one-line usage error before anything trains."""
    from difftx import compare as compare_pkg
    from difftx.cli import main

    seen = {}

    def fake(preset, seeds, out, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(compare_pkg, "run_compare", fake)
    with pytest.raises(SystemExit):
        main(["compare", "--preset", "smoke", "--out", str(tmp_path / "a"), "--set", "workers=2"])
    assert seen["workers"] == 2  # passed as the option, not twice
    assert main(["compare", "--preset", "smoke", "--out", str(tmp_path / "b"), "--workers", "1", "--set",
                 "workers=2"]) == 2
    assert "give the number of workers in one place" in capsys.readouterr().err
    assert main(["compare", "--preset", "smoke", "--out", str(tmp_path / "c"), "--set", "workers=0"]) == 2
    assert "must be a positive integer" in capsys.readouterr().err
    assert main(["scale", "--preset", "scale-cpu", "--out", str(tmp_path / "d"), "--workers", "1", "--set",
                 "workers=2"]) == 2
