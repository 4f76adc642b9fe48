"""``difftx compare --from SRC`` (issue 40): a pretrained source fine-tuned as it is against its conversion.

Each arm starts from the right weights (the source; its conversion with the model's seed), both train on the same
batches with the same schedule, the report has the conversion's costs, a transformers Llama folder works as a
source, and what cannot be compared this way is refused in one line before anything is trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from difftx import ModelConfig, Transformer
from difftx.checkpoint import load_model, save_model
from difftx.cli import main
from difftx.compare import get_preset, run_compare
from difftx.data import load_tokenizer
from difftx.interop.convert import convert_model

SMALL = ["--set", "steps=4", "--set", "warmup_steps=1", "--set", "recall_len=32", "--set", "lm_seq_len=32",
         "--set", "tasks.recall.lengths=32,64", "--set", "tasks.recall.samples=4", "--set", "log_every=2",
         "--set", "tasks.outliers.tokens=128", "--set", "tasks.quant.lm_windows=2", "--set", "curve_points=2",
         "--set", "curve_windows=2", "--set", "workers=1"]
PROBES = ["--set", "probe_every=2", "--set", "probe_samples=4"]  # recall probes: with the mixture (--synthetic) only


def _fields(small: list[str]) -> dict:
    out: dict = {}
    for key, value in (s.split("=", 1) for s in small[1::2]):
        node = out
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = tuple(int(x) for x in value.split(",")) if "," in value else int(value)
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("from")
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64,
                                    attention="standard"))
    save_model(model, root / "src")
    load_tokenizer("byte").save(root / "src" / "tokenizer")
    (root / "text.txt").write_text("Shall I compare thee to a summer's day? Thou art more lovely and more temperate."
                                   "\nRough winds do shake the darling buds of May.\n" * 120)
    return root


def test_each_arm_starts_from_the_source_or_its_conversion_with_its_seed(source, tmp_path):
    """With a learning rate of 1e-12 the fine-tuned models are their starting weights: the source arm is the source,
    and the converted arm of seed s is `difftx convert --seed s` of it (the lambda vectors differ by seed)."""
    preset = get_preset("from-cpu").with_overrides(source=str(source / "src"), data=str(source / "text.txt"),
                                                   lr=1e-12, min_lr=0.0, **_fields(SMALL + PROBES))
    res = run_compare(preset, 2, tmp_path / "out", progress=False)
    src = load_model(source / "src").state_dict()
    for seed in (0, 1):
        folder = tmp_path / "out" / f"seed{seed}"
        base = load_model(folder / "source" / "model").state_dict()
        assert all(torch.allclose(base[k], src[k], atol=1e-6) for k in src)
        convert_model(source / "src", tmp_path / f"conv{seed}", seed=seed)
        want = load_model(tmp_path / f"conv{seed}").state_dict()
        got = load_model(folder / "converted" / "model").state_dict()
        assert want.keys() == got.keys() and all(torch.allclose(got[k], want[k], atol=1e-6) for k in want)
        assert not (folder / "converted" / "init").exists() and not (folder / "source" / "init").exists()
    lq = [load_model(tmp_path / "out" / f"seed{s}" / "converted" / "model").layers[0].attn.lambda_q1 for s in (0, 1)]
    assert not torch.equal(*lq)
    assert res.arms["source"].config["attention"] == "standard" and res.arms["source"].label == "source"
    assert res.arms["converted"].config["attention"] == "converted" and res.arms["converted"].label == "converted"
    assert res.arms["converted"].source == str(source / "src") and res.primary.arms == ("converted", "source")


def test_cli_compares_with_a_lambda_warmup_and_reports_the_costs(source, tmp_path, capsys):
    import shutil

    out, src = tmp_path / "out", tmp_path / "src"
    shutil.copytree(source / "src", src)
    args = ["compare", "--from", str(src), "--data", str(source / "text.txt"), "--seeds", "2", "--out", str(out),
            "--no-progress", "--method", "random", "--set", "lambda_warmup=2", "--set", "convert_lambda_init=0.5",
            "--synthetic", *SMALL, *PROBES]  # --synthetic: recall batches between the LM batches, and the grid
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "LM NLL (held-out)" in printed and "recall frontier" in printed
    record = json.loads((out / "seed1" / "converted" / "train.json").read_text())
    assert [h["lambda_scale"] for h in record["history"]] == [0.5, 1.0]  # steps 2 and 4 of a 2-step warm-up
    assert record["config"]["lambda_init"] == 0.5 and record["request"]["preset"]["convert_method"] == "random"
    report = (out / "report.md").read_text()
    assert report.startswith("# A converted model vs its source, fine-tuned alike: `from-cpu` preset")
    # the needle and ICL tasks are not measured, for the reason --from has (no advice --from refuses)
    assert "--data --synthetic adds" not in report and "--synthetic adds the ICL task" not in report
    assert "the ICL task needs token ids of its own, which the source's vocabulary does not have" in report
    section = report[report.index("## The source and its conversion"):]
    # GQA 4 heads over 2 kv groups of width 8, 2 layers, float32: keys (2 x 8) and values (2 x 8) per layer; the
    # converted kind caches two key components per group
    assert "| KV cache, bytes per token of context (float32) | 256 | 384 | +50.0% |" in section
    assert "`difftx convert --method random`" in section and "lambda_warmup = 2 steps" in section
    results = json.loads((out / "results.json").read_text())
    first = results["comparisons"]["converted vs source"]
    assert first["primary"] and {"lm_nll", "recall_frontier"} <= {k for k, c in first["metrics"].items()
                                                                   if c["primary"]}
    # the same command again reuses every model; a source trained again in place is not taken for the old one
    assert main(args) == 0
    assert json.loads((out / "seed1" / "converted" / "train.json").read_text()) == record
    capsys.readouterr()
    model = load_model(src)
    with torch.no_grad():
        model.layers[0].attn.q_proj.weight.add_(0.01)
    save_model(model, src)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"this model was trained with source {src} (config and weights" in err and "differs in ['source']" in err


def test_the_dex_method_converts_every_head(source, tmp_path):
    preset = get_preset("from-cpu").with_overrides(source=str(source / "src"), data=str(source / "text.txt"),
                                                   convert_method="dex", **_fields(SMALL + PROBES))
    res = run_compare(preset, 1, tmp_path / "out", progress=False)
    assert res.arms["converted"].config["attention"] == "dex" and not res.arms["converted"].config.get("options")
    assert "(`difftx convert --method dex` on every head, " in (tmp_path / "out" / "report.md").read_text()


def test_each_arm_is_tuned_on_its_own_when_asked(source, tmp_path, capsys):
    assert main(["compare", "--from", str(source / "src"), "--data", str(source / "text.txt"), "--seeds", "2",
                 "--out", str(tmp_path / "out"), "--no-progress", "--tune", "lr=0.002", *SMALL]) == 0
    printed = capsys.readouterr().out
    assert "tuned lr (validation loss, leave-one-seed-out)" in printed and "tuned, converted vs source: LM NLL" in printed
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    tune = results["tune"]
    assert tune["field"] == "lr" and set(tune["chosen"]) >= {"source", "converted"}
    # without --synthetic a comparison from a source fine-tunes on the text alone: no recall batches, no recall grid
    assert results["preset"]["recall_every"] == 0 and results["preset"]["lm_every"] == 1
    assert not any(k.startswith("recall") for k in results["comparisons"]["converted vs source"]["metrics"])
    assert "recall frontier" not in printed
    assert "on your text alone: every step an LM batch" in (tmp_path / "out" / "report.md").read_text()


def test_a_transformers_llama_folder_is_a_source(source, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=257, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    args = ["compare", "--from", str(tmp_path / "hf"), "--data", str(source / "text.txt"), "--out",
            str(tmp_path / "out"), "--no-progress", *SMALL]
    assert main(args) == 2  # a folder without tokenizer files: the user names the tokenizer
    assert "has no tokenizer (a difftx tokenizer/ folder, or a transformers folder's tokenizer.json): give the one it " \
        "was trained with (--tokenizer DIR, or byte)" in capsys.readouterr().err
    assert main([*args, "--tokenizer", "byte"]) == 0
    base = load_model(tmp_path / "out" / "seed0" / "source" / "model")
    assert base.config.attention == "standard" and base.config.n_kv_heads == 2
    # a folder with its tokenizer.json (as transformers saves it): read as `difftx convert` reads it
    from difftx.data.tokenizer import byte_tokenizer_json

    (tmp_path / "hf" / "tokenizer.json").write_text(byte_tokenizer_json())
    args[args.index(str(tmp_path / "out"))] = str(tmp_path / "out2")
    assert main(args) == 0
    text = json.loads((tmp_path / "out2" / "results.json").read_text())["text"]
    assert text["tokenizer"].startswith("bpe-"), text  # its tokenizer.json, not the byte tokenizer


def test_a_tokenizer_other_than_the_sources_is_refused(source, tmp_path, capsys):
    from difftx.data.tokenizer import byte_tokenizer_json

    other = tmp_path / "tokenizer.json"
    other.write_text(byte_tokenizer_json())  # another tokenizer of the same size as the source's own (byte)
    args = ["compare", "--from", str(source / "src"), "--data", str(source / "text.txt"), "--out",
            str(tmp_path / "out"), "--no-progress", "--tokenizer", str(other), *SMALL]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "ComparePreset.tokenizer:" in err and "is not the tokenizer this model was trained with (byte" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, message", [
    ([], "--from SRC needs your text: --data TEXT"),
    (["--data", "TEXT", "--arms", "baseline,diff"], "--arms goes without --from"),
    (["--data", "TEXT", "--set", "source=x"], "--set source=...: give it as --from / --method"),
    (["--data", "TEXT", "--method", "sideways"], "ComparePreset.convert_method: must be one of"),
    (["--data", "TEXT", "--preset", "cpu", "--synthetic"], "a comparison from a source trains on LM and recall "
                                                           "batches only"),
    (["--data", "TEXT", "--set", "recall_every=1"], "--set recall_every: --data trains on the text alone; add "
                                                    "--synthetic"),
    (["--data", "TEXT", "--synthetic", "--set", "recall_vocab=512"], "ComparePreset.recall_vocab: 512 exceeds "
                                                                     "the source's vocab_size 257"),
    (["--data", "TEXT", "--set", "lm_seq_len=128"], "its max_seq_len 64 is shorter than the training sequences"),
    (["--data", "TEXT", "--set", "convert_lambda_init=1.0"], "ComparePreset.convert_lambda_init: must be a number "
                                                             "in [0, 1)"),
])
def test_what_cannot_be_compared_from_a_source_is_refused_in_one_line(source, tmp_path, capsys, extra, message):
    extra = [str(source / "text.txt") if e == "TEXT" else e for e in extra]
    assert main(["compare", "--from", str(source / "src"), "--out", str(tmp_path / "out"), "--no-progress",
                 *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


def test_method_and_a_missing_source_are_refused(source, tmp_path, capsys):
    assert main(["compare", "--method", "zero", "--out", str(tmp_path / "o")]) == 2
    assert "--method goes with --from" in capsys.readouterr().err
    assert main(["compare", "--from", str(tmp_path / "nothing"), "--data", str(source / "text.txt"),
                 "--out", str(tmp_path / "o")]) == 2
    assert "is not a folder" in capsys.readouterr().err
