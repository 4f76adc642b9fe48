"""The one tokenizer-compatibility check (difftx.data.tokenizer.check_tokenizer_compatible): evaluation
(load_subject) and generation (load_for_generation) refuse, or warn about, the same tokenizers with the
same words."""

import warnings

import pytest

import difftx
from difftx.checkpoint import save_model
from difftx.data import ByteTokenizer, train_bpe
from difftx.data.tokenizer import check_tokenizer_compatible
from difftx.tasks.subject import load_subject
from difftx.training.checkpointing import TOKENIZER_DIR
from difftx.training.inference import load_for_generation

TEXT = " ".join(["the quick brown fox jumps over the lazy dog, and the dog sleeps on"] * 40)
CALLERS = {"eval": lambda path, tok: load_subject(path, tokenizer=tok),
           "generate": lambda path, tok: load_for_generation(path, tokenizer=tok)}


def _model(folder, vocab_size: int, bpe: bool = False):
    save_model(difftx.Transformer(difftx.preset("test").replace(vocab_size=vocab_size)), folder)
    if bpe:  # the tokenizer it was trained with, saved beside it as `difftx train` does
        train_bpe(texts=[TEXT], vocab_size=300, out_dir=folder / TOKENIZER_DIR, show_progress=False)
    return folder


def _refusals(path, tok) -> dict[str, str]:
    said = {}
    for name, load in CALLERS.items():
        with pytest.raises(ValueError) as e:
            load(path, tok)
        said[name] = str(e.value)
    return said


def test_another_tokenizer_than_the_saved_one_is_refused_alike(tmp_path):
    folder = _model(tmp_path / "bpe", 512, bpe=True)
    said = _refusals(folder, "byte")
    assert said["eval"] == said["generate"], said
    assert said["eval"].startswith(f"{folder}: --tokenizer byte (byte, 257 tokens) is not the tokenizer this model "
                                   "was trained with (bpe-") and "leave --tokenizer out" in said["eval"], said
    for own in (str(folder / TOKENIZER_DIR), None):  # its own tokenizer, named or not, is fine
        for load in CALLERS.values():
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                load(folder, own)


def test_a_tokenizer_larger_than_the_model_is_refused_alike(tmp_path):
    folder = _model(tmp_path / "small", 64)
    said = _refusals(folder, "byte")
    assert said["eval"] == said["generate"] == (f"{folder}: tokenizer byte has 257 tokens, more than the model's 64 "
                                                "token ids; use the tokenizer the model was trained with"), said
    with pytest.raises(ValueError, match="more than the model's 64 token ids"):  # eval's default: the byte tokenizer
        load_subject(folder)


def test_a_tokenizer_nothing_saved_vouches_for_warns_alike_when_sizes_differ(tmp_path):
    folder = _model(tmp_path / "bare", 512)
    tok = tmp_path / "tok"
    train_bpe(texts=[TEXT], vocab_size=300, out_dir=tok, show_progress=False)
    said = {}
    for name, load in CALLERS.items():
        with pytest.warns(UserWarning) as caught:
            load(folder, str(tok))
        said[name] = str(caught[0].message)
    assert said["eval"] == said["generate"], said
    assert "no tokenizer saved with it" in said["eval"] and "512 token ids, the tokenizer " in said["eval"], said


def test_check_tokenizer_compatible_alone(tmp_path):
    check_tokenizer_compatible(ByteTokenizer(), 257, tmp_path)  # its own size, nothing given: fine
    with pytest.raises(ValueError, match=r"tokenizer byte has 257 tokens, more than the model's 256 token ids"):
        check_tokenizer_compatible(ByteTokenizer(), 256, tmp_path)
