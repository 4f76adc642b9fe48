"""Multi-needle retrieval (difftx.eval.needle): generator invariants, scoring, evaluation."""

import json
import random

import pytest
import torch
import torch.nn as nn

from difftx import Transformer, preset
from difftx.eval.needle import (
    ROLE_ANSWER,
    ROLE_BOS,
    ROLE_FILLER,
    ROLE_NEEDLE,
    ROLE_QUERY,
    NeedleBlock,
    NeedleResult,
    classify_answer,
    evaluate_needles,
    make_needle_sample,
    needle_samples,
    parse_answer,
    score_sample,
    training_batch,
)
from difftx.eval.needle_text import (
    CITIES,
    evaluate_needles_text,
    make_text_needle_sample,
    needle_sentence,
    score_text_answer,
)


TASK = NeedleBlock(n_keys=16, n_filler=20, value_len=3, context_len=48, max_needles=6, max_query=2)


@pytest.mark.parametrize("n,r", [(1, 1), (2, 2), (4, 2), (6, 2)])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.75, 1.0])
def test_generator_invariants(n, r, depth):
    t = TASK
    rng = random.Random(f"{n}{r}{depth}")
    for _ in range(20):
        s = make_needle_sample(t, n, r, depth, rng)
        assert len(s.prompt) == t.context_len == len(s.roles)  # exact context length
        assert s.prompt[0] == t.BOS and s.prompt[-1] == t.ANSWER
        assert len(set(s.needle_keys)) == n and len(set(s.needle_values)) == n  # unique keys and values
        assert len(s.query_keys) == r == len(set(s.query_keys))
        # every needle appears once, verbatim, and keys/digits appear nowhere else in the haystack
        hay = s.prompt[1: t.context_len - (r + 2)]
        for k, v in zip(s.needle_keys, s.needle_values):
            i = hay.index(k)
            assert hay[i:i + t.needle_len] == [k, t.COLON, *v, t.DOT]
        assert sum(t.first_key <= x < t.first_filler for x in hay) == n
        assert sum(t.is_digit(x) for x in hay) == n * t.value_len
        # the answer needle is the first queried key's, at the requested depth (in filler tokens)
        F = t.haystack_len(n, r, t.context_len)
        key0 = s.query_keys[0]
        start = s.prompt.index(key0)
        assert start == s.answer_start
        assert sum(role == ROLE_FILLER for role in s.roles[:start]) == round(depth * F)
        if depth == 0.0:
            assert start == 1
        if depth == 1.0:
            assert start + t.needle_len == t.context_len - (r + 2)
        # roles
        assert s.roles[0] == ROLE_BOS and s.roles[-(r + 2):] == [ROLE_QUERY] * (r + 2)
        ans_pos = [i for i, role in enumerate(s.roles) if role == ROLE_ANSWER]
        assert [s.prompt[i] for i in ans_pos] == list(s.expected[0])
        assert all(t.first_filler <= s.prompt[i] for i, role in enumerate(s.roles) if role == ROLE_FILLER)
        assert sum(role in (ROLE_NEEDLE, ROLE_ANSWER) for role in s.roles) == n * t.needle_len
        # the expected answer
        assert len(s.answer) == t.answer_len(r) and s.answer[-1] == t.EOS
        assert parse_answer(t, s.answer, r) == s.expected
        assert s.expected == [s.needle_values[s.needle_keys.index(k)] for k in s.query_keys]


def test_generator_validation_and_determinism():
    with pytest.raises(ValueError, match="context_len"):
        NeedleBlock(context_len=20, max_needles=6)
    with pytest.raises(ValueError, match="n_query"):
        make_needle_sample(TASK, 2, 3, 0.5, random.Random(0))
    with pytest.raises(ValueError, match="depth"):
        make_needle_sample(TASK, 2, 1, 1.5, random.Random(0))
    a = needle_samples(TASK, 4, 2, 0.5, 3, seed=7)
    b = needle_samples(TASK, 4, 2, 0.5, 3, seed=7)
    c = needle_samples(TASK, 4, 2, 0.5, 3, seed=8)
    assert [s.prompt for s in a] == [s.prompt for s in b] != [s.prompt for s in c]
    assert TASK.vocab_size == 8 + 10 + 16 + 20


def test_longer_context_is_exact():
    s = make_needle_sample(TASK, 3, 2, 0.25, random.Random(1), context_len=100)
    assert len(s.prompt) == 100


def test_scoring_classifies_every_wrong_answer():
    t = TASK
    s = make_needle_sample(t, 4, 2, 0.5, random.Random(3))
    other = next(v for v in s.needle_values if v not in s.expected)
    absent = next(tuple(t.DIGIT0 + d for d in (a, b, c)) for a in range(10) for b in range(10) for c in range(10)
                  if tuple(t.DIGIT0 + d for d in (a, b, c)) not in s.needle_values)
    e0, e1 = list(s.expected[0]), list(s.expected[1])
    assert score_sample(t, s, e0 + [t.SEP] + e1 + [t.EOS]) == ["correct", "correct"]
    assert score_sample(t, s, e0 + [t.SEP] + list(other) + [t.EOS]) == ["correct", "distraction"]
    assert score_sample(t, s, list(absent) + [t.SEP] + e1) == ["hallucination", "correct"]  # no EOS is fine
    assert score_sample(t, s, e1 + [t.SEP] + e0 + [t.EOS]) == ["distraction", "distraction"]  # swapped
    assert score_sample(t, s, e0[:2] + [t.SEP] + e1 + [t.EOS]) == ["malformed", "correct"]  # too short
    assert score_sample(t, s, e0 + [t.EOS]) == ["correct", "malformed"]  # missing
    assert score_sample(t, s, [t.first_filler] * 3 + [t.SEP] + e1) == ["malformed", "correct"]  # not digits
    assert score_sample(t, s, e0 + [t.EOS, t.SEP] + e1) == ["correct", "malformed"]  # text after EOS ignored
    assert classify_answer("1", "1", well_formed=False, in_context=True) == "malformed"


def test_training_batch_masks_answers():
    tokens, mask = training_batch(TASK, 16, random.Random(0))
    assert tokens.shape == (16, TASK.max_seq_len + 1) and mask.shape == (16, TASK.max_seq_len)
    for b in range(16):
        tgt = tokens[b, 1:][mask[b]].tolist()
        assert tgt[-1] == TASK.EOS and all(TASK.is_digit(x) or x == TASK.SEP for x in tgt[:-1])
        first = int(mask[b].nonzero()[0])
        assert first == TASK.context_len - 1  # the prompt is exactly context_len tokens
        assert int(tokens[b, first]) == TASK.ANSWER


class Oracle(nn.Module):
    """Reads the prompt and emits the right answer (or the value of another needle)."""

    def __init__(self, task: NeedleBlock, distract: bool = False):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.t, self.distract = task, distract

    def _answer(self, seq):
        t = self.t
        q = seq.index(t.QUERY)
        keys = seq[q + 1: seq.index(t.ANSWER, q)]
        values = {seq[i]: seq[i + 2: i + 2 + t.value_len] for i in range(q) if t.first_key <= seq[i] < t.first_filler}
        if self.distract:
            others = [k for k in values if k not in keys]
            keys = [others[0] if others else keys[0]] + keys[1:]
        ans = []
        for j, k in enumerate(keys):
            ans += values[k] + ([t.SEP] if j < len(keys) - 1 else [t.EOS])
        return ans

    def forward(self, tokens, backend=None):
        B, T = tokens.shape
        logits = torch.zeros(B, T, self.t.vocab_size)
        for b, row in enumerate(tokens.tolist()):
            a = row.index(self.t.ANSWER)
            done = T - 1 - a
            logits[b, -1, self._answer(row)[done]] = 1.0
        return logits


def test_evaluate_needles_with_an_oracle():
    res = evaluate_needles(Oracle(TASK), TASK, samples_per_cell=3, depths=(0.0, 1.0), use_cache=False)
    assert res.accuracy_table() == {"1/1": 1.0, "2/2": 1.0, "4/2": 1.0, "6/2": 1.0}
    assert res.error_rates()["correct"] == 1.0
    bad = evaluate_needles(Oracle(TASK, distract=True), TASK, grid=((4, 2),), samples_per_cell=4, depths=(0.5,),
                           use_cache=False)
    assert bad.accuracy(4, 2) == pytest.approx(0.5)  # first key wrong, second right
    assert bad.error_rates()["distraction"] == pytest.approx(0.5)
    assert bad.examples and bad.examples[0]["outcomes"] == ["distraction", "correct"]


def test_evaluate_needles_end_to_end_untrained_model():
    torch.manual_seed(0)
    model = Transformer(preset("test", vocab_size=TASK.vocab_size))
    res = evaluate_needles(model, TASK, samples_per_cell=2, depths=(0.0, 0.5), lengths=(48, 56), batch_size=2)
    d = res.to_dict()
    assert set(d) == {"config", "accuracy", "outcome_rates", "by_depth", "cells", "examples"}
    assert list(d["accuracy"]) == ["1/1", "2/2", "4/2", "6/2"]
    assert len(d["cells"]) == 4 * 2 * 2
    for c in d["cells"]:
        assert c["n_keys"] == 2 * c["n_query"] and 0 <= c["accuracy"] <= 1
        assert set(c["outcomes"]) == {"correct", "distraction", "hallucination", "malformed"}
    assert sum(d["outcome_rates"].values()) == pytest.approx(1.0)
    depths, lengths, acc = res.heatmap(2, 2)
    assert depths == [0.0, 0.5] and lengths == [48, 56] and len(acc) == 2 and len(acc[0]) == 2
    assert "N=1, R=1" in res.markdown()
    back = NeedleResult.from_dict(json.loads(json.dumps(d)))
    assert back.to_dict() == json.loads(json.dumps(d))
    # cached and uncached greedy decoding agree
    cached = evaluate_needles(model, TASK, grid=((6, 2),), samples_per_cell=4, depths=(0.5,), max_examples=10)
    uncached = evaluate_needles(model, TASK, grid=((6, 2),), samples_per_cell=4, depths=(0.5,), use_cache=False,
                                max_examples=10)
    assert cached.cells[0].outcomes == uncached.cells[0].outcomes
    assert [e["generated"] for e in cached.examples] == [e["generated"] for e in uncached.examples]


def test_text_form_and_scoring():
    rng = random.Random(0)
    s = make_text_needle_sample(4, 2, 0.5, 150, rng)
    assert len(set(s.cities)) == 4 and len(set(s.numbers)) == 4
    assert all(len(n) == 7 for n in s.numbers)
    for c, n in zip(s.cities, s.numbers):
        assert needle_sentence(c, n) in s.prompt
    assert s.expected == [s.numbers[s.cities.index(c)] for c in s.query_cities]
    assert all(c in s.prompt.split("\n")[-2] for c in s.query_cities)
    assert sum(ch.isdigit() for ch in s.context) == 4 * 7  # only needles carry digits
    assert abs(len(s.context.split()) - 150) < 20
    other = next(n for n in s.numbers if n not in s.expected)
    assert score_text_answer(s, s.answer) == ["correct", "correct"]
    assert score_text_answer(s, f" {s.expected[0]}, {other}") == ["correct", "distraction"]
    assert score_text_answer(s, f" 1234567 and {s.expected[1]}") == ["hallucination", "correct"]
    assert score_text_answer(s, " 12 then nothing") == ["malformed", "malformed"]
    # depth 0 / 1: the answer sentence is first / last in the haystack
    first = make_text_needle_sample(3, 1, 0.0, 80, random.Random(1))
    assert first.context.startswith(needle_sentence(first.query_cities[0], first.expected[0]))
    last = make_text_needle_sample(3, 1, 1.0, 80, random.Random(1))
    assert last.context.endswith(needle_sentence(last.query_cities[0], last.expected[0]))
    assert len(CITIES) >= 50


def test_text_form_end_to_end_bytes():
    torch.manual_seed(0)
    model = Transformer(preset("tiny"))
    enc = lambda s: list(s.encode("utf-8"))  # noqa: E731
    dec = lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace")  # noqa: E731
    res = evaluate_needles_text(model, enc, dec, context_len=160, grid=((2, 1),), depths=(0.5,), samples_per_cell=2,
                                batch_size=2, max_new_tokens=6)

    assert res.cells[0].n_keys == 2 and res.config["form"] == "text"
    assert res.cells[0].outcomes["correct"] == 0  # an untrained byte model does not know the numbers
