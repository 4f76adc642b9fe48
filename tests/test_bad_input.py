"""Bad input said as such (issue R6): a Hub-style folder where a difftx checkpoint is expected."""

import json

import pytest

from difftx.checkpoint import CheckpointError, load_config
from difftx.cli import main

LLAMA = {"hidden_size": 64, "intermediate_size": 192, "num_attention_heads": 4, "num_hidden_layers": 2,
         "num_key_value_heads": 2, "vocab_size": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
         "max_position_embeddings": 128, "tie_word_embeddings": False, "torch_dtype": "float32"}


@pytest.mark.parametrize("extra, says", [
    ({"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
     r"looks like a Hugging Face transformers folder .*`difftx import .*hub OUT`.*`difftx convert .*hub OUT`"),
    ({}, r"a transformers-style config .* without the 'model_type' field that names its architecture: add it"),
])
def test_a_transformers_folder_where_a_checkpoint_is_expected_says_what_reads_it(extra, says, tmp_path, capsys):
    """... and one without its model_type is told to add it, not to run `difftx convert` (which then fails the
    same way)."""
    folder = tmp_path / "hub"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**LLAMA, **extra}))
    with pytest.raises(CheckpointError, match=says):
        load_config(folder)
    for cmd in (["generate", str(folder), "--prompt", "a", "--max-new-tokens", "1"], ["runs", str(folder)],
                ["train", "--preset", "test", "--init-from", str(folder), "--out", str(tmp_path / "r")],
                ["eval", "lm", str(folder)], ["export", str(folder), str(tmp_path / "hf")],
                ["convert", str(folder), str(tmp_path / "c")]):
        assert main(cmd) == 2, cmd
        err = capsys.readouterr().err
        assert "unknown field" not in err and len(err.strip().splitlines()) == 1, (cmd, err)
        if not extra:
            assert "model_type" in err and "`difftx convert" not in err.split("then")[0], (cmd, err)


def test_import_of_a_folder_without_model_type_says_to_add_it(tmp_path, capsys):
    import difftx
    from difftx.interop import export_hf

    export_hf(difftx.Transformer(difftx.preset("test")), tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    del cfg["model_type"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "no 'model_type' field" in err and "add it" in err and "None" not in err, err


@pytest.mark.parametrize("field, value, says", [("rope_theta", float("inf"), "ModelConfig.rope_theta"),
                                                ("rms_norm_eps", float("nan"), "ModelConfig.norm_eps")])
def test_import_refuses_a_config_number_that_is_not_finite(field, value, says, tmp_path, capsys):
    """Infinity in a transformers config.json is refused on import, never written into difftx's own config."""
    import difftx
    from difftx.interop import export_hf

    export_hf(difftx.Transformer(difftx.preset("test")), tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    cfg[field] = value
    if field == "rope_theta":
        cfg.setdefault("rope_parameters", {})["rope_theta"] = value
    (tmp_path / "hf" / "config.json").write_text(json.dumps(cfg))
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert says in err and "must be a finite positive number" in err and not (tmp_path / "out").exists(), err


def test_a_difftx_config_with_a_bad_field_is_still_named_as_such(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"dim": 64, "n_layers": 2, "bogus": 1}))
    with pytest.raises(CheckpointError, match=r"invalid model config: ModelConfig: unknown field\(s\) \['bogus'\]"):
        load_config(tmp_path)


# -- no output over an input ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A standard-attention model folder (what `convert` reads), byte vocabulary."""
    import torch

    import difftx
    from difftx.checkpoint import save_model

    folder = tmp_path_factory.mktemp("src") / "model"
    torch.manual_seed(0)
    save_model(difftx.Transformer(difftx.preset("test").replace(vocab_size=257, attention="standard")), folder)
    return folder


def _same(path):
    from pathlib import Path

    p = Path(path)
    return p.read_bytes() if p.is_file() else sorted((f.name, f.read_bytes()) for f in p.rglob("*") if f.is_file())


@pytest.mark.parametrize("task, flag", [("recall", "--examples"), ("lm", "--data"), ("lm", "--tokenizer")])
def test_eval_json_never_replaces_what_the_command_reads(task, flag, source, tmp_path, capsys):
    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"inputs": [1, 2, 3]}\n')
    link = tmp_path / "link.json"
    link.symlink_to(mine)  # the same file by another name: links are followed for the test
    for out in (mine, link):
        code = main(["eval", task, str(source), flag, str(mine), "--json", str(out), "--no-progress"])
        err = capsys.readouterr().err
        assert code == 2 and f"--json {out}: is {flag} {mine}, which this command reads" in err, err
        assert mine.read_text() == '{"inputs": [1, 2, 3]}\n'


def test_convert_never_writes_where_a_run_prunes_or_over_its_source(source, tmp_path, capsys):
    run = tmp_path / "run"
    step = run / "checkpoints" / "step_00000040"
    step.mkdir(parents=True)
    (run / "train_config.json").write_text("{}")
    code = main(["convert", str(source), str(step / "conv")])
    err = capsys.readouterr().err
    assert code == 2 and "lies inside" in err and "`difftx train --resume` prunes it" in err, err
    assert not (step / "conv").exists()
    before = _same(source)
    for out in (source, source.parent):  # the source itself, or a folder holding it, replaced: refused
        code = main(["convert", str(source), str(out), "--overwrite"])
        err = capsys.readouterr().err
        assert code == 2 and "which this command reads" in err, err
    assert _same(source) == before
    for cmd in (["export", str(source)], ["import", str(source)]):
        assert main([*cmd, str(source.parent), "--overwrite"]) == 2
        assert "which this command reads" in capsys.readouterr().err
    assert _same(source) == before


def test_a_new_file_inside_a_model_folder_and_a_seed_folder_of_a_comparison(source, tmp_path, capsys):
    seed = tmp_path / "cmp" / "seed0" / "diff"
    seed.mkdir(parents=True)
    (tmp_path / "cmp" / "compare.json").write_text("{}")
    assert main(["convert", str(source), str(seed / "conv")]) == 2
    assert "a seed folder of the comparison" in capsys.readouterr().err
    assert main(["eval", "lm", str(source), "--json", str(source / "lm.json"), "--no-progress"]) == 0


@pytest.mark.parametrize("kind", ["dangling", "to an empty folder"])
def test_a_link_at_out_is_refused_before_any_work(kind, source, tmp_path, capsys):
    target = tmp_path / "elsewhere"
    if kind != "dangling":
        target.mkdir()
    out = tmp_path / "out"
    out.symlink_to(target)
    for cmd in (["convert", str(source), str(out)], ["export", str(source), str(out)]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert f"is a symbolic link to {target}" in err and ("does not exist" in err) == (kind == "dangling"), err
        assert out.is_symlink() and (not target.exists() or not any(target.iterdir()))


def test_a_training_run_too_large_for_the_machine_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                                        monkeypatch):
    """`difftx train` asks compare's estimate up front (it was killed partway, or swapped, with nothing said)."""
    from difftx.training import memory

    monkeypatch.setattr(memory, "physical_bytes", lambda: 24 << 30)  # this project's machines, on any machine
    out = tmp_path / "run"
    code = main(["train", "--preset", "test", "--set", "model_overrides.vocab_size=100000000", "--set", "steps=2",
                 "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "this run's model would need about 95.4 GiB to train" in err and "24.0 GiB" in err, err
    assert not out.exists()


def test_a_comparison_too_large_for_the_machine_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    from difftx.compare import jobs as jobs_mod
    from difftx.compare.jobs import check_fits, model_bytes
    from difftx.compare.presets import get_preset

    monkeypatch.setattr(jobs_mod, "memory_bytes", lambda: 24 << 30)  # this project's machines, on any machine

    out = tmp_path / "cmp"
    code = main(["compare", "--preset", "smoke", "--set", "recall_every=2", "--set", "recall_vocab=100000000",
                 "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and "would need about 95.4 GiB to train" in err and "recall (recall_vocab) 100,000,000" in err
    assert not out.exists()
    plan = get_preset("smoke").resolve()
    check_fits(plan, model_bytes(plan))  # exactly what it needs: fine
    with pytest.raises(ValueError, match="more than this machine's"):
        check_fits(plan, model_bytes(plan) - 1)
    code = main(["scale", "--preset", "smoke", "--sizes", "32x1x1,64x1x1", "--set", "recall_every=2",
                 "--set", "recall_vocab=100000000", "--out", str(tmp_path / "sc"), "--no-progress"])
    assert code == 2 and "size 32x1x1 (32x1x1): one model of this comparison" in capsys.readouterr().err


def test_recall_lengths_far_beyond_the_models_context_are_refused_at_once(source, capsys):
    from difftx.tasks.common import MAX_EXTRAPOLATION

    ctx = 64  # the test preset's max_seq_len
    code = main(["eval", "recall", str(source), "--lengths", "100000", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and f"length(s) [100000] exceed {MAX_EXTRAPOLATION}x the model's context ({ctx} tokens" in err


def _doc_kind(folder, name: str):
    """The kind of docs/attention-kinds.md (its first code block) registered as ``name``, written to a file in
    ``folder``: ``(its path, its code)``."""
    import re
    from pathlib import Path

    doc = Path(__file__).resolve().parents[1] / "docs" / "attention-kinds.md"
    code = re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)[0].replace('"qknorm"', f'"{name}"')
    path = folder / f"{name}_kinds.py"
    path.write_text(code)
    return path, code


def test_a_model_of_a_kind_of_your_own_is_not_reused_once_its_file_is_edited(tmp_path, capsys, monkeypatch):
    """The kinds file's SHA-256 is in each model's train.json; a re-run after an edit is refused, naming the file;
    the file as it was is reused."""
    from difftx.attention.registry import ATTENTIONS

    kinds, code = _doc_kind(tmp_path, "qknorm_edit")
    monkeypatch.setenv("DIFFTX_KINDS", "")
    out = tmp_path / "cmp"
    argv = ["--kinds", str(kinds), "compare", "--preset", "smoke", "--seeds", "1", "--out", str(out), "--workers", "1",
            "--no-progress", "--arms", "baseline,diff,qknorm_edit", "--set", "steps=4", "--set", "warmup_steps=1",
            "--set", "lm_every=0", "--set", "icl_every=0", "--set", "recall_every=1", "--set", "recall_vocab=32",
            "--set", "recall_len=16", "--set", "recall_pairs=2,3", "--set", "probe_every=0",
            "--set", "tasks.recall.samples=4", "--set", "tasks.recall.attention_samples=1"]
    try:
        assert main(argv) == 0
        rec = json.loads((out / "seed0" / "qknorm_edit" / "train.json").read_text())
        assert rec["request"]["kinds"]["qknorm_edit"]["file"] == str(kinds.resolve())
        # the report says what the arm is: its class's docstring
        assert ("| qknorm_edit | " in (out / "report.md").read_text() and "| Standard attention whose queries and keys "
                "are RMS-normalised per head before RoPE. |" in (out / "report.md").read_text())
        capsys.readouterr()
        kinds.write_text(code + "\n# edited\n")
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "this model was trained with code " + str(kinds.resolve()) in err and "differs in ['code']" in err
        assert str(out / "seed0" / "qknorm_edit" / "train.json") in err  # the built-in arms are not affected
        kinds.write_text(code)
        assert main(argv) == 0  # the code it trained with: reused
        moved = tmp_path / "elsewhere" / kinds.name
        moved.parent.mkdir()
        moved.write_text(code)
        ATTENTIONS.pop("qknorm_edit", None)
        before = (out / "seed0" / "qknorm_edit" / "train.json").read_text()
        assert main([str(moved) if a == str(kinds) else a for a in argv]) == 0  # the same code at a new path
        assert (out / "seed0" / "qknorm_edit" / "train.json").read_text() == before  # reused, not retrained
    finally:
        ATTENTIONS.pop("qknorm_edit", None)


def test_a_run_of_a_kind_of_your_own_is_not_resumed_once_its_file_is_edited(tmp_path, capsys, monkeypatch):
    """Each checkpoint of `difftx train` records the kinds file's SHA-256 (and the difftx version); `--resume` after
    an edit is refused in one line naming the file, before anything is written; the file as it was resumes."""
    from difftx import __version__
    from difftx.attention.registry import ATTENTIONS
    from difftx.training import checkpointing as ckpt

    kinds, code = _doc_kind(tmp_path, "qknorm_resume")
    monkeypatch.setenv("DIFFTX_KINDS", "")
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "run"
    fast = ["--preset", "test", "--set", "eval_interval=2", "--set", "log_interval=2", "--set", "batch_size=2",
            "--set", "ckpt_interval=2", "--no-progress"]
    try:
        assert main(["--kinds", str(kinds), "train", *fast, "--set", "steps=2", "--set",
                     "model_overrides.attention=qknorm_resume", "--out", str(out)]) == 0
        state = json.loads((ckpt.latest_checkpoint(out) / ckpt.STATE_NAME).read_text())
        assert state["kind_code"]["file"] == str(kinds.resolve()) and state["difftx"] == __version__
        resume = ["--kinds", str(kinds), "train", "--out", str(out), "--resume", "--set", "steps=4", "--no-progress"]
        kinds.write_text(code + "\n# edited\n")
        capsys.readouterr()
        assert main(resume) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "attention kind 'qknorm_resume' was trained with the code in " + \
            str(kinds.resolve()) in err[0] and "--init-from" in err[0], err
        assert [p.name for p in ckpt.list_checkpoints(out)] == ["step_00000002"]  # nothing written
        kinds.write_text(code)
        assert main(resume) == 0
        assert [p.name for p in ckpt.list_checkpoints(out)][-1] == "step_00000004"
    finally:
        ATTENTIONS.pop("qknorm_resume", None)


def test_a_built_in_kind_records_no_code_file():
    from difftx.attention.registry import code_change, kind_code

    assert kind_code("diff") is None and code_change("diff", None) is None
    with pytest.raises(ValueError, match="'nope' is not registered"):
        kind_code("nope")


@pytest.mark.parametrize("task, args, says", [
    ("needle", ["--heatmap-lengths", "100000"], "needle --context-len / --heatmap-lengths: length(s) [100000] exceed "
                                                "2048 tokens (text prompts: 8x 256; the model's context is 64)"),
    ("attention", ["--context-len", "100000"], "attention --context-len: length(s) [100000] exceed 2048 tokens"),
    ("lm", ["--seq-len", "100000"], "lm --seq-len / --extrapolation-factors (windows of 100000 x 4): length(s) "
                                    "[400000] exceed 8x the model's context (64 tokens, max_seq_len)"),
    ("lm", ["--extrapolation-factors", "1,10000"], "(windows of 64 x 10000): length(s) [640000] exceed 8x"),
    ("recall", ["--samples", "100000000"], "recall --samples / --batch-size: 100,000,000 sequence(s) of 64 tokens in "
                                           "batches of 64 would need about 95.4 GiB, more than the 24.0 GiB"),
])
def test_every_eval_size_is_bounded_before_work(task, args, says, source, capsys, monkeypatch):
    """Lengths past 8x the model's context (2048 tokens at least for the natural-language needle prompts, which need
    room for their sentences) and sizes past the machine's memory: one line, exit 2, before any prompt is made."""
    from difftx import generation

    monkeypatch.setattr(generation, "available_memory", lambda device: 24 << 30)
    code = main(["eval", task, str(source), *args, "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_train_and_info_take_every_registered_kind(tmp_path, capsys, monkeypatch):
    """`train --attention` accepts a kind registered by --kinds (not a fixed list of four) and names what it knows
    for one it does not; `info --arms` lists the registered kind beside the built-in arms."""
    import re

    from difftx.attention.registry import ATTENTIONS

    kinds, _ = _doc_kind(tmp_path, "qknorm_cli")
    monkeypatch.setenv("DIFFTX_KINDS", "")
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(tmp_path / "cache"))
    try:
        assert main(["--kinds", str(kinds), "train", "--preset", "test", "--set", "steps=1", "--attention",
                     "qknorm_cli", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
        cfg = json.loads(next((tmp_path / "run" / "checkpoints").glob("step_*/config.json")).read_text())
        assert cfg["attention"] == "qknorm_cli"
        capsys.readouterr()
        assert main(["--kinds", str(kinds), "info", "test", "--arms"]) == 0
        assert re.search(r"^qknorm_cli\s+qknorm_cli", capsys.readouterr().out, re.M)
        assert main(["train", "--preset", "test", "--attention", "nope", "--out", str(tmp_path / "r2")]) == 2
        err = capsys.readouterr().err
        assert "'nope'" in err and "--kinds" in err and len(err.strip().splitlines()) == 1, err
    finally:
        ATTENTIONS.pop("qknorm_cli", None)
