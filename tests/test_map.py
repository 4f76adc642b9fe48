"""``difftx map``: a map spec's cells (each a compare folder) validated, listed, trained where missing, read back
and merged with recorded cells; map.md's answer, map.json, map.png; docs/compare.md's table generated from the
shipped spec and recorded cells."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from difftx.cli import main
from difftx.studies import map as cmap

ROOT = Path(__file__).resolve().parents[1]
# recall alone on the smoke preset, as small as a compare goes: 1 seed, 2 arms, 4 steps
TINY = {"steps": 4, "warmup_steps": 1, "log_every": 2, "recall_every": 1, "lm_every": 0, "icl_every": 0,
        "probe_every": 2, "probe_samples": 2, "recall_vocab": 32, "recall_len": 16, "recall_pairs": [2, 3],
        "tasks": {"recall": {"samples": 4, "attention_samples": 2}, "outliers": {"tokens": 32},
                  "diagnostics": {"samples": 1}}}
SPEC = {"title": "tiny map", "tasks": {"recall": {"preset": "smoke", "set": TINY}},
        "defaults": {"seeds": 1, "arms": ["baseline", "diff"]},
        "cells": [{"name": "a", "axes": {"init": "normal"}}, {"name": "b", "axes": {"init": "torch"}}]}


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def tiny_map(tmp_path_factory):
    """The tiny spec's map, trained (compare's plots left out: they are compare's, tested there)."""
    root = tmp_path_factory.mktemp("map")
    spec = _write(root / "spec.json", SPEC)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("difftx.compare.report.make_plots", lambda out, result, section=None: {})
        assert main(["map", "--spec", str(spec), "--out", str(root / "out"), "--workers", "1", "--no-progress"]) == 0
    return root


# -- the spec ----------------------------------------------------------------------------------------------------


def _with(**change) -> dict:
    spec = copy.deepcopy(SPEC)
    for key, value in change.items():
        if key.startswith("cell0_"):
            spec["cells"][0][key.removeprefix("cell0_")] = value
        else:
            spec[key] = value
    return spec


@pytest.mark.parametrize("change, message", [
    ({"cell0_axes": {"init": "normal", "colour": 1}}, "cell 'a': unknown axis 'colour'; known: init, depth, width, task"),
    ({"cell0_name": "b"}, "cell 'b': duplicate cell"),
    ({"cell0_axes": {"init": "xavier"}}, "cell 'a': axis init: 'xavier' is not one of normal, torch"),
    ({"cell0_axes": {"depth": 0}}, "cell 'a': axis depth: must be a positive integer, got 0"),
    ({"cell0_axes": {"width": "wide"}}, "cell 'a': axis width: must be a positive integer, got 'wide'"),
    ({"cell0_axes": {"task": "lm"}}, "cell 'a': axis task: 'lm' is not one of the spec's tasks (recall)"),
    ({"cell0_axes": {"lambda_init": 0.8}}, "cell 'a': axis 'lambda_init' is each arm's"),
    ({"cell0_arms": ["diff_lambda_7"]}, "cell 'a': arms: unknown arm(s) ['diff_lambda_7']"),
    ({"cell0_set": {"n_layers": 4}}, "cell 'a': set n_layers: give it as the axis 'depth'"),
    ({"cell0_set": {"steps": -3}}, "cell 'a': "),
    ({"cell0_name": "../x"}, "cells[0]: name must be a folder name"),
    ({"cell0_seeds": 0}, "cell 'a': seeds: must be a positive integer, got 0"),
    ({"colour": 1}, "unknown key 'colour'; known: title, recorded, tasks, defaults, cells"),
    ({"tasks": {"recall": {"preset": "nope"}}}, "tasks.recall.preset: 'nope' is not a compare preset"),
    ({"cells": []}, "cells: give a list of cells"),
])
def test_a_bad_spec_is_named_in_one_line(change, message):
    with pytest.raises(cmap.SpecError) as e:
        cmap.parse_spec(_with(**change), "spec.json")
    assert str(e.value).startswith("spec.json: ") and message in str(e.value) and "\n" not in str(e.value)


def test_a_bad_spec_on_the_command_line_is_a_usage_error(tmp_path, capsys):
    spec = _write(tmp_path / "spec.json", _with(cell0_name="b"))
    assert main(["map", "--spec", str(spec), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("difftx map: error: ") and "duplicate cell" in err and "\n" not in err


def test_axes_give_the_compare_arguments():
    spec = cmap.load_spec()  # the shipped spec: the lead's folders under exactly these names and arguments
    cells = {c.name: c for c in spec.cells}
    assert cells["torch-depth4"].command("runs/map") == ("difftx compare --preset recall-cpu --seeds 7 --set init=torch "
                                                         "--set n_layers=4 --out runs/map/torch-depth4")
    assert cells["torch-width128"].command("runs/map") == (
        "difftx compare --preset recall-cpu --seeds 7 --set init=torch --set dim=128 --set n_heads=4 "
        "--out runs/map/torch-width128")
    assert "--set n_layers=8" in cells["torch-depth8"].command("runs/map")
    assert cells["torch-depth4"].axes == {"init": "torch", "depth": 4, "width": 64, "task": "recall"}
    lm = cells["lm-torch-xl"]
    assert lm.task == "lm" and lm.axes == {"init": "torch", "depth": 4, "width": 72, "task": "lm"}
    p = lm.compare_preset()
    assert (p.dim, p.n_layers, p.n_heads, p.lm_every, p.steps, p.init) == (72, 4, 3, 1, 2000, "torch")
    assert lm.arms == ("baseline", "diff", "diff_lambda_0.8", "diff_out_0.2")
    assert len(cells["normal-regime"].arms) == 14


# -- listing, training, reading ------------------------------------------------------------------------------------


def test_dry_run_lists_each_cell_its_status_and_command(tmp_path, capsys):
    spec = _write(tmp_path / "spec.json", SPEC)
    (tmp_path / "out" / "b").mkdir(parents=True)
    (tmp_path / "out" / "b" / "compare.json").write_text("{}")  # a compare folder begun
    assert main(["map", "--spec", str(spec), "--out", str(tmp_path / "out"), "--dry-run", "--seeds", "2"]) == 0
    every = capsys.readouterr().out.splitlines()
    notes = [x for x in every if x.startswith("  note: ")]
    assert notes == [f"  note: {c}: 2 seeds cannot give a verdict when the 1 comparison of the 2 arms is made: 6 seeds "
                     "needed (seeds added after the folder is first read are a later look, which needs more)"
                     for c in "ab"]
    lines = [x for x in every if x not in notes]
    assert lines[0] == "a: missing (no compare folder): to train"
    assert lines[1].startswith("  difftx compare --preset smoke --seeds 2 --set steps=4 ") and \
        "--set recall_pairs=[2,3] --set tasks.recall.samples=4 " in lines[1] and lines[1].endswith(f"--out {tmp_path}/out/a")
    assert lines[2] == "b: partial (0 of 4 models trained, no results.json yet): to train (resumes)"
    assert "--set init=torch" in lines[3]
    assert lines[-1] == "2 cells: 0 present, 1 partial, 1 missing (0 of them recorded); 2 to train"
    assert not (tmp_path / "out" / "a").exists()  # nothing written
    table = cmap.map_table(cmap.build_map(cmap.parse_spec(SPEC, "s"), tmp_path / "out"))
    assert "| `b` (torch, 1 x 32, recall, 4 steps of 8) | baseline, diff | | | | | | | unfinished | |" in table
    assert "- `b`: unfinished (0 of 2 models trained, no results.json yet): `difftx compare " in table
    assert "- `a`: not measured: `difftx compare " in table


def test_the_map_reads_each_cell_as_its_compare_compared_it(tiny_map):
    out = tiny_map / "out"
    m = json.loads((out / "map.json").read_text())
    assert m["schema"] == "difftx.map" and m["schema_version"] == 1 and [c["name"] for c in m["cells"]] == ["a", "b"]
    for cell, init in zip(m["cells"], ("normal", "torch")):
        res = json.loads((out / cell["name"] / "results.json").read_text())
        c = res["comparisons"]["diff vs baseline"]["metrics"]["recall_frontier"]
        got = cell["vs_baseline"]["diff"]
        assert got["paired"]["mean"] == c["paired"]["mean"] and got["verdict"] == c["verdict"]  # the compare's own
        assert cell["arms"]["diff"]["metric"]["values"] == c["values"]["diff"]
        assert cell["source"] == "folder" and cell["status"] == "present" and cell["axes"]["init"] == init
        assert cell["provenance"]["folder"] == str(out / cell["name"]) and cell["provenance"]["created"]
        for arm in ("baseline", "diff"):
            a = cell["arms"][arm]
            ratio = res["runs"]["0"][arm]["train"]["probes"][0]["attention_output_ratio"]
            assert a["ratio_at_init"] == pytest.approx(ratio, abs=1e-4) and a["learned_of"] == 1
            assert a["head_norm"] == (arm == "diff") and a["output_scale"] == [0.8 if arm == "diff" else 1.0]
        assert cell["arms"]["diff"]["lambda_init"] == [0.2] and cell["arms"]["baseline"]["lambda_init"] is None
    md = (out / "map.md").read_text()
    assert md.startswith("# tiny map\n\n**Recall (the frontier") and "- `diff` recalls better than the baseline on average in no cell;" in md
    assert "read from its folder" in md and (out / "map.png").stat().st_size > 0 and m["plot"] == "map.png"


def test_a_finished_map_trains_nothing_again(tiny_map, capsys, monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("trained a finished cell")

    monkeypatch.setattr("difftx.compare.run.run_compare", refuse)
    spec = str(tiny_map / "spec.json")
    assert main(["map", "--spec", spec, "--out", str(tiny_map / "out"), "--dry-run"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "a: present (results.json: 1 seed, 2 arms): read from its folder"
    assert main(["map", "--spec", spec, "--out", str(tiny_map / "out"), "--no-progress"]) == 0
    assert "read from folders: a, b" in capsys.readouterr().out


def test_shards_spread_every_cells_models_by_the_spec_alone(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr("difftx.compare.run.run_compare",
                        lambda preset, seeds, out, **k: calls.append((Path(out).name, seeds, k["shard"],
                                                                      k["shard_offset"])))
    spec = cmap.parse_spec(_with(cells=[*SPEC["cells"], {"name": "c", "axes": {"depth": 2}, "seeds": 3}]), "s")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "results.json").write_text(json.dumps({"seeds": [0, 1], "arms": {"baseline": {}, "diff": {}}}))
    assert cmap.run_map(spec, tmp_path, shard=(2, 3), log=lambda *a: None) is None  # a shard writes no map
    # b is finished (not trained) but still counts: each cell's models start where the spec puts them
    assert calls == [("a", 1, (2, 3), 0), ("c", 3, (2, 3), 4)]
    assert not (tmp_path / "map.json").exists()


def test_cells_trains_only_the_cells_named(tmp_path, monkeypatch, capsys):
    calls = []
    monkeypatch.setattr("difftx.compare.run.run_compare", lambda preset, seeds, out, **k: calls.append(Path(out).name))
    spec = _write(tmp_path / "spec.json", _with(cells=[*SPEC["cells"], {"name": "c", "axes": {"depth": 2}}]))
    argv = ["map", "--spec", str(spec), "--out", str(tmp_path / "out")]
    assert main([*argv, "--cells", "c,a", "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "a: missing (no compare folder): to train"
    assert "b: missing (no compare folder): not measured" in lines and lines[-1].endswith("; 2 to train")
    assert main([*argv, "--cells", "b", "--no-progress"]) == 0
    assert calls == ["b"] and "not measured: a, b, c" in capsys.readouterr().out  # b's compare was a stand-in
    for bad in ("d", "a,", ""):
        assert main([*argv, "--cells", bad, "--dry-run"]) == 2
        err = capsys.readouterr().err
        assert "is not a cell of the spec; its cells: a, b, c" in err and ("'d'" if bad == "d" else "an empty name") in err
    assert main([*argv, "--cells", "a", "--table"]) == 2
    assert "--table" in capsys.readouterr().err


# -- recorded cells -----------------------------------------------------------------------------------------------


def test_recorded_cells_stand_in_and_a_present_folder_wins(tiny_map, tmp_path, capsys):
    recorded = tmp_path / "recorded.json"
    assert main(["map", "--spec", str(tiny_map / "spec.json"), "--out", str(tiny_map / "out"), "--no-train",
                 "--record", str(recorded), "--no-progress"]) == 0
    assert "recorded into" in capsys.readouterr().out
    rec = cmap.load_recorded(recorded)
    assert list(rec) == ["a", "b"] and rec["a"]["source"] == "recorded"
    # a recorded cell "c" with no folder, and a recorded "a" whose numbers differ from its folder's
    data = json.loads(recorded.read_text())
    c = copy.deepcopy(data["cells"][1])
    c["name"], c["provenance"] = "c", {"results_log": "2026-12-06: a test entry", "folder": "not kept"}
    data["cells"][0]["vs_baseline"]["diff"]["paired"]["mean"] = 123.0
    data["cells"].append(c)
    recorded.write_text(json.dumps(data))
    spec = _write(tmp_path / "spec.json", {**SPEC, "recorded": "recorded.json",
                                           "cells": [*SPEC["cells"], {"name": "c", "axes": {"init": "torch"}},
                                                     {"name": "d", "axes": {"depth": 2}, "seeds": 5}]})
    assert main(["map", "--spec", str(spec), "--out", str(tiny_map / "out"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[4] == "c: missing (no compare folder): recorded (results log '2026-12-06: a test entry'; folder not kept)"
    assert lines[6] == "d: missing (no compare folder): to train"
    out = tmp_path / "merged"
    for x in ("a", "b"):  # the tiny map's folders, under a map of their own
        (out / x).mkdir(parents=True)
        (out / x / "results.json").write_text((tiny_map / "out" / x / "results.json").read_text())
    assert main(["map", "--spec", str(spec), "--out", str(out), "--no-train", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "read from folders: a, b" in printed and "recorded (folders not kept): c" in printed
    assert "not measured: d" in printed
    m = json.loads((out / "map.json").read_text())
    got = {x["name"]: x for x in m["cells"]}
    assert got["a"]["source"] == "folder" and got["a"]["vs_baseline"]["diff"]["paired"]["mean"] != 123.0
    assert got["c"]["source"] == "recorded" and got["d"]["source"] is None and got["d"]["arms"] == {}
    assert got["c"]["vs_baseline"]["diff"]["paired"] == got["b"]["vs_baseline"]["diff"]["paired"]
    md = (out / "map.md").read_text()
    assert "- `c`: recorded from the results log, 2026-12-06: a test entry; folder not kept; 1 seed." in md
    assert "- `d`: not measured: `difftx compare --preset smoke --seeds 5 " in md


def test_recording_again_keeps_the_words_written_by_hand(tiny_map, tmp_path, capsys):
    """--record --cells records those cells alone; a cell recorded from the same run (its folder's creation stamp)
    keeps the provenance written into the recorded file by hand; another run's replaces it."""
    recorded = tmp_path / "recorded.json"
    argv = ["map", "--spec", str(tiny_map / "spec.json"), "--out", str(tiny_map / "out"), "--no-train",
            "--no-progress", "--record", str(recorded)]
    assert main([*argv, "--cells", "b"]) == 0
    assert "recorded into " + str(recorded) + ": b" in capsys.readouterr().out
    data = json.loads(recorded.read_text())
    assert [c["name"] for c in data["cells"]] == ["b"]
    data["cells"][0]["provenance"].update(results_log="2026-12-06: b's entry", folder="out/b (not kept)")
    recorded.write_text(json.dumps(data))
    assert main(argv) == 0
    got = {c["name"]: c["provenance"] for c in json.loads(recorded.read_text())["cells"]}
    assert got["b"]["results_log"] == "2026-12-06: b's entry" and got["b"]["folder"] == "out/b (not kept)"
    assert "results_log" not in got["a"]
    data = json.loads(recorded.read_text())
    data["cells"][1]["provenance"]["created"] = "2026-01-01T00:00:00Z"  # b recorded from an older run
    recorded.write_text(json.dumps(data))
    assert main(argv) == 0
    b = json.loads(recorded.read_text())["cells"][1]["provenance"]
    assert "results_log" not in b and b["created"] != "2026-01-01T00:00:00Z"


def test_a_recorded_cell_with_fewer_seeds_than_asked_is_trained(tmp_path):
    spec = cmap.parse_spec(SPEC, "s")
    rec = {"a": {"name": "a", "seeds": 1, "arms": {"baseline": {}, "diff": {}}},
           "b": {"name": "b", "seeds": 3, "arms": {"baseline": {}}}}
    plan = cmap.plan_map(spec, tmp_path, 2, rec)
    assert [use for *_, use in plan.rows] == ["train", "train"]  # 1 of 2 seeds; b lacks diff
    plan = cmap.plan_map(spec, tmp_path, 1, rec, train=False)
    assert [use for *_, use in plan.rows] == ["recorded", "recorded"]


# -- the shipped map: docs/compare.md's table and the answer ----------------------------------------------------------

BEGIN, END = "<!-- the regime map's table: generated", "<!-- end of the generated table -->"


def test_the_docs_table_is_the_shipped_maps():
    text = (ROOT / "docs" / "compare.md").read_text()
    start = text.index(BEGIN)
    block = text[text.index("\n", start) + 1:text.index(END)]
    assert block.strip() == cmap.map_table(cmap.docs_map()).strip(), \
        "docs/compare.md's regime map table is stale: replace it with the output of `difftx map --table`"


def test_the_answer_per_task_from_the_shipped_map():
    m = cmap.docs_map()
    sources = {c["name"]: c["source"] for c in m["cells"]}
    assert sources["normal"] == sources["torch"] == sources["lm-torch-xl"] == "recorded"
    assert sources["torch-depth4"] == sources["torch-depth8"] == sources["lm-torch-l"] == "recorded"
    diff = m["answer"]["recall"]["diff"]
    # every seed below the baseline, the mean not established: behind in most seeds, never "worse"
    assert diff[cmap.BEHIND] == ["normal", "normal-width128"] and diff[cmap.NEITHER] == ["normal-depth8"]
    assert cmap.BETTER not in diff and cmap.WORSE not in diff
    assert cmap.NOT_MEASURED not in diff  # every cell of the shipped map is measured
    # at 2,400 steps; with 6,000 the baseline learns too, no verdict at 4 layers, DIFF still ahead at 8
    assert diff[cmap.AHEAD] == ["torch-depth4", "torch-depth8", "torch-depth8-6000"]
    assert diff[cmap.NO_VERDICT][-2:] == ["torch-width128", "torch-depth4-6000"]
    assert m["answer"]["recall"]["diff_lambda_0.8"][cmap.AHEAD] == ["normal", "torch-depth4", "torch-depth8",
                                                                            "torch-depth8-6000"]
    assert m["answer"]["lm"]["diff"][cmap.NO_VERDICT] == ["lm-torch-l", "lm-torch-xl"]
    assert m["answer"]["lm"]["diff_out_0.2"][cmap.BEHIND] == ["lm-torch-l", "lm-torch-xl"]  # 13 of 13 at xl
    assert m["answer"]["lm"]["diff"][cmap.BEHIND] == ["lm-normal-l", "lm-normal-xl"]  # NLL above in 8 of 8 seeds
    lines = cmap.answer_lines(m)
    assert lines[0] == "**Recall (the frontier, mean accuracy over the plain-MQAR cells).**\n"
    first = next(x for x in lines if x.startswith("- `diff` "))
    assert re.match(r"- `diff` recalls better than the baseline on average in no cell; not interchangeable with the "
                    r"baseline, ahead in most seeds, in `torch-depth4` \(\+0\.690 \[.*\]: .*\), `torch-depth8` "
                    r"\(\+0\.797 \[.*\]: .*\) and `torch-depth8-6000` \(\+0\.466 .*\); not interchangeable "
                    r"with the baseline, behind in most seeds, in `normal` \(-0\.588 \[.*\]: .*\) "
                    r"and `normal-width128` \(.*\); neither it nor the baseline learns in `normal-depth8` \(.*\); no "
                    r"verdict in .* and `torch-depth4-6000` \(\+0\.175 .*\)\.$", first)
    assert any(x.startswith("**Language modelling (held-out NLL") for x in lines)
    table = cmap.map_table(m)
    assert "| `torch-depth8` (torch, 8 x 64, recall, 2,400 steps of 32) | baseline | - | 1 | no | 0 of 7 |" in table
    assert "| `torch-depth4` (torch, 4 x 64, recall, 2,400 steps of 32) | baseline | - | 1 | no | 1 of 7 (2,000) |" in table
    assert ("| `torch-depth4-6000` (torch, 4 x 64, recall, 6,000 steps of 32) | baseline | - | 1 | no | "
            "6 of 7 (1,800-4,100) |") in table
    assert ("| `torch-depth8-6000` (torch, 8 x 64, recall, 6,000 steps of 32) | baseline | - | 1 | no | "
            "5 of 7 (4,300-5,800) |") in table
    assert "- `normal-depth4`: recorded from the results log, 2026-11-28: The regime map in depth: " in table


def test_an_lm_cell_is_read_on_held_out_nll(tmp_path, monkeypatch):
    monkeypatch.setattr("difftx.compare.report.make_plots", lambda out, result, section=None: {})
    lm = {"steps": 4, "warmup_steps": 1, "log_every": 2, "lm_every": 1, "icl_every": 0, "probe_every": 0,
          "curve_points": 0, "tasks": {"lm": {"windows": 2, "extrapolation_factors": [1], "extrapolation_windows": 1},
                                       "outliers": {"tokens": 32}, "diagnostics": {"samples": 1},
                                       "needle": {"samples_per_cell": 1, "grid": "1/1"},
                                       "quant": {"bits": [8], "cells": "1/1", "needle_samples": 1, "lm_windows": 1},
                                       "icl": {"instances": 2, "queries": 1, "orders": 2}}}
    spec = cmap.parse_spec({"tasks": {"recall": SPEC["tasks"]["recall"], "lm": {"preset": "smoke", "set": lm}},
                            "defaults": {"seeds": 1, "arms": ["baseline", "diff"]},
                            "cells": [{"name": "text", "axes": {"task": "lm", "init": "torch"}}]}, "s")
    m = cmap.run_map(spec, tmp_path, workers=1, progress=False, log=lambda *a: None)
    cell = m["cells"][0]
    res = json.loads((tmp_path / "text" / "results.json").read_text())
    c = res["comparisons"]["diff vs baseline"]["metrics"]["lm_nll"]
    assert cell["task"] == "lm" and cell["metric"]["key"] == "lm_nll" and cell["metric"]["lower_is_better"]
    assert cell["vs_baseline"]["diff"]["paired"]["mean"] == c["paired"]["mean"]
    assert cell["arms"]["baseline"]["metric"]["values"] == c["values"]["baseline"]
    assert cell["arms"]["diff"]["learned"] is None and cell["arms"]["diff"]["ratio_at_init"] is None  # no probes
    assert list(m["answer"]) == ["lm"] and m["answer"]["lm"]["diff"] == {cmap.NO_VERDICT: ["text"]}
    md = (tmp_path / "map.md").read_text()
    assert "**Language modelling (held-out NLL, nats; lower is better).**" in md and " nats: " in md


def test_the_map_never_writes_over_its_spec(tmp_path, capsys):
    """`--out` whose map.json would be the spec, or `--record` naming the spec: refused in one line, before any
    training."""
    from difftx.cli import main

    spec = tmp_path / "map.json"
    spec.write_text((cmap.DEFAULT_SPEC).read_text().replace('"../../docs/regime-map.json"',
                                                            json.dumps(str(cmap.DEFAULT_SPEC.parents[2] / "docs" /
                                                                           "regime-map.json"))))
    assert main(["map", "--spec", str(spec), "--out", str(tmp_path), "--no-train"]) == 2
    assert "--out" in capsys.readouterr().err
    assert main(["map", "--spec", str(spec), "--out", str(tmp_path / "o"), "--no-train", "--record", str(spec)]) == 2
    assert "--record" in capsys.readouterr().err


def test_a_cell_knows_the_seeds_a_verdict_among_its_arms_needs(tmp_path):
    """Every verdict is Holm-adjusted over the compare's family of comparisons, and the exact sign-flip test's
    smallest p is 2 / 2^n: 3 arms (3 comparisons) need 7 seeds, 4 arms (5) need 8; the shipped LM cells ask 8,
    and the one measured at 7 seeds before the map knew it now asks 13 (a second look)."""
    spec = cmap.parse_spec(_with(cells=[{"name": "three", "axes": {}, "arms": ["baseline", "diff", "diff_lambda_0.8"],
                                         "seeds": 7},
                                        {"name": "four", "axes": {}, "seeds": 7,
                                         "arms": ["baseline", "diff", "diff_lambda_0.8", "diff_out_0.2"]}]), "s")
    three, four = spec.cells
    assert three.seeds_warning(tmp_path) == "" and four.seeds_warning(tmp_path, 8) == ""
    assert four.seeds_warning(tmp_path).startswith("four: 7 seeds cannot give a verdict when all 5 comparisons of the "
                                                   "4 arms are made: 8 seeds needed")
    shipped = {c.name: c for c in cmap.load_spec().cells}
    assert [n for n, c in shipped.items() if c.task == "lm" and c.seeds_warning(tmp_path)] == []
    assert shipped["lm-torch-xl"].seeds == 13
