"""Associative recall in difftx compare: recall batches in the mixture (their own block of ids), the
recall grid on every compare model trained on them, the frontier compared per pair of arms, and
`difftx eval recall` on examples of an independent generator equal to an accuracy read off the
model's own logits."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from difftx.cli import main
from difftx.compare import get_preset
from difftx.compare.stream import CompareStream, batch_for_step, data_rng
from difftx.eval.recall import IGNORE, RecallBlock

# the smoke preset on recall alone, tiny: 3 arms, 2 seeds
RECALL = {"steps": 12, "warmup_steps": 1, "log_every": 4, "recall_every": 1, "lm_every": 0, "icl_every": 0,
          "probe_every": 4, "probe_samples": 3, "recall_vocab": 32, "recall_len": 16, "recall_pairs": [2, 3],
          "arms": ["baseline", "diff", "diff_lambda_0.8"],
          "tasks": {"recall": {"samples": 6, "attention_samples": 2}, "outliers": {"tokens": 64},
                    "diagnostics": {"samples": 2}}}


def _sets(overrides: dict, prefix: str = "") -> list[str]:
    out = []
    for k, v in overrides.items():
        out += _sets(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"--set={prefix}{k}={json.dumps(v)}"]
    return out


@pytest.fixture(scope="module")
def recall_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("recall") / "run"
    assert main(["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--workers", "1",
                 "--no-progress", *_sets(RECALL)]) == 0
    return out


def test_recall_batches_have_their_own_ids_after_the_other_tasks():
    mixed = get_preset("smoke", recall_every=5, recall_vocab=32, recall_len=16, recall_pairs=(2, 3)).resolve()
    space = mixed.space
    icl, recall = space.block("icl"), space.block("recall")
    assert icl is not None and recall.first_id == icl.vocab_size
    assert space.vocab_size == recall.end == icl.vocab_size + 32
    assert mixed.arms["diff"].vocab_size == space.vocab_size
    shares = mixed.mixture.shares()
    assert shares["recall"] > 0 and shares["needle"] > 0 and abs(sum(shares.values()) - 1) < 1e-12
    alone = get_preset("recall-cpu").resolve()
    assert list(alone.space.blocks) == ["recall"] and alone.space.block("recall").first_id == 0
    assert alone.mixture.shares() == {"needle": 0.0, "lm": 0.0, "icl": 0.0, "recall": 1.0}
    assert alone.arms["diff"].max_seq_len == 64 and alone.probes.every == 100  # recall probes
    assert alone.space.to_dict()["recall_task"]["pairs"] == [4, 8, 16]

    rng = data_rng(3)
    step = next(s for s in range(1, 20) if mixed.mixture.step_kind(s) == "recall")
    for s in range(1, step):
        batch_for_step(s, mixed.mixture, space, rng, None if space.block("lm") is None else _lm())
    kind, tokens, mask, targets = batch_for_step(step, mixed.mixture, space, rng, _lm())
    block = space.block("recall")
    assert kind == "recall" and tokens.shape[1] == block.seq_len + 1 and mask.shape == targets.shape
    assert int(tokens.min()) >= block.first_id and int(tokens.max()) < block.end
    half = block.first_id + block.vocab_size // 2
    assert bool((targets[mask] >= half).all())  # every query asks for a value
    pairs = mask.sum(1)
    assert len(set(pairs.tolist())) == 1 and int(pairs[0]) in block.pairs  # one pair count a batch


def _lm():
    from difftx.compare.stream import lm_streams

    return lm_streams()[0]


def test_the_compare_loader_keeps_the_targets_and_resumes():
    plan = get_preset("smoke", **{k: v for k, v in RECALL.items() if k not in ("arms", "tasks")}).resolve()
    stream = CompareStream(plan.mixture, plan.space, 7)
    a = stream.make_loader(batch_size=4, rank=0, world_size=2)
    b = CompareStream(plan.mixture, plan.space, 7).make_loader(batch_size=4, rank=1, world_size=2)
    x, y = a.next_batch(), b.next_batch()
    assert x.kind == "recall" and x.targets is not None and x.targets.shape == x.loss_mask.shape == (4, 16)
    assert torch.equal(x.target_tokens()[x.loss_mask], x.targets[x.loss_mask])
    assert x.mask_total == y.mask_total == int(x.loss_mask.sum() + y.loss_mask.sum())
    state = a.state_dict()
    after = a.next_batch()
    c = CompareStream(plan.mixture, plan.space, 7).make_loader(batch_size=4, rank=0, world_size=2)
    c.load_state_dict(state)
    again = c.next_batch()
    assert torch.equal(after.tokens, again.tokens) and torch.equal(after.targets, again.targets)


@pytest.mark.parametrize("fields, message", [
    ({"recall_every": 1, "recall_len": 8, "recall_pairs": (4,)},
     "recall_vocab/recall_len/recall_pairs.*seq_len >= 16"),
    ({"recall_every": 1, "recall_vocab": 8, "recall_pairs": (4,)}, "recall_pairs.*vocabulary"),
    ({"recall_every": 4, "lm_every": 2, "icl_every": 0}, "recall_every.*every recall step would be an LM or ICL step"),
    ({"recall_pairs": "a,b"}, "recall_pairs: must be positive pair counts"),
    ({"recall_pairs": (0,)}, "recall_pairs: must be positive pair counts"),
    ({"recall_every": -1}, "recall_every: must be a non-negative integer"),
    ({"recall_every": 1, "tasks": {"recall": {"lengths": (7,)}}}, "RecallSettings.lengths: must be even"),
    ({"recall_every": 1, "tasks": {"recall": {"variants": "noisy"}}}, "variants: must name some of"),
    ({"recall_every": 1, "tasks": {"recall": {"vocab_size": 64}}}, "recall block has 256 tokens"),
])
def test_bad_recall_fields_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        get_preset("smoke", **fields)


def test_text_comparisons_drop_recall_unless_synthetic():
    p = get_preset("recall-cpu")
    assert p.on_text("x.txt").recall_every == 0
    assert p.on_text("x.txt", synthetic=True).recall_every == 1


def test_every_arm_gets_a_frontier_and_paired_differences(recall_run):
    res = json.loads((recall_run / "results.json").read_text())
    assert list(res["arms"]) == ["baseline", "diff", "diff_lambda_0.8"]
    for seed in ("0", "1"):
        for arm in res["arms"]:
            r = res["runs"][seed][arm]["tasks"]["recall"]
            assert 0.0 <= r["frontier"] <= 1.0 and r["trained"]["pairs"] == [2, 3]
            cells = [c["cell"] for c in r["cells"]]
            assert "mqar L=16 P=2" in cells and "reassigned L=64 P=6" in cells  # past training: 2x pairs, 4x length
            assert [c["beyond"] for c in r["cells"] if c["cell"].startswith("mqar L=16")] == [False, False]
            assert r["attention_mass"]["cell"] == "mqar L=16 P=2" and len(r["attention_mass"]["layers"]) == 1
            roles, ratio = r["attention_roles"], r["attention_output_ratio"]  # on the attention examples
            assert roles["cell"] == ratio["cell"] == "mqar L=16 P=2" and roles["queries"] == ratio["positions"] == 4
            assert sum(roles["uniform"].values()) == pytest.approx(1.0) and len(roles["layers"]) == 1
            assert len(roles["layers"][0]["share"]["value"]) == res["arms"][arm]["config"]["n_heads"]  # per head
            assert len(ratio["ratio"]) == 1 and ratio["ratio"][0] > 0
            probes = res["runs"][seed][arm]["train"]["probes"]  # the initial model, every 4 steps and the last
            assert [p["step"] for p in probes] == [0, 4, 8, 12] and list(probes[0]["recall"]) == ["mqar L=16 P=3"]
            assert all(len(p["attention_output_ratio"]) == 1 for p in probes)
            assert all((len(p.get("lambda") or []) == 1) == (arm != "baseline") for p in probes)  # λ of DIFF
            learning = r["learning"]
            assert learning["steps"] == [0, 4, 8, 12] and learning["accuracy"] == [p["recall"]["mqar L=16 P=3"]
                                                                                   for p in probes]
            want = next((p["step"] for p in probes if p["recall"]["mqar L=16 P=3"] >= 0.5), None)
            assert learning["learned_step"] == want and learning["last_probe_step"] == 12
            assert res["runs"][seed][arm]["tasks"]["needle"]["skipped"].startswith("the model was trained on "
                                                                                    "associative recall alone")
    for key in ("diff vs baseline", "diff vs diff_lambda_0.8", "diff_lambda_0.8 vs baseline"):
        comps = res["comparisons"][key]["metrics"]
        c = comps["recall_frontier"]
        assert c["primary"] and c["bounds"] == [0.0, 1.0] and len(c["values"][c["arms"][0]]) == 2
        assert comps["recall_pairs_at_half"]["bounds"] == [2.0, 6.0]  # censored at the grid's ends
        assert not comps["recall_learned_step"]["primary"]
        want = [res["runs"][s][c["arms"][0]]["tasks"]["recall"]["frontier"] for s in ("0", "1")]
        assert c["values"][c["arms"][0]] == pytest.approx(want)
    report = (recall_run / "report.md").read_text()
    assert "## Multi-query associative recall" in report and "diff_lambda_0.8 - baseline" in report
    assert "100% associative recall (MQAR)" in report
    assert "Where each layer's heads look from a query" in report and "| diff_lambda_0.8 | 0 |" in report
    assert "| arm | layer | at step 0 | at the last probe | trained |" in report
    assert {"recall_probe.png", "recall_output_ratio.png", "recall_lambda.png"} <= {
        p.name for p in (recall_run / "plots").iterdir()}


def test_eval_recall_on_a_compare_model_repeats_compare(recall_run, tmp_path):
    stored = json.loads((recall_run / "results.json").read_text())["runs"]["1"]["diff"]["tasks"]["recall"]
    out = tmp_path / "r.json"
    assert main(["eval", "recall", str(recall_run / "seed1" / "diff" / "model"), "--samples", "6",
                 "--attention-samples", "2", "--json", str(out), "--no-progress"]) == 0
    fresh = json.loads(out.read_text())
    assert fresh["records"] == stored["records"] and fresh["frontier"] == pytest.approx(stored["frontier"])


def _independent_mqar(vocab: int, length: int, pairs: int, n: int, seed: int) -> list[dict]:
    """MQAR written from Zoology's description alone (Python's random, uniform query slots): keys from
    1..V/2-1, values from V/2..V-1, the pairs first, each key queried once later, noise elsewhere."""
    rnd = random.Random(seed)
    rows = []
    for _ in range(n):
        keys = rnd.sample(range(1, vocab // 2), pairs)
        values = rnd.sample(range(vocab // 2, vocab), pairs)
        inputs = [rnd.randrange(vocab) for _ in range(length)]
        labels = [IGNORE] * length
        for i, (k, v) in enumerate(zip(keys, values)):
            inputs[2 * i], inputs[2 * i + 1] = k, v
        slots = rnd.sample(range(pairs, length // 2), pairs)
        for k, v, slot in zip(keys, values, slots):
            inputs[2 * slot], labels[2 * slot] = k, v
        rows.append({"inputs": inputs, "labels": labels})
    return rows


def test_eval_recall_on_an_independent_file_equals_the_models_own_logits(recall_run, tmp_path):
    from difftx.checkpoint import load_model

    folder = recall_run / "seed0" / "diff_lambda_0.8" / "model"
    rows = _independent_mqar(32, 24, 3, 9, seed=11)
    path = tmp_path / "theirs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    assert main(["eval", "recall", str(folder), "--examples", str(path), "--json", str(out), "--no-progress"]) == 0
    got = json.loads(out.read_text())
    model = load_model(folder).eval()
    x = torch.tensor([r["inputs"] for r in rows])
    y = torch.tensor([r["labels"] for r in rows])
    with torch.no_grad():
        pred = model(x).argmax(-1)  # full logits at every position
    scored = y != IGNORE
    assert got["accuracy"] == pytest.approx(float((pred[scored] == y[scored]).float().mean()))
    assert got["records"]["correct"] == ((pred == y) & scored).sum(1).tolist()


def test_a_compare_model_without_recall_batches_takes_a_file_only(tmp_path, capsys):
    from difftx.tasks.recall import TASK

    block = RecallBlock(vocab_size=32, seq_len=16, pairs=(2,))
    assert block.spec(2).vocab_size == 32
    subject = type("S", (), {"is_compare_model": True, "recall": None})()
    assert "recall_every" in TASK.applies(subject, TASK.Settings())
    assert TASK.applies(subject, TASK.Settings(examples="f.jsonl")) is None


def test_a_folder_from_before_recall_is_still_resumed(tmp_path):
    """A compare.json written before the recall fields existed reads as recall_every = 0."""
    from difftx.compare.folder import ADDED_FIELDS, COMPARE_FILE, _check_folder
    from difftx.compare.schema import FOLDER_VERSION as SCHEMA_VERSION

    preset = get_preset("smoke")
    old = {k: v for k, v in preset.to_dict().items() if k not in ADDED_FIELDS}
    (tmp_path / COMPARE_FILE).write_text(json.dumps({"schema_version": SCHEMA_VERSION, "preset": old}))
    _check_folder(tmp_path, preset)  # the same comparison
    with pytest.raises(ValueError, match="other settings.*recall_every"):
        _check_folder(tmp_path, get_preset("smoke", recall_every=5))


def test_tune_chooses_each_arms_learning_rate_on_fresh_recall_examples(tmp_path):
    """`--tune lr=...` on recall alone: each model's validation loss is its recall loss on fresh examples of the
    training mixture (never the evaluation's), and the tuned comparison compares the recall metrics."""
    out = tmp_path / "tuned"
    sets = _sets({k: v for k, v in RECALL.items() if k != "arms"})
    assert main(["compare", "--preset", "smoke", "--seeds", "2", "--out", str(out), "--workers", "1",
                 "--no-progress", "--tune", "lr=0.01", *sets]) == 0
    res = json.loads((out / "results.json").read_text())
    tune = res["tune"]
    assert "recall loss at the queries" in tune["validation_source"]
    assert "recall evaluation" in tune["heldout_source"]
    assert set(tune["chosen"]["diff"].values()) <= set(tune["grid"]["diff"]) and 0.01 in tune["grid"]["diff"]
    assert "recall_frontier" in tune["tuned"]["diff vs baseline"]
    scores = json.loads((out / "seed0" / "diff" / "tune_scores.json").read_text())
    assert scores["validation"] > 0 and scores["heldout"] is None


def test_recall_batches_mix_with_the_other_tasks(tmp_path):
    """Recall every 5th step beside needle, LM and ICL batches: every task runs, the probes hold both the needle
    accuracy and the recall accuracy, and the recall grid is scored in the block's ids after the others'."""
    out = tmp_path / "mixed"
    sets = _sets({"steps": 10, "warmup_steps": 1, "log_every": 5, "probe_every": 5, "probe_samples": 1,
                  "recall_every": 5, "recall_vocab": 32, "recall_len": 16, "recall_pairs": [2, 3],
                  "tasks": {"recall": {"samples": 2, "attention_samples": 1, "lengths": [16], "variants": "mqar"},
                            "needle": {"samples_per_cell": 1, "grid": "1/1", "depths": [0.0]},
                            "attention": {"samples": 1, "cells": "1/1", "depths": [0.0]}, "lm": {"windows": 2},
                            "outliers": {"tokens": 64}, "icl": {"instances": 2, "queries": 2, "orders": 2},
                            "quant": {"bits": [4], "needle_samples": 1, "cells": "1/1", "depths": [0.0]},
                            "diagnostics": {"cell": "1/1"}}})
    assert main(["compare", "--preset", "smoke", "--seeds", "1", "--out", str(out), "--workers", "1",
                 "--no-progress", *sets]) == 0
    res = json.loads((out / "results.json").read_text())
    shares = res["mixture"]["shares"]
    assert all(shares[k] > 0 for k in ("needle", "lm", "icl", "recall"))
    run = res["runs"]["0"]["diff"]
    assert not [name for name, r in run["tasks"].items() if "skipped" in r]
    first, second = run["train"]["probes"][:2]  # the initial model: the recall probe alone
    assert first["step"] == 0 and "accuracy" not in first and {"recall", "attention_output_ratio"} <= set(first)
    assert {"accuracy", "recall", "attention_output_ratio"} <= set(second)
    from difftx.tasks.subject import CompareTask

    space = CompareTask.read(out / "seed0" / "diff" / "model").space
    recall = run["tasks"]["recall"]
    # after every other id
    assert recall["trained"]["first_id"] == space.block("icl").vocab_size == space.vocab_size - 32
    assert [c["cell"] for c in recall["cells"]] == ["mqar L=16 P=2", "mqar L=16 P=3"]
    assert recall["learning"]["steps"] == [0, 5, 10]
