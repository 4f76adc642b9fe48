"""Multi-query associative recall (issue 39 item 1): Zoology's MQAR definition and the reassigned-keys
variant, generated the same for the same seed; example files read and written as JSONL, a bad file a
one-line error naming the line; scoring at every labelled position; `difftx eval recall`."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from difftx.cli import main
from difftx.eval.recall import IGNORE, RecallExamples, RecallSpec, generate, read_examples, score, write_examples
from test_errors import run_cli


def test_mqar_follows_zoologys_definition():
    spec = RecallSpec(vocab_size=64, seq_len=40, n_pairs=5)
    ex = generate(spec, 50, seed=3)
    x, y = ex.inputs.numpy(), ex.labels.numpy()
    assert x.shape == y.shape == (50, 40) and x.min() >= 0 and x.max() < 64
    for i in range(50):
        keys, values = x[i, 0:10:2], x[i, 1:10:2]
        assert len(set(keys)) == 5 and ((1 <= keys) & (keys < 32)).all()  # keys from the lower half, never 0
        assert len(set(values)) == 5 and ((32 <= values) & (values < 64)).all()  # values from the upper half
        scored = np.flatnonzero(y[i] != IGNORE)
        assert len(scored) == 5 and (scored >= 10).all() and ((scored - 10) % 2 == 0).all()  # the query region
        assert sorted(x[i, scored]) == sorted(keys)  # each key queried once
        binding = dict(zip(keys, values))
        assert [binding[k] for k in x[i, scored]] == list(y[i, scored])  # the label: the key's value
        assert list(ex.key_pos[i, scored]) == [2 * list(keys).index(k) for k in x[i, scored]]
    same = generate(spec, 50, seed=3)
    assert torch.equal(same.inputs, ex.inputs) and torch.equal(same.labels, ex.labels)
    assert not torch.equal(generate(spec, 50, seed=4).inputs, ex.inputs)


def test_query_gaps_follow_the_power_law():
    """P(gap g) ~ a (g+1)^(a-1) with a = 0.01: nearly 1/(g+1), so the first gap is far more common than
    the tenth; with a = 1 the gaps are uniform."""
    def gaps(power_a):
        ex = generate(RecallSpec(vocab_size=512, seq_len=104, n_pairs=2, power_a=power_a), 3000, seed=0)
        g = (np.argwhere(ex.labels.numpy() != IGNORE)[:, 1] - 4) // 2
        return np.bincount(g, minlength=50)

    skewed, flat = gaps(0.01), gaps(1.0)
    assert skewed[0] > 5 * skewed[9] > 0 and skewed[:5].sum() > skewed[25:].sum()
    assert 0.5 < flat[:25].sum() / flat[25:].sum() < 2.0


def test_reassigned_keys_ask_for_the_latest_value():
    spec = RecallSpec(vocab_size=128, seq_len=48, n_pairs=6, variant="reassigned", reassign=0.5)
    assert spec.reassigned == 3 and spec.context == 18
    ex = generate(spec, 40, seed=1)
    x, y, again = ex.inputs.numpy(), ex.labels.numpy(), ex.rebound.numpy()
    for i in range(40):
        first = dict(zip(x[i, 0:12:2], x[i, 1:12:2]))
        later = dict(zip(x[i, 12:18:2], x[i, 13:18:2]))
        assert len(later) == 3 and set(later) <= set(first) and all(later[k] != first[k] for k in later)
        for q in np.flatnonzero(y[i] != IGNORE):
            k = x[i, q]
            assert y[i, q] == later.get(k, first[k]) and again[i, q] == (k in later)
            assert x[i, ex.key_pos[i, q]] == k and x[i, ex.key_pos[i, q] + 1] == y[i, q]


@pytest.mark.parametrize("fields, message", [
    ({"seq_len": 15}, "must be even"),
    ({"seq_len": 8, "n_pairs": 3}, "need seq_len >= 12"),
    ({"vocab_size": 6, "n_pairs": 3}, "pairs need at least 8 tokens"),
    ({"variant": "noisy"}, "must be one of ('mqar', 'reassigned')"),
    ({"power_a": 0.0}, "power_a: must be in (0, 1]"),
    ({"variant": "reassigned", "seq_len": 16, "n_pairs": 4}, "need seq_len >= 20"),
])
def test_bad_specs_are_named(fields, message):
    with pytest.raises(ValueError, match="RecallSpec") as e:
        RecallSpec(**{"vocab_size": 64, "seq_len": 32, "n_pairs": 4, **fields})
    assert message in str(e.value)


def test_examples_round_trip_through_jsonl(tmp_path):
    ex = generate(RecallSpec(vocab_size=64, seq_len=24, n_pairs=3), 7, seed=2)
    path = write_examples(ex, tmp_path / "ex.jsonl")
    first = json.loads(path.read_text().splitlines()[0])
    assert set(first) == {"inputs", "labels"} and len(first["inputs"]) == len(first["labels"]) == 24
    back = read_examples(path, vocab_size=64)
    assert torch.equal(back.inputs, ex.inputs) and torch.equal(back.labels, ex.labels) and back.key_pos is None


@pytest.mark.parametrize("lines, message", [
    (['{"inputs": [1, 2], "labels": [-100, 3]}', "not json"], "line 2: not JSON"),
    (['{"inputs": [1, 2], "labels": [-100, 3]}', '{"inputs": [1, 2, 3], "labels": [-100, 3, -100]}'],
     "line 2: 3 tokens, where the first example has 2"),
    (['{"inputs": [1, 99], "labels": [-100, 3]}'], "line 1: token 99 is outside the model's vocabulary 0..63"),
    (['{"inputs": [1, 2], "labels": [-100, 64]}'], "line 1: label 64 is outside"),
    (['{"inputs": [1, 2], "labels": [-100, -100]}'], "line 1: no scored position"),
    (['{"inputs": [1, 2], "labels": [3]}'], "line 1: \"inputs\" has 2 tokens and \"labels\" 1"),
    (['{"inputs": [1, 2.5], "labels": [3, 4]}'], "line 1: \"inputs\" must be a non-empty list of integers"),
    (['[1, 2]'], "line 1: expected an object with \"inputs\" and \"labels\""),
    ([], "no examples"),
])
def test_a_bad_file_names_its_line(tmp_path, capsys, trained_run, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    with pytest.raises(ValueError, match="bad.jsonl") as e:
        read_examples(path, vocab_size=64)
    assert message in str(e.value)
    if "vocabulary" not in message and "label 64" not in message:  # the model's vocabulary is 257 bytes
        code, err = run_cli(capsys, "eval", "recall", str(trained_run), "--examples", str(path))
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


class _Oracle(torch.nn.Module):
    """A stand-in model that knows the answers: at the labelled positions all its mass is on the label,
    except at the labelled positions numbered in ``wrong`` (counted over one forward pass)."""

    def __init__(self, ex: RecallExamples, wrong=()):
        super().__init__()
        self.config = type("C", (), {"vocab_size": 64, "max_seq_len": 64})()
        self.answers = {tuple(x.tolist()): y for x, y in zip(ex.inputs, ex.labels)}
        self.wrong = set(wrong)

    def forward(self, x, logits_at):
        picked = torch.stack([self.answers[tuple(row.tolist())] for row in x])[logits_at]
        out = torch.zeros(len(picked), 64)
        out[torch.arange(len(picked)), picked] = 1.0
        for n in self.wrong:
            out[n] = torch.roll(out[n], 1)
        return out


def test_score_counts_every_labelled_position():
    ex = generate(RecallSpec(vocab_size=64, seq_len=32, n_pairs=4, variant="reassigned"), 10, seed=0)
    model = _Oracle(ex)
    res = score(model, ex, batch_size=100)
    assert res["accuracy"] == 1.0 and res["scored"] == 40 and res["records"]["labelled"] == [4] * 10
    assert res["accuracy_rebound"] == 1.0 and res["accuracy_kept"] == 1.0
    model.wrong = {0, 5}  # two wrong answers: example 0's first query and example 1's second
    res = score(model, ex, batch_size=100)
    assert res["accuracy"] == 38 / 40 and res["records"]["correct"][:3] == [3, 3, 4]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("recall") / "run"
    assert main(["train", "--preset", "test", "--set", "steps=2", "--out", str(run), "--no-progress"]) == 0
    return run


def test_eval_recall_command(tmp_path, capsys, trained_run):
    ex = generate(RecallSpec(vocab_size=257, seq_len=32, n_pairs=4), 12, seed=5)
    path = write_examples(ex, tmp_path / "mine.jsonl")
    out = tmp_path / "r.json"
    assert main(["eval", "recall", str(trained_run), "--examples", str(path), "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "recall accuracy" in printed and "48 queries in 12 examples" in printed
    res = json.loads(out.read_text())
    assert res["records"]["labelled"] == [4] * 12 and len(res["records"]["correct"]) == 12
    assert res["settings"]["examples"] == str(path) and res["cells"][0]["cell"] == "file"
    assert main(["eval", "recall", str(trained_run), "--lengths", "32,64", "--pairs", "4", "--samples", "8",
                 "--variants", "reassigned", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["spec"]["vocab_size"] == 257 and res["examples"] == 16 and "accuracy_rebound" in res["cells"][0]
    assert [c["cell"] for c in res["cells"]] == ["reassigned L=32 P=4", "reassigned L=64 P=4"]
    assert res["chance"] == pytest.approx(1 / 129) and res["frontier"] is None  # no plain-MQAR cell
    code, err = run_cli(capsys, "eval", "recall", str(trained_run), "--lengths", "31")
    assert code == 2 and "must be even" in err


def test_recall_source_batches_split_by_rank_and_resume():
    from difftx.eval.recall import RecallSource

    specs = [RecallSpec(vocab_size=32, seq_len=16, n_pairs=2), RecallSpec(vocab_size=32, seq_len=24, n_pairs=3)]
    source = RecallSource(specs, seed=4)
    cfg = type("C", (), {"batch_size": 4})()
    one = source.make_loader(cfg)
    a, b = one.next_batch(), one.next_batch()
    assert a.tokens.shape == (4, 17) and b.tokens.shape == (4, 25) and a.kind == "recall"  # the mixture in turn
    assert a.loss_mask.sum(1).tolist() == [2] * 4 and a.mask_total == 8
    assert bool((a.targets[a.loss_mask] >= 16).all()) and bool((a.targets[~a.loss_mask] == 0).all())
    halves = [RecallSource(specs, seed=4).make_loader(None, type("D", (), {"rank": r, "world_size": 2})(),
                                                      batch_size=2) for r in (0, 1)]
    first = [h.next_batch() for h in halves]
    assert torch.equal(torch.cat([f.tokens for f in first]), a.tokens) and first[0].mask_total == 8
    state = one.state_dict()
    c = one.next_batch()
    again = RecallSource(specs, seed=4).make_loader(cfg)
    again.load_state_dict(state)
    assert torch.equal(again.next_batch().tokens, c.tokens)
    with pytest.raises(ValueError, match="seed 4"):
        RecallSource(specs, seed=5).make_loader(cfg).load_state_dict(state)


def test_a_model_learns_recall_from_the_source(tmp_path):
    """The trainer takes the source's targets (the values, where the next input is noise): a small model
    learns MQAR well above chance in a few hundred steps, and a stack of two trains on it too."""
    from difftx.checkpoint import load_model
    from difftx.config import ModelConfig
    from difftx.eval.recall import RecallSource
    from difftx.training import TrainConfig, train, train_stacked

    spec = RecallSpec(vocab_size=32, seq_len=16, n_pairs=2)
    mc = ModelConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, max_seq_len=16)

    def config(out, seed=0, steps=250):
        return TrainConfig(model=mc.to_dict(), seq_len=16, batch_size=32, steps=steps, lr=3e-3, warmup_steps=10,
                           eval_interval=0, log_interval=50, ckpt_interval=steps, out_dir=str(out), progress=False,
                           seed=seed)

    res = train(config(tmp_path / "one"), data=RecallSource([spec], seed=0), model_config=mc)
    acc = score(load_model(res.last_checkpoint), generate(spec, 200, seed=9))["accuracy"]
    assert acc > 4 / 16, acc  # chance: 1 of the 16 values
    stacked = train_stacked([config(tmp_path / f"s{i}", seed=i, steps=20) for i in (0, 1)],
                            data=[RecallSource([spec], seed=i) for i in (0, 1)], model_config=mc)
    assert [r.step for r in stacked] == [20, 20]


def test_attention_mass_splits_each_query_row():
    """At every query, each layer's L1-normalised row: its mass on the binding asked for (the key and its
    value) and on every other position read sum to 1 (the absolute variant); a file's examples say nothing
    of where the binding is, so they are refused."""
    from difftx.config import ModelConfig
    from difftx.eval.recall import attention_mass
    from difftx.model import Transformer

    torch.manual_seed(0)
    ex = generate(RecallSpec(vocab_size=64, seq_len=32, n_pairs=4), 6, seed=0)
    for kind in ("diff", "standard"):
        model = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=32, attention=kind))
        res = attention_mass(model, ex, batch_size=4)
        assert res["queries"] == 24 and len(res["layers"]) == 2
        for layer in res["layers"]:
            assert layer["answer_mean"]["absolute"] + layer["noise_mean"]["absolute"] == pytest.approx(1.0, abs=1e-5)
            assert 0 < layer["answer_mean"]["absolute"] < 1
    with pytest.raises(ValueError, match="needs generated examples"):
        attention_mass(model, RecallExamples(ex.inputs, ex.labels))


def test_the_printed_pairs_at_half_says_when_it_is_censored(capsys):
    """'pairs at 50% 8.0' at accuracy 0 read as a measured crossing; it is the grid's end."""
    from difftx.tasks.recall import TASK

    cells = [{"cell": f"mqar {n}", "variant": "mqar", "n_pairs": n, "seq_len": 64, "accuracy": a}
             for n, a in ((8, 0.0), (16, 0.0))]
    base = {"accuracy": 0.0, "scored": 10, "examples": 2, "source": "x", "frontier": 0.0, "cells": cells}
    TASK.print({**base, "pairs_at_half": 8.0})
    assert "pairs at 50% 8.0 (at or below the grid's fewest: censored)" in capsys.readouterr().out
    TASK.print({**base, "pairs_at_half": 16.0})
    assert "pairs at 50% 16.0 (at or above the grid's most: censored)" in capsys.readouterr().out
    TASK.print({**base, "pairs_at_half": 11.3})
    out = capsys.readouterr().out
    assert "pairs at 50% 11.3\n" in out
