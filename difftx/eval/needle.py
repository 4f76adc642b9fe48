"""Multi-needle retrieval (SPEC section 5; paper section 3.4, after LWM / Gemini 1.5).

Two forms share one scoring rule (the text form in :mod:`difftx.eval.needle_text`):

(a) A synthetic token-level task with its own small vocabulary, small enough for a model of
    0.1-3M parameters to learn on a CPU in minutes. A prompt of exactly ``context_len``
    tokens is ``BOS haystack QUERY k_1 .. k_R ANSWER``; the haystack is filler words with
    ``N`` needles ``KEY : d d d .`` inserted; the expected continuation is
    ``v_1 SEP v_2 .. v_R EOS`` (the queried keys' value digits in query order).
(b) The natural-language form with the LWM wording (``The special magic number for {city}
    is: {number}.`` in filler prose, then a question) for any model with a text tokenizer.

Depth: the answer needle (the first queried key's) sits after ``round(depth * F)`` of the
``F`` filler units (tokens, or sentences in the text form), so depth 0 is the start of the
haystack and depth 1 its end; the other needles go at random depths.

Scoring, per queried key (exact match): a wrong answer is a *distraction* when it is a
well-formed value that occurs in the context (for these generators: another needle's value),
a *contextual hallucination* when it is well-formed and occurs nowhere in the context (an
offline proxy for the paper's section 3.6, which is judged by GPT-4o and cannot run here), and
*malformed* otherwise (wrong length, non-digits, missing).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch

from ..generation import generate
from ..needle_cells import DEFAULT_DEPTHS, DEFAULT_GRID

# roles of prompt positions (for attention-to-answer / noise)
ROLE_BOS, ROLE_FILLER, ROLE_NEEDLE, ROLE_ANSWER, ROLE_QUERY = 0, 1, 2, 3, 4
ROLE_NAMES = {ROLE_BOS: "bos", ROLE_FILLER: "filler", ROLE_NEEDLE: "needle", ROLE_ANSWER: "answer",
              ROLE_QUERY: "query"}
OUTCOMES = ("correct", "distraction", "hallucination", "malformed")


def classify_answer(predicted, expected, *, well_formed: bool, in_context: bool) -> str:
    """One of :data:`OUTCOMES` for one queried key (the rule of the module docstring)."""
    if well_formed and predicted == expected:
        return "correct"
    if not well_formed:
        return "malformed"
    return "distraction" if in_context else "hallucination"


def _contains(seq: Sequence, sub: Sequence) -> bool:
    n = len(sub)
    return n > 0 and any(list(seq[i:i + n]) == list(sub) for i in range(len(seq) - n + 1))


# ==============================================================================================
# (a) synthetic token-level form
# ==============================================================================================

@dataclass(frozen=True)
class NeedleBlock:
    """The synthetic task's block of token ids (from 0) and its sizes.

    Token ids: ``PAD=0 BOS=1 EOS=2 COLON=3 DOT=4 QUERY=5 ANSWER=6 SEP=7``, then 10 digits,
    ``n_keys`` keys and ``n_filler`` filler words (``vocab_size`` in all). ``context_len`` is
    the prompt length in tokens (everything before the first answer token).
    """

    n_keys: int = 64
    n_filler: int = 256
    value_len: int = 3
    context_len: int = 128
    max_needles: int = 6
    max_query: int = 2

    PAD = 0
    BOS = 1
    EOS = 2
    COLON = 3
    DOT = 4
    QUERY = 5
    ANSWER = 6
    SEP = 7
    DIGIT0 = 8

    def __post_init__(self) -> None:
        for name in ("n_keys", "n_filler", "value_len", "context_len", "max_needles", "max_query"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"NeedleBlock.{name}: must be a positive integer, got {v!r}")
        if self.max_query > self.max_needles:
            raise ValueError(f"NeedleBlock.max_query: {self.max_query} exceeds max_needles={self.max_needles}")
        if self.max_needles > self.n_keys:
            raise ValueError(f"NeedleBlock.n_keys: {self.n_keys} keys cannot give {self.max_needles} unique needles")
        if self.max_needles > 10 ** self.value_len:
            raise ValueError(f"NeedleBlock.value_len: {self.value_len} digits cannot give {self.max_needles} "
                             "unique values")
        self.haystack_len(self.max_needles, self.max_query, self.context_len)  # raises if it does not fit

    # -- vocabulary -------------------------------------------------------------------------------
    @property
    def first_key(self) -> int:
        return self.DIGIT0 + 10

    @property
    def first_filler(self) -> int:
        return self.first_key + self.n_keys

    @property
    def vocab_size(self) -> int:
        return self.first_filler + self.n_filler

    @property
    def needle_len(self) -> int:
        return self.value_len + 3  # KEY COLON digits DOT

    def answer_len(self, n_query: int) -> int:
        return n_query * (self.value_len + 1)  # values, SEPs between them, EOS

    @property
    def max_seq_len(self) -> int:
        """Prompt plus the longest answer: the training sequence length."""
        return self.context_len + self.answer_len(self.max_query)

    def haystack_len(self, n_needles: int, n_query: int, context_len: int) -> int:
        """Filler tokens ``F`` of a prompt; raises when the needles do not fit."""
        fill = context_len - 1 - (n_query + 2) - n_needles * self.needle_len
        if fill < 1:
            raise ValueError(f"NeedleBlock.context_len: {context_len} tokens cannot hold {n_needles} needles of "
                             f"{self.needle_len} tokens, BOS and a query of {n_query} keys")
        return fill

    def is_digit(self, tok: int) -> bool:
        return self.DIGIT0 <= tok < self.DIGIT0 + 10

    def token_name(self, tok: int) -> str:
        """Readable form of a token id (for debugging and plots)."""
        specials = {0: "<pad>", 1: "<bos>", 2: "<eos>", 3: ":", 4: ".", 5: "<q>", 6: "<a>", 7: ","}
        if tok in specials:
            return specials[tok]
        if self.is_digit(tok):
            return str(tok - self.DIGIT0)
        if self.first_key <= tok < self.first_filler:
            return f"K{tok - self.first_key}"
        return f"w{tok - self.first_filler}"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class NeedleSample:
    """One synthetic prompt with its answer and bookkeeping."""

    prompt: list[int]
    answer: list[int]  # expected continuation, EOS included
    needle_keys: list[int]  # key token of each needle, in context order
    needle_values: list[tuple[int, ...]]  # value digit tokens of each needle, in context order
    query_keys: list[int]
    expected: list[tuple[int, ...]]  # value of each queried key, in query order
    depth: float
    answer_start: int  # prompt index of the answer needle's KEY token
    roles: list[int]  # ROLE_* per prompt position

    @property
    def n_needles(self) -> int:
        return len(self.needle_keys)

    @property
    def n_query(self) -> int:
        return len(self.query_keys)


def make_needle_sample(task: NeedleBlock, n_needles: int, n_query: int, depth: float, rng: random.Random,
                       context_len: Optional[int] = None) -> NeedleSample:
    """A prompt of exactly ``context_len`` (default ``task.context_len``) tokens with
    ``n_needles`` unique keys and values; the first queried key's needle at ``depth``."""
    L = task.context_len if context_len is None else context_len
    if not 1 <= n_query <= n_needles:
        raise ValueError(f"n_query: must be in 1..n_needles={n_needles}, got {n_query}")
    if n_needles > task.n_keys or n_needles > 10 ** task.value_len:
        raise ValueError(f"n_needles: {n_needles} unique needles do not fit the task's keys/values")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: must be in [0, 1], got {depth}")
    F = task.haystack_len(n_needles, n_query, L)
    keys = rng.sample(range(task.first_key, task.first_filler), n_needles)
    values: list[tuple[int, ...]] = []
    seen: set[tuple[int, ...]] = set()
    while len(values) < n_needles:
        v = tuple(task.DIGIT0 + rng.randrange(10) for _ in range(task.value_len))
        if v not in seen:
            seen.add(v)
            values.append(v)
    # needle 0 is the answer needle (first queried key); the other queried keys are random needles
    query_idx = [0] + rng.sample(range(1, n_needles), n_query - 1)
    # insertion points in filler space: needle i goes after slots[i] filler tokens
    slots = [round(depth * F)] + [rng.randint(0, F) for _ in range(n_needles - 1)]
    # ties: the answer needle goes first at depth < 0.5, last otherwise, so depth 0 / 1 is the very edge
    tie = -1 if depth < 0.5 else 1
    order = sorted(range(n_needles), key=lambda i: (slots[i], tie if i == 0 else 0, rng.random()))
    filler = [task.first_filler + rng.randrange(task.n_filler) for _ in range(F)]

    prompt, roles = [task.BOS], [ROLE_BOS]
    ctx_keys, ctx_values, answer_start, pos = [], [], -1, 0
    for i in order:
        prompt += filler[pos:slots[i]]
        roles += [ROLE_FILLER] * (slots[i] - pos)
        pos = slots[i]
        if i == 0:
            answer_start = len(prompt)
        prompt += [keys[i], task.COLON, *values[i], task.DOT]
        val_role = ROLE_ANSWER if i == 0 else ROLE_NEEDLE
        roles += [ROLE_NEEDLE, ROLE_NEEDLE] + [val_role] * task.value_len + [ROLE_NEEDLE]
        ctx_keys.append(keys[i])
        ctx_values.append(values[i])
    prompt += filler[pos:]
    roles += [ROLE_FILLER] * (F - pos)
    qkeys = [keys[i] for i in query_idx]
    prompt += [task.QUERY, *qkeys, task.ANSWER]
    roles += [ROLE_QUERY] * (n_query + 2)
    expected = [values[i] for i in query_idx]
    answer: list[int] = []
    for j, v in enumerate(expected):
        answer += list(v) + ([task.SEP] if j < n_query - 1 else [task.EOS])
    return NeedleSample(prompt, answer, ctx_keys, ctx_values, qkeys, expected, depth, answer_start, roles)


def parse_answer(task: NeedleBlock, generated: Sequence[int], n_query: int) -> list[tuple[int, ...]]:
    """Split generated tokens (cut at EOS) on SEP into ``n_query`` groups (missing ones empty)."""
    toks = list(generated)
    if task.EOS in toks:
        toks = toks[:toks.index(task.EOS)]
    groups: list[list[int]] = [[]]
    for t in toks:
        if t == task.SEP:
            groups.append([])
        else:
            groups[-1].append(t)
    groups += [[] for _ in range(n_query - len(groups))]
    return [tuple(g) for g in groups[:n_query]]


def score_sample(task: NeedleBlock, sample: NeedleSample, generated: Sequence[int]) -> list[str]:
    """Outcome (:data:`OUTCOMES`) per queried key of one generated answer."""
    preds = parse_answer(task, generated, sample.n_query)
    haystack = sample.prompt[: len(sample.prompt) - (sample.n_query + 2)]
    out = []
    for pred, exp in zip(preds, sample.expected):
        well = len(pred) == task.value_len and all(task.is_digit(t) for t in pred)
        out.append(classify_answer(pred, exp, well_formed=well, in_context=well and _contains(haystack, pred)))
    return out


def training_batch(task: NeedleBlock, batch_size: int, rng: random.Random,
                   seq_len: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A training batch over mixed N / R / depths (the training mode of SPEC section 5).

    Returns ``tokens (B, seq_len+1)`` (prompt, answer, right-padded with PAD) and
    ``loss_mask (B, seq_len)`` aligned with the shifted targets ``tokens[:, 1:]``: True on the
    answer tokens only. N is uniform in ``1..max_needles``, R in ``1..min(N, max_query)``,
    depth uniform in [0, 1]; ``seq_len`` defaults to ``task.max_seq_len``.
    """
    L = task.max_seq_len if seq_len is None else seq_len
    if L < task.max_seq_len:
        raise ValueError(f"seq_len: {L} is shorter than the task's longest sequence {task.max_seq_len}")
    tokens = torch.full((batch_size, L + 1), task.PAD, dtype=torch.long)
    mask = torch.zeros(batch_size, L, dtype=torch.bool)
    for b in range(batch_size):
        n = rng.randint(1, task.max_needles)
        r = rng.randint(1, min(n, task.max_query))
        s = make_needle_sample(task, n, r, rng.random(), rng)
        seq = s.prompt + s.answer
        tokens[b, :len(seq)] = torch.tensor(seq)
        mask[b, len(s.prompt) - 1: len(seq) - 1] = True  # targets = the answer tokens
    return tokens, mask


# ==============================================================================================
# evaluation over the grid (shared by both forms)
# ==============================================================================================

@dataclass
class NeedleCell:
    n_needles: int
    n_query: int
    context_len: int
    depth: float
    n_samples: int
    outcomes: dict[str, int]  # counts over all queried keys
    correct_per_sample: list[int] = field(default_factory=list)  # correct keys of each prompt, in prompt order

    @property
    def n_keys(self) -> int:
        return sum(self.outcomes.values())

    @property
    def accuracy(self) -> float:
        return self.outcomes.get("correct", 0) / max(self.n_keys, 1)

    def to_dict(self) -> dict:
        return {**asdict(self), "n_keys": self.n_keys, "accuracy": self.accuracy}


@dataclass
class NeedleResult:
    """All cells of one needle evaluation, with summaries."""

    cells: list[NeedleCell]
    config: dict = field(default_factory=dict)
    examples: list[dict] = field(default_factory=list)  # a few wrong answers, for reading

    def _pool(self, pred) -> dict[str, int]:
        tot = {k: 0 for k in OUTCOMES}
        for c in self.cells:
            if pred(c):
                for k, v in c.outcomes.items():
                    tot[k] += v
        return tot

    def accuracy(self, n_needles: int, n_query: int) -> float:
        """Per-key exact match of one N/R over all depths and lengths."""
        t = self._pool(lambda c: (c.n_needles, c.n_query) == (n_needles, n_query))
        return t["correct"] / max(sum(t.values()), 1)

    def grid(self) -> list[tuple[int, int]]:
        return sorted({(c.n_needles, c.n_query) for c in self.cells})

    def accuracy_table(self) -> dict[str, float]:
        """``{"N/R": accuracy}`` in grid order."""
        return {f"{n}/{r}": self.accuracy(n, r) for n, r in self.grid()}

    def error_rates(self) -> dict[str, float]:
        """Fraction of all queried keys per outcome (correct, distraction, hallucination, malformed)."""
        t = self._pool(lambda c: True)
        n = max(sum(t.values()), 1)
        return {k: v / n for k, v in t.items()}

    def by_depth(self, n_needles: int, n_query: int) -> dict[float, float]:
        """Accuracy per depth of one N/R (all lengths pooled)."""
        out = {}
        for d in sorted({c.depth for c in self.cells}):
            t = self._pool(lambda c, d=d: (c.n_needles, c.n_query, c.depth) == (n_needles, n_query, d))
            if sum(t.values()):
                out[d] = t["correct"] / sum(t.values())
        return out

    def heatmap(self, n_needles: int, n_query: int) -> tuple[list[float], list[int], list[list[float]]]:
        """``(depths, lengths, acc)`` with ``acc[i][j]`` the accuracy at depth i, length j (NaN if absent)."""
        depths = sorted({c.depth for c in self.cells})
        lengths = sorted({c.context_len for c in self.cells})
        acc = []
        for d in depths:
            row = []
            for L in lengths:
                key = (n_needles, n_query, d, L)
                t = self._pool(lambda c, key=key: (c.n_needles, c.n_query, c.depth, c.context_len) == key)
                row.append(t["correct"] / sum(t.values()) if sum(t.values()) else float("nan"))
            acc.append(row)
        return depths, lengths, acc

    def to_dict(self) -> dict:
        return {"config": self.config, "accuracy": self.accuracy_table(), "outcome_rates": self.error_rates(),
                "by_depth": {f"{n}/{r}": {str(d): a for d, a in self.by_depth(n, r).items()} for n, r in self.grid()},
                "cells": [c.to_dict() for c in self.cells], "examples": self.examples}

    @classmethod
    def from_dict(cls, data: dict) -> "NeedleResult":
        """Rebuild from :meth:`to_dict` output (for example read back from ``results.json``)."""
        fields_ = ("n_needles", "n_query", "context_len", "depth", "n_samples", "outcomes")
        try:
            cells = [NeedleCell(**{k: c[k] for k in fields_}, correct_per_sample=list(c.get("correct_per_sample", [])))
                     for c in data["cells"]]
        except KeyError as e:
            raise ValueError(f"needle result: a cell lacks the field {e}") from None
        return cls(cells, dict(data.get("config", {})), list(data.get("examples", [])))

    def markdown(self) -> str:
        """The accuracy table as Markdown (one row, one column per N/R)."""
        tab = self.accuracy_table()
        return ("| " + " | ".join(f"N={k.split('/')[0]}, R={k.split('/')[1]}" for k in tab) + " |\n|"
                + "---|" * len(tab) + "\n| " + " | ".join(f"{v:.2f}" for v in tab.values()) + " |\n")


def _cell_seed(seed: int, n: int, r: int, length: int, depth: float) -> int:
    # a fixed seed per cell: every model sees the very same prompts in a paired comparison
    return random.Random(f"needle-cell:{seed}:{n}:{r}:{length}:{round(depth * 1000)}").getrandbits(31)


def needle_samples(task: NeedleBlock, n_needles: int, n_query: int, depth: float, n_samples: int, seed: int = 0,
                   context_len: Optional[int] = None) -> list[NeedleSample]:
    """The deterministic samples of one cell (the same for every model evaluated with ``seed``)."""
    L = task.context_len if context_len is None else context_len
    rng = random.Random(_cell_seed(seed, n_needles, n_query, L, depth))
    return [make_needle_sample(task, n_needles, n_query, depth, rng, L) for _ in range(n_samples)]


def evaluate_needles(model: torch.nn.Module, task: NeedleBlock, *, grid: Sequence[tuple[int, int]] = DEFAULT_GRID,
                     depths: Sequence[float] = DEFAULT_DEPTHS, lengths: Optional[Sequence[int]] = None,
                     samples_per_cell: int = 50, seed: int = 0, batch_size: int = 50, backend: Optional[str] = None,
                     use_cache: bool = True, max_examples: int = 5, progress: bool = False) -> NeedleResult:
    """Greedy per-key exact match of the synthetic task over N/R x depth (x length) cells."""
    from tqdm.auto import tqdm

    lengths = [task.context_len] if lengths is None else list(lengths)
    for n, r in grid:
        if not 1 <= r <= n:
            raise ValueError(f"grid: N/R = {n}/{r} needs 1 <= R <= N")
    cells, examples = [], []
    todo = [(n, r, L, d) for n, r in grid for L in lengths for d in depths]
    for n, r, L, d in tqdm(todo, desc="needle eval", disable=not progress, leave=False):
        samples = needle_samples(task, n, r, d, samples_per_cell, seed, L)
        counts = {k: 0 for k in OUTCOMES}
        per_sample = []
        for i in range(0, len(samples), batch_size):
            chunk = samples[i:i + batch_size]
            gens = generate(model, [s.prompt for s in chunk], task.answer_len(r), temperature=0.0,
                            stop_tokens=[task.EOS], backend=backend, use_cache=use_cache, pad_id=task.PAD)
            for s, g in zip(chunk, gens):
                res = score_sample(task, s, g)
                per_sample.append(res.count("correct"))
                for o in res:
                    counts[o] += 1
                if len(examples) < max_examples and any(o != "correct" for o in res):
                    examples.append({"n_needles": n, "n_query": r, "depth": d, "context_len": L,
                                     "expected": [" ".join(task.token_name(t) for t in v) for v in s.expected],
                                     "generated": " ".join(task.token_name(t) for t in g), "outcomes": res})
        cells.append(NeedleCell(n, r, L, d, len(samples), counts, per_sample))
    config = {"form": "synthetic", "task": task.to_dict(), "grid": [list(g) for g in grid], "depths": list(depths),
              "lengths": lengths, "samples_per_cell": samples_per_cell, "seed": seed, "backend": backend}
    return NeedleResult(cells, config, examples)


@dataclass
class RolePrompt:
    """A prompt in token ids and the ``ROLE_*`` of each position: all that
    :func:`difftx.eval.attention_noise.attention_to_answer` reads from a sample."""

    prompt: list[int]
    roles: list[int]
