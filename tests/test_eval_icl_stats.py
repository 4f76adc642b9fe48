"""In-context learning order robustness (difftx.eval.icl) and paired statistics (difftx.eval.stats)."""

import random

import pytest
import torch
import torch.nn as nn

from difftx import Transformer, preset
from difftx.eval.icl import (
    ICLBlock,
    above_chance,
    classify,
    evaluate_icl_instances,
    make_episode,
    make_instance,
    order_demos,
    training_batch,
)

TASK = ICLBlock(n_classes=4, n_features=24, features_per_class=4, input_len=3, n_labels=6, n_demos=8)


# ---------------------------------------------------------------------------------------------
# ICL
# ---------------------------------------------------------------------------------------------

def test_episode_invariants():
    rng = random.Random(0)
    for _ in range(50):
        e = make_episode(TASK, rng)
        assert len(set(e.label_of_class)) == 4
        assert all(TASK.first_label <= lab < TASK.vocab_size for lab in e.label_of_class)
        feats = [set() for _ in range(4)]
        for x, c in e.demos:
            assert len(x) == 3 and all(TASK.first_feature <= t < TASK.first_label for t in x)
            feats[c] |= set(x)
        assert [sum(c == k for _, c in e.demos) for k in range(4)] == [2, 2, 2, 2]  # balanced
        for a in range(4):
            for b in range(a + 1, 4):
                assert not feats[a] & feats[b]  # disjoint feature sets
        p = e.prompt(TASK)
        assert len(p) == TASK.prompt_len and p[0] == TASK.BOS and p[-1] == TASK.ARROW
        assert p[-1 - TASK.input_len:-1] == e.query


def test_label_map_is_drawn_per_sequence():
    rng = random.Random(1)
    maps = {tuple(make_episode(TASK, rng).label_of_class) for _ in range(30)}
    assert len(maps) > 20


def test_orders_are_permutations():
    e = make_episode(TASK, random.Random(2))
    key = lambda d: (tuple(d[0]), d[1])  # noqa: E731
    for kind in ("random", "class_sorted", "alternating"):
        o = order_demos(e.demos, kind, random.Random(3))
        assert sorted(map(key, o)) == sorted(map(key, e.demos))
    grouped = [c for _, c in order_demos(e.demos, "class_sorted", random.Random(3))]
    assert sum(grouped[i] != grouped[i + 1] for i in range(len(grouped) - 1)) == TASK.n_classes - 1
    alt = order_demos(e.demos, "alternating", random.Random(3))
    classes = [c for _, c in alt]
    assert all(classes[i] != classes[i + 1] for i in range(len(classes) - 1))
    assert classes[:4] == classes[4:]  # round-robin with a fixed class order
    assert order_demos(e.demos, "random", random.Random(5)) == order_demos(e.demos, "random", random.Random(5))
    with pytest.raises(ValueError, match="kind"):
        order_demos(e.demos, "sorted", random.Random(0))


def test_task_validation():
    with pytest.raises(ValueError, match="n_demos"):
        ICLBlock(n_classes=3, n_demos=8)
    with pytest.raises(ValueError, match="n_features"):
        ICLBlock(n_classes=4, n_features=10, features_per_class=4)
    shifted = ICLBlock(first_id=100)
    assert shifted.BOS == 101 and shifted.vocab_size == 100 + ICLBlock().vocab_size


def test_training_batch_masks_labels():
    tokens, mask = training_batch(TASK, 4, random.Random(0))
    assert tokens.shape == (4, TASK.prompt_len + 1)
    assert int(mask.sum(1)[0]) == TASK.n_demos + 1  # every demonstration label and the query label
    assert bool(mask[:, -1].all())


class NearestDemo(nn.Module):
    """Solves the task: the label of the demonstration sharing most features with the query."""

    def __init__(self, task: ICLBlock, wrong: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.t, self.wrong = task, wrong

    def forward(self, tokens, backend=None):
        t = self.t
        logits = torch.zeros(*tokens.shape, t.vocab_size)
        for b, row in enumerate(tokens.tolist()):
            query = set(row[-1 - t.input_len:-1])
            best, lab = -1, None
            step = t.input_len + 3
            for i in range(1, len(row) - t.input_len - 1, step):
                overlap = len(query & set(row[i:i + t.input_len]))
                if overlap > best:
                    best, lab = overlap, row[i + t.input_len + 1]
            if self.wrong:  # the label of the demonstration at a position set by the query: order-sensitive
                pos = row[-1 - t.input_len] % t.n_demos
                lab = row[1 + pos * step + t.input_len + 1]
            logits[b, -1, lab] = 1.0
        return logits


def test_an_instance_keeps_its_label_map_and_demonstrations():
    queries = make_instance(TASK, random.Random(4), 8)
    assert len({(tuple(q.label_of_class), tuple(map(tuple, (d[0] for d in q.demos)))) for q in queries}) == 1
    assert sorted(q.query_class for q in queries) == [0, 0, 1, 1, 2, 2, 3, 3]  # balanced classes


def test_icl_evaluation_with_oracles():
    good = evaluate_icl_instances(NearestDemo(TASK), TASK, n_instances=5, n_queries=4, n_orders=3)
    for kind in ("random", "class_sorted", "alternating"):
        assert good[kind]["accuracy"] == [[1.0, 1.0, 1.0]] * 5
        assert good[kind]["best_minus_worst"] == 0.0
        assert good[kind]["above_chance"]
    assert good["chance"] == 0.25
    # answering with the label found at a demonstration position: order-sensitive by construction, so accuracy
    # changes with the order of one instance's demonstrations (the queries and their answers stay the same)
    bad = evaluate_icl_instances(NearestDemo(TASK, wrong=True), TASK, n_instances=10, n_queries=8, n_orders=4,
                                 kinds=("random", "class_sorted"))
    assert bad["random"]["best_minus_worst"] > 0 and bad["random"]["mean"] < 0.6
    spreads = bad["random"]["instance_spread"]
    assert bad["random"]["best_minus_worst"] == pytest.approx(sum(spreads) / len(spreads))
    # the same seed gives the same numbers
    again = evaluate_icl_instances(NearestDemo(TASK, wrong=True), TASK, n_instances=10, n_queries=8, n_orders=4,
                                   kinds=("random", "class_sorted"))
    assert again["random"] == bad["random"]


def test_above_chance():
    assert above_chance(0.40, 0.25, 200)  # 0.15 > 2 * 0.031
    assert not above_chance(0.28, 0.25, 200)
    assert not above_chance(0.20, 0.25, 200)


def test_icl_on_untrained_model():
    torch.manual_seed(0)
    model = Transformer(preset("test", vocab_size=TASK.vocab_size))
    res = evaluate_icl_instances(model, TASK, n_instances=2, n_queries=4, n_orders=2, batch_size=8)
    assert set(res) == {"config", "chance", "random", "class_sorted", "alternating"}
    assert [len(a) for a in res["random"]["accuracy"]] == [2, 2]
    preds = classify(model, TASK, [[1, 2, 3]], [[TASK.first_label + 1, TASK.first_label + 4]])
    assert preds[0] in (TASK.first_label + 1, TASK.first_label + 4)
