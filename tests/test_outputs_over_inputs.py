"""No output over an input (issue R6, item 1), as a hostile pass: every output a command writes (``--json``,
``--out``, ``--plot``, export / import / convert folders) aimed at each thing the same command reads (text, held-out
text, tokenizer, model, examples, the kinds file), at a folder that holds one, inside a folder difftx prunes (a run's
``checkpoints/``, a comparison's ``seedS/``), at a file difftx keeps, or through a link to nothing: each refused in
one line (exit 2) before any work, with nothing on disk changed. The table below is the pass; its count is in the
results log."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from difftx.cli import main
from test_errors import snapshot

DOC = Path(__file__).resolve().parents[1] / "docs" / "attention-kinds.md"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Everything the commands read, under one root: a text, a held-out text, a tokenizer, a model folder, a
    training run with checkpoints, a comparison's seed folder, recall examples and a kinds file."""
    import difftx
    import torch
    from difftx.checkpoint import save_model

    root = tmp_path_factory.mktemp("world")
    words = ["the", "miller", "carried", "a", "basket", "of", "apples", "to", "river", "lantern", "sold", "blue"]
    lines = [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(11)) for i in range(400)]
    (root / "texts").mkdir()
    (root / "texts" / "book.txt").write_text("\n".join(lines) + "\n")
    (root / "held").mkdir()
    (root / "held" / "heldout.txt").write_text("\n".join(lines[:60]) + "\n")
    (root / "ex").mkdir()
    (root / "ex" / "mine.jsonl").write_text('{"inputs": [1, 2, 3]}\n')
    (root / "kinds").mkdir()
    code = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)[0].replace('"qknorm"', '"qknorm_hostile"')
    (root / "kinds" / "mine.py").write_text(code)
    assert main(["tokenizer", "train", "--input", str(root / "texts" / "book.txt"), "--out", str(root / "tok"),
                 "--vocab-size", "300"]) == 0
    torch.manual_seed(0)
    save_model(difftx.Transformer(difftx.preset("test").replace(vocab_size=257, attention="standard")),
               root / "model")
    assert main(["train", "--preset", "test", "--set", "steps=2", "--set", "ckpt_interval=2", "--set",
                 "eval_interval=2", "--set", "log_interval=2", "--set", "batch_size=2", "--no-progress",
                 "--out", str(root / "run")]) == 0
    (root / "cmp" / "seed0" / "diff").mkdir(parents=True)
    (root / "cmp" / "compare.json").write_text("{}")
    (root / "dangling").symlink_to(root / "nowhere")
    return root


# (what, command with {root} for the world's folder, what the one line says)
CASES = [
    # eval --json
    ("eval json = --data", "eval lm {root}/model --data {root}/texts/book.txt --json {root}/texts/book.txt",
     "is --data"),
    ("eval json = --examples", "eval recall {root}/model --examples {root}/ex/mine.jsonl --json {root}/ex/mine.jsonl",
     "is --examples"),
    ("eval json = a tokenizer's file", "eval lm {root}/model --tokenizer {root}/tok --json {root}/tok/tokenizer.json",
     "belongs to the tokenizer"),
    ("eval json = a model's file", "eval lm {root}/model --json {root}/model/config.json", "belongs to the checkpoint"),
    ("eval json in checkpoints/", "eval lm {root}/model --json {root}/run/checkpoints/lm.json", "lies inside"),
    ("eval json in a seed folder", "eval lm {root}/model --json {root}/cmp/seed0/diff/lm.json", "lies inside"),
    ("eval json = the kinds file", "--kinds {root}/kinds/mine.py eval lm {root}/model --json {root}/kinds/mine.py",
     "is the kinds file"),
    ("eval json a link to nothing", "eval lm {root}/model --json {root}/dangling", "link to nothing"),
    # train --out
    ("train out = --data", "train --preset test --data {root}/texts/book.txt --out {root}/texts/book.txt",
     "is --data"),
    ("train out holds --data", "train --preset test --data {root}/texts/book.txt --out {root}/texts",
     "contains --data"),
    ("train out = --tokenizer", "train --preset test --tokenizer {root}/tok --out {root}/tok", "is --tokenizer"),
    ("train out = --init-from", "train --preset test --init-from {root}/model --out {root}/model", "is --init-from"),
    ("train out in checkpoints/", "train --preset test --out {root}/run/checkpoints/again", "lies inside"),
    ("train out in a seed folder", "train --preset test --out {root}/cmp/seed0/diff/train2", "lies inside"),
    ("train out holds the kinds file", "--kinds {root}/kinds/mine.py train --preset test --out {root}/kinds",
     "contains the kinds file"),
    ("train out a link to nothing", "train --preset test --out {root}/dangling", "link to nothing"),
    # compare --out
    ("compare out holds --data", "compare --preset smoke --data {root}/texts/book.txt --out {root}/texts",
     "contains --data"),
    ("compare out holds --heldout", "compare --preset smoke --data {root}/texts/book.txt --heldout "
     "{root}/held/heldout.txt --out {root}/held", "contains --heldout"),
    ("compare out = --tokenizer", "compare --preset smoke --data {root}/texts/book.txt --tokenizer {root}/tok "
     "--out {root}/tok", "is --tokenizer"),
    ("compare out = --from", "compare --from {root}/model --data {root}/texts/book.txt --out {root}/model",
     "is --from"),
    ("compare out in checkpoints/", "compare --preset smoke --out {root}/run/checkpoints/cmp", "lies inside"),
    ("compare out in a seed folder", "compare --preset smoke --out {root}/cmp/seed0/inner", "lies inside"),
    ("compare out holds the kinds file", "--kinds {root}/kinds/mine.py compare --preset smoke --out {root}/kinds",
     "contains the kinds file"),
    ("compare out a link to nothing", "compare --preset smoke --out {root}/dangling", "link to nothing"),
    # scale --out
    ("scale out holds --data", "scale --preset smoke --sizes 32x1x1,64x1x1 --data {root}/texts/book.txt "
     "--out {root}/texts", "contains --data"),
    ("scale out in checkpoints/", "scale --preset smoke --sizes 32x1x1,64x1x1 --out {root}/run/checkpoints/sc",
     "lies inside"),
    ("scale out a link to nothing", "scale --preset smoke --sizes 32x1x1,64x1x1 --out {root}/dangling",
     "link to nothing"),
    # tokenizer train --out
    ("tokenizer out in checkpoints/", "tokenizer train --input {root}/texts/book.txt --vocab-size 300 "
     "--out {root}/run/checkpoints/tok", "lies inside"),
    ("tokenizer over a tokenizer", "tokenizer train --input {root}/texts/book.txt --vocab-size 300 --out {root}/tok",
     "belongs to the tokenizer"),
    # runs --plot, bench --json / --plot
    ("runs plot = --data", "runs {root}/run --nll --data {root}/texts/book.txt --plot {root}/texts/book.txt",
     "is --data"),
    ("runs plot in checkpoints/", "runs {root}/run --plot {root}/run/checkpoints/curves.png", "lies inside"),
    ("runs plot = a run's file", "runs {root}/run --plot {root}/run/metrics.jsonl", "belongs to the training run"),
    ("bench json in checkpoints/", "bench --json {root}/run/checkpoints/b.json", "lies inside"),
    ("bench plot = its json", "bench --json {root}/b.json --plot {root}/b.json", "the same file"),
    # model folders written as a whole
    ("export over its model's folder", "export {root}/model {root}", "contains the checkpoint"),
    ("export in checkpoints/", "export {root}/model {root}/run/checkpoints/hf", "lies inside"),
    ("import over its source", "import {root}/model {root}/model --overwrite", "is the transformers folder"),
    ("convert over its source", "convert {root}/model {root}/model --overwrite", "is SRC"),
    ("convert in a seed folder", "convert {root}/model {root}/cmp/seed0/diff/conv", "lies inside"),
    ("convert through a link to nothing", "convert {root}/model {root}/dangling", "does not exist"),
]


@pytest.mark.parametrize("what, command, says", CASES, ids=[c[0] for c in CASES])
def test_each_output_at_each_input_is_refused_in_one_line_and_nothing_changes(what, command, says, world, capsys,
                                                                             monkeypatch):
    from difftx.attention.registry import ATTENTIONS

    monkeypatch.setenv("DIFFTX_KINDS", "")
    monkeypatch.setenv("DIFFTX_CACHE_DIR", str(world.parent / "cache"))
    before = snapshot(world)
    capsys.readouterr()
    try:
        code = main(command.format(root=world).split())
    finally:
        ATTENTIONS.pop("qknorm_hostile", None)
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and says in err, (what, err)
    assert snapshot(world) == before, what
    assert (world / "dangling").is_symlink() and not (world / "nowhere").exists()


@pytest.mark.parametrize("command", ["export {root}/model .", "convert {root}/model .", "import {root}/model ..",
                                     "export {root}/model {here}"])
def test_the_current_folder_as_a_model_output_is_refused_before_the_work(command, world, tmp_path, capsys,
                                                                        monkeypatch):
    """A model folder is written beside its path and renamed into place, which the folder a shell is in cannot be:
    refused in one line before anything is done (once it failed only after the whole job, 'Device or resource
    busy')."""
    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    monkeypatch.setenv("DIFFTX_KINDS", "")
    capsys.readouterr()
    assert main(command.format(root=world, here=here).split()) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "the current folder" in err, err
    assert not any(here.iterdir()) and not any(p.name.startswith(".") for p in tmp_path.iterdir())
