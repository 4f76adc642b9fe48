"""``difftx eval attention | diagnostics | icl`` end to end on tiny hand-made checkpoints, and the
library pieces they add (natural-language probes with token roles, prompts of mixed lengths,
batched head redundancy)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from difftx.checkpoint import load_model, save_model
from difftx.cli import main
from difftx.config import ModelConfig, baseline_config
from difftx.eval.attention_noise import attention_to_answer
from difftx.eval.diagnostics import model_head_redundancy
from difftx.eval.icl import ICLBlock
from difftx.eval.needle import ROLE_ANSWER, ROLE_FILLER, ROLE_NEEDLE, ROLE_QUERY, NeedleBlock, needle_samples
from difftx.eval.needle_text import make_text_needle_sample, text_needle_roles
from difftx.model import Transformer

NEEDLE = NeedleBlock(n_keys=16, n_filler=20, context_len=48, max_needles=4, max_query=2)
ICL = ICLBlock(n_classes=2, n_features=8, features_per_class=2, input_len=2, n_labels=4, n_demos=4,
               first_id=NEEDLE.vocab_size)


def _save(folder: Path, cfg: ModelConfig, icl: dict | None | str = "absent") -> Path:
    torch.manual_seed(0)
    save_model(Transformer(cfg), folder)
    info = {"needle_task": NEEDLE.to_dict(), "lm": False, "lm_offset": ICL.vocab_size, "lm_seq_len": 32}
    if icl != "absent":
        info["icl_task"] = icl
    (folder / "compare_task.json").write_text(json.dumps(info))
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("eval")
    diff = ModelConfig(vocab_size=ICL.vocab_size, dim=32, n_layers=2, n_heads=2, max_seq_len=64)
    return {"diff": _save(root / "diff", diff, ICL.to_dict()),
            "baseline": _save(root / "baseline", baseline_config(diff)),
            "null_icl": _save(root / "null", diff, None)}


def _eval(task: str, folder: Path, tmp_path: Path, *extra: str) -> tuple[int, dict | None]:
    out = tmp_path / f"{task}.json"
    samples = ["--samples", "3"] if task in ("attention", "diagnostics") else []
    rc = main(["eval", task, str(folder), *samples, "--no-progress", "--json", str(out), *extra])
    return rc, json.loads(out.read_text()) if rc == 0 else None


def test_cli_subcommands_are_the_registered_tasks(capsys):
    from difftx.tasks import TASKS

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in TASKS)


def test_attention_on_a_compare_model(models, tmp_path, capsys):
    rc, res = _eval("attention", models["diff"], tmp_path, "--depths", "0.25,0.75")
    assert rc == 0
    out = capsys.readouterr().out
    assert (res["form"], res["depths"], res["samples_per_depth"]) == ("synthetic", [0.25, 0.75], 3)
    assert list(res["cells"]) == ["1/1", "2/2", "4/2"] and res["dropped_cells"] == ["6/2"]  # the task has 4 needles
    a = res["cells"]["4/2"]
    assert len(a["records"]["answer"]["absolute"]) == len(a["records"]["correct"]) == 6  # per prompt, 2 depths x 3
    assert a["accuracy"] == sum(a["records"]["correct"]) / 6
    assert len(a["layers"]) == 2 and set(a["summary"]) == {"signed", "absolute", "positive"}
    assert "answer" in a["best_head_row"]["roles"] and len(a["best_head_row"]["row"]) == NEEDLE.context_len
    assert "3 per depth at depths 0.25, 0.75" in out
    for layer in (0, 1):
        for v in ("absolute", "signed"):
            row = next(ln for ln in out.splitlines() if re.match(rf"\s+{layer}\s+{v}\s", ln))
            assert f"{a['layers'][layer]['answer_mean'][v]:.4f}" in row
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("4/2"))
    assert f"{a['summary']['absolute']['answer']:.4f}" in line
    rc, res = _eval("attention", models["diff"], tmp_path, "--cells", "2/1")
    assert rc == 0 and list(res["cells"]) == ["2/1"]


@pytest.mark.parametrize("cells, message", [("5/2", "none of the cells"), ("3/3", "none of the cells"),
                                            ("4-2", "expected a needle cell N/R"), ("0/1", "1 <= R <= N")])
def test_attention_refuses_impossible_cells(models, tmp_path, capsys, cells, message):
    rc, _ = _eval("attention", models["diff"], tmp_path, "--cells", cells)
    assert rc == 2
    assert message in capsys.readouterr().err


def test_diagnostics_lambda_is_the_models_lambda(models, tmp_path, capsys):
    rc, res = _eval("diagnostics", models["diff"], tmp_path)
    assert rc == 0
    model = load_model(models["diff"])
    lams = [float(b.attn.lambda_full().detach()) for b in model.layers]
    assert res["lambda"] == pytest.approx(lams) and res["lambda"] != pytest.approx([0.0, 0.0])
    assert res["lambda_init"] == [b.attn.lambda_init for b in model.layers]
    assert len(res["head_redundancy"]) == 2 and all(isinstance(x, float) for x in res["head_redundancy"])
    assert res["head_redundancy_on"] == {"source": "needle prompts", "form": "synthetic", "cell": "4/2",
                                         "depth": 0.5, "n_samples": 3}
    out = capsys.readouterr().out
    assert "over 3 needle prompts (cell 4/2)" in out
    assert re.search(rf"^\s+1\s+{res['lambda'][1]:.4f}\s+{res['lambda_init'][1]:.4f}\s+"
                     rf"{res['head_redundancy'][1]:.4f}$", out, re.M)
    # the baseline has no lambda: null in JSON, "-" printed
    rc, res = _eval("diagnostics", models["baseline"], tmp_path)
    assert rc == 0 and res["lambda"] == [None, None] and res["lambda_init"] == [None, None]
    assert "null" in (tmp_path / "diagnostics.json").read_text()
    assert re.search(r"^\s+0\s+-\s+-\s+\d\.\d{4}$", capsys.readouterr().out, re.M)


def test_icl_on_a_model_trained_with_the_icl_task(models, tmp_path, capsys):
    rc, res = _eval("icl", models["diff"], tmp_path, "--instances", "4", "--queries", "2", "--orders", "2")
    assert rc == 0
    r = res
    assert r["config"]["task"] == ICL.to_dict() and r["chance"] == 0.5
    out = capsys.readouterr().out
    assert "4 instances x 2 queries, 2 orders per kind, chance 0.50" in out
    for kind in ("random", "class_sorted", "alternating"):
        assert [len(a) for a in r[kind]["accuracy"]] == [2] * 4  # instances x orders
        line = next(ln for ln in out.splitlines() if ln.startswith(kind))
        assert f"mean accuracy {r[kind]['mean']:.3f}  best-worst {r[kind]['best_minus_worst']:.3f}" in line
        # an untrained model over 8 queries cannot clear chance + 2 standard errors (0.85)
        assert not r[kind]["above_chance"]
        assert "above chance: no" in line and "best-worst is sampling noise, not robustness" in line
        assert len(r["records"][kind]["instance_spread"]) == 4


@pytest.mark.parametrize("which", ["baseline", "null_icl"])
def test_icl_without_the_icl_task_is_a_clear_error(models, tmp_path, capsys, which):
    rc, _ = _eval("icl", models[which], tmp_path)
    assert rc == 2
    err = capsys.readouterr().err
    assert "cannot run icl: the model was trained without ICL batches" in err and "--set icl_every=4" in err


def test_attention_and_diagnostics_on_a_text_model(tmp_path, capsys):
    torch.manual_seed(0)
    folder = save_model(Transformer(ModelConfig(vocab_size=257, dim=32, n_layers=1, n_heads=2, max_seq_len=32)),
                        tmp_path / "text")
    args = ["--tokenizer", "byte", "--no-progress"]
    assert main(["eval", "attention", str(folder), *args, "--samples", "2", "--context-len", "400", "--cells", "4/2",
                 "--depths", "0.5", "--json", str(tmp_path / "a.json")]) == 0
    a = json.loads((tmp_path / "a.json").read_text())
    assert a["form"] == "text" and a["cells"]["4/2"]["n_samples"] == 2 and a["cells"]["4/2"]["accuracy"] is None
    assert {"answer", "needle", "filler", "query"} <= set(a["cells"]["4/2"]["rows"][0]["roles"])
    assert "text needle prompts, 2 per depth" in capsys.readouterr().out
    assert main(["eval", "diagnostics", str(folder), *args, "--samples", "3", "--json", str(tmp_path / "d.json")]) == 0
    d = json.loads((tmp_path / "d.json").read_text())
    assert d["lambda"] == [pytest.approx(float(load_model(folder).layers[0].attn.lambda_full().detach()))]
    assert d["head_redundancy_on"] == {"source": "the validation split of the bundled corpus", "n_samples": 3,
                                       "seq_len": 32}
    assert main(["eval", "icl", str(folder), *args]) == 2
    assert "a text model has no synthetic ICL task" in capsys.readouterr().err
    # a bare (or imported) model folder records no training length: its maximum length is used, and said so
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert main(["eval", "lm", str(folder), *args, "--data", str(text), "--json", str(tmp_path / "l.json")]) == 0
    assert "the training length is not recorded with this model: its maximum length 32" in capsys.readouterr().out
    assert json.loads((tmp_path / "l.json").read_text())["train_len_known"] is False


def _words(text: str) -> list[str]:
    return re.findall(r"\s*\S+", text)


def test_text_needle_roles_align_with_the_text():
    """Byte tokens and a toy word-level tokenizer (multi-character tokens, a leading space, the
    number's period in the same token): each token's role is that of the text it covers."""
    sample = make_text_needle_sample(3, 2, 0.5, 80, random.Random(0))
    vocab = {w: i for i, w in enumerate(dict.fromkeys(_words(sample.prompt)))}
    inv = {i: w for w, i in vocab.items()}
    byte = (lambda s: list(s.encode()), lambda ids: bytes(ids).decode())
    word = (lambda s: [vocab[w] for w in _words(s)], lambda ids: "".join(inv[i] for i in ids))
    for encode, decode in (byte, word):
        rp = text_needle_roles(sample, encode, decode)
        assert len(rp.roles) == len(rp.prompt) == len(encode(sample.prompt))
        text = {role: "".join(decode([t]) for t, r in zip(rp.prompt, rp.roles) if r == role)
                for role in (ROLE_ANSWER, ROLE_NEEDLE, ROLE_QUERY, ROLE_FILLER)}
        assert re.sub(r"\D", "", text[ROLE_ANSWER]) == sample.expected[0]
        assert not re.search(r"\d", text[ROLE_FILLER]) and "magic" not in text[ROLE_FILLER]
        assert text[ROLE_NEEDLE].count("special magic number") == 3 and "What" in text[ROLE_QUERY]
    with pytest.raises(ValueError, match="decode the needle prompt back"):
        text_needle_roles(sample, byte[0], lambda ids: bytes(ids).decode().upper())


def test_attention_to_answer_over_prompts_of_different_lengths():
    """Mixed lengths are exact: each head's mass is the mean of the masses of separate runs."""
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=NEEDLE.vocab_size, dim=32, n_layers=2, n_heads=2)).eval()
    a = needle_samples(NEEDLE, 2, 1, 0.5, 1, seed=0)[0]
    b = needle_samples(NEEDLE, 2, 1, 0.5, 1, seed=0, context_len=40)[0]
    both = attention_to_answer(model, [a, b])
    ra, rb = attention_to_answer(model, [a]), attention_to_answer(model, [b])
    for layer in (0, 1):
        for role in ("answer_heads", "noise_heads"):
            expect = [(x + y) / 2 for x, y in zip(ra["layers"][layer][role]["absolute"],
                                                  rb["layers"][layer][role]["absolute"])]
            assert both["layers"][layer][role]["absolute"] == pytest.approx(expect, abs=1e-6)


def test_head_redundancy_does_not_depend_on_the_batch_size():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2)).eval()
    tokens = torch.randint(0, 64, (5, 12))
    assert model_head_redundancy(model, tokens, batch_size=2) == pytest.approx(model_head_redundancy(model, tokens))


def test_a_bad_setting_names_its_own_flag(models, tmp_path, capsys):
    """The error listed every flag given ('flags: --samples, --cells, --batch-size'), not the one at fault."""
    rc, _ = _eval("attention", models["diff"], tmp_path, "--cells", "1/1", "--samples", "0")
    assert rc == 2
    err = capsys.readouterr().err
    assert "AttentionSettings.samples: " in err and err.rstrip().endswith("(flag --samples)"), err
