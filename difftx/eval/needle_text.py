"""Multi-needle retrieval in natural language (the LWM wording, for any model with a text tokenizer): the form (b)
of :mod:`difftx.eval.needle`, scored by its rule."""

from __future__ import annotations

import random
import re
import warnings
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..generation import generate
from ..needle_cells import DEFAULT_DEPTHS, DEFAULT_GRID
from .needle import (OUTCOMES, ROLE_ANSWER, ROLE_FILLER, ROLE_NEEDLE, ROLE_QUERY, NeedleCell, NeedleResult,
                     RolePrompt, _cell_seed, classify_answer)


CITIES = (
    "Amsterdam", "Athens", "Bangkok", "Barcelona", "Beijing", "Berlin", "Bogota", "Boston", "Brussels", "Budapest",
    "Buenos Aires", "Cairo", "Cape Town", "Chicago", "Copenhagen", "Dakar", "Delhi", "Dublin", "Edinburgh",
    "Florence", "Geneva", "Hanoi", "Havana", "Helsinki", "Istanbul", "Jakarta", "Kyoto", "Lagos", "Lima", "Lisbon",
    "London", "Madrid", "Manila", "Marseille", "Melbourne", "Mexico City", "Montreal", "Moscow", "Mumbai", "Munich",
    "Nairobi", "Oslo", "Paris", "Prague", "Quito", "Reykjavik", "Rome", "Santiago", "Seoul", "Singapore",
    "Stockholm", "Sydney", "Taipei", "Tokyo", "Toronto", "Vienna", "Warsaw", "Zurich",
)

# bland filler prose written for this project; no digits, so every number in a prompt is a needle's
FILLER_SENTENCES = (
    "The morning light moved slowly across the quiet harbour.",
    "Most people in the village kept a small garden behind the house.",
    "A good habit is easier to keep than to start.",
    "The river bends twice before it reaches the old stone bridge.",
    "Some questions are answered best by waiting a little longer.",
    "The library closed early on the last day of every month.",
    "Travellers often remember the food more clearly than the museums.",
    "A steady wind kept the sailing boats close to the shore.",
    "The committee agreed to meet again after the harvest.",
    "Careful notes make the second attempt much easier than the first.",
    "The market square filled with voices as soon as the sun rose.",
    "Nobody could explain why the clock in the tower ran fast.",
    "Writing a plan down tends to reveal what is missing from it.",
    "The hills to the north were green for most of the year.",
    "An old map hung in the hallway, faded by years of sunlight.",
    "Small teams often move faster than large ones.",
    "The baker opened the shop before anyone else on the street was awake.",
    "Rain fell steadily through the afternoon and into the evening.",
    "Every spring the students planted trees along the new road.",
    "The painting showed a calm sea under a heavy grey sky.",
    "It is usually wise to read the instructions before starting.",
    "The train slowed as it climbed the long valley towards the pass.",
    "Visitors were asked to leave their umbrellas at the door.",
    "The orchestra practised the final movement until it sounded effortless.",
    "A single lamp lit the desk where the letters were written.",
    "The path through the forest was covered in fallen leaves.",
    "Good conversations rarely follow the plan anyone had for them.",
    "The ferry crossed the bay in a little under an hour.",
    "Old friends met every winter at the same small restaurant.",
    "The garden wall had been rebuilt with stones from the field.",
)


@dataclass
class TextNeedleSample:
    """One natural-language prompt; ``expected`` are the numbers as strings, in query order."""

    prompt: str
    answer: str
    cities: list[str]  # needle cities in context order
    numbers: list[str]
    query_cities: list[str]
    expected: list[str]
    depth: float
    context: str  # the haystack with needles (the prompt before the question)


def needle_sentence(city: str, number: str) -> str:
    """The LWM needle wording."""
    return f"The special magic number for {city} is: {number}."


def _question(cities: Sequence[str]) -> str:
    if len(cities) == 1:
        return (f"\nWhat is the special magic number for {cities[0]} mentioned in the provided text?"
                f"\nThe special magic number for {cities[0]} mentioned in the provided text is:")
    names = ", ".join(cities[:-1]) + " and " + cities[-1]
    return (f"\nWhat are the special magic numbers for {names} mentioned in the provided text? "
            f"Answer with the numbers in that order.\nThe special magic numbers are:")


def make_text_needle_sample(n_needles: int, n_query: int, depth: float, context_len: int, rng: random.Random, *,
                            count_tokens: Optional[Callable[[str], int]] = None,
                            value_digits: int = 7) -> TextNeedleSample:
    """LWM-style prompt whose haystack has about ``context_len`` units of ``count_tokens``
    (default: whitespace words); needles between filler sentences, the first queried city's at
    sentence boundary ``round(depth * n_sentences)``."""
    if not 1 <= n_query <= n_needles <= len(CITIES):
        raise ValueError(f"n_query/n_needles: need 1 <= R <= N <= {len(CITIES)}, got R={n_query}, N={n_needles}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth: must be in [0, 1], got {depth}")
    count = count_tokens or (lambda s: len(s.split()))
    cities = rng.sample(CITIES, n_needles)
    numbers: list[str] = []
    while len(numbers) < n_needles:
        v = str(rng.randrange(10 ** (value_digits - 1), 10 ** value_digits))
        if v not in numbers:
            numbers.append(v)
    needles = [needle_sentence(c, v) for c, v in zip(cities, numbers)]
    budget = context_len - sum(count(s + " ") for s in needles)
    if budget < 0:  # the needles alone overflow the context: the prompt would grow without bound
        raise ValueError(f"needle cell {n_needles}/{n_query}: its {n_needles} needle sentences take "
                         f"{context_len - budget} tokens, more than the context of {context_len}; choose fewer needles "
                         "or a longer context_len (--context-len)")
    sentences: list[str] = []
    used = 0
    while used < budget:
        s = rng.choice(FILLER_SENTENCES)
        sentences.append(s)
        used += count(s + " ")
    F = len(sentences)
    slots = [round(depth * F)] + [rng.randint(0, F) for _ in range(n_needles - 1)]
    tie = -1 if depth < 0.5 else 1
    order = sorted(range(n_needles), key=lambda i: (slots[i], tie if i == 0 else 0, rng.random()))
    parts, pos = [], 0
    for i in order:
        parts += sentences[pos:slots[i]]
        pos = slots[i]
        parts.append(needles[i])
    parts += sentences[pos:]
    query_idx = [0] + rng.sample(range(1, n_needles), n_query - 1)
    context = " ".join(parts)
    qc = [cities[i] for i in query_idx]
    expected = [numbers[i] for i in query_idx]
    return TextNeedleSample(context + "\n" + _question(qc), " " + ", ".join(expected), [cities[i] for i in order],
                            [numbers[i] for i in order], qc, expected, depth, context)


def score_text_answer(sample: TextNeedleSample, generated: str, value_digits: int = 7) -> list[str]:
    """Outcome per queried city: the i-th number in the generated text answers the i-th city."""
    found = re.findall(r"\d+", generated)
    out = []
    for i, exp in enumerate(sample.expected):
        pred = found[i] if i < len(found) else ""
        well = len(pred) == value_digits
        out.append(classify_answer(pred, exp, well_formed=well, in_context=well and pred in sample.context))
    return out


def check_text_context(count_tokens: Callable[[str], int], n_needles: int, context_len: int,
                       value_digits: int = 7) -> None:
    """ValueError naming ``context_len`` when it cannot hold ``n_needles`` needle sentences (the
    prompt would be needles alone, and its score meaningless)."""
    need = n_needles * count_tokens(needle_sentence(max(CITIES, key=len), "9" * value_digits) + " ")
    if context_len < need:
        raise ValueError(f"context_len: {context_len} tokens cannot hold {n_needles} needle sentence(s) of the text "
                         f"needle form ({need} tokens with this tokenizer); use at least {need}, a few times more for "
                         f"a haystack (difftx eval: --context-len)")


def warn_long_context(model: torch.nn.Module, context_len: int, n_prompts: int, batch_size: int) -> None:
    """Warn, with an estimate of the cost, when prompts of ``context_len`` tokens are longer than
    the model's ``max_seq_len`` (the context its RoPE was sized for; a run may train on shorter windows)."""
    cfg = getattr(model, "config", None)
    if cfg is None or context_len <= cfg.max_seq_len:
        return
    from ..generation import _fmt_bytes, kv_cache_bytes

    params = sum(p.numel() for p in model.parameters())
    flops = n_prompts * (2 * params * context_len + 2 * cfg.n_layers * cfg.dim * context_len ** 2)
    cache = kv_cache_bytes(model, min(batch_size, n_prompts), context_len)
    warnings.warn(f"context_len {context_len} is beyond the model's max_seq_len {cfg.max_seq_len} (its longest "
                  f"context): {n_prompts} prompts of about {context_len} tokens, roughly {flops / 1e12:.2g} TFLOP and "
                  f"{_fmt_bytes(cache)} of KV cache per batch of {min(batch_size, n_prompts)}; this may take long",
                  stacklevel=3)


def evaluate_needles_text(model: torch.nn.Module, encode: Callable[[str], list[int]],
                          decode: Callable[[list[int]], str], *, context_len: int = 512,
                          grid: Sequence[tuple[int, int]] = DEFAULT_GRID, depths: Sequence[float] = DEFAULT_DEPTHS,
                          lengths: Optional[Sequence[int]] = None, samples_per_cell: int = 50, seed: int = 0,
                          batch_size: int = 8, max_new_tokens: Optional[int] = None, stop_tokens: Sequence[int] = (),
                          value_digits: int = 7, backend: Optional[str] = None, pad_id: int = 0,
                          progress: bool = False) -> NeedleResult:
    """The natural-language form for a model with a text tokenizer (``encode``/``decode``);
    ``context_len`` (and ``lengths``) count tokens of ``encode``."""
    from tqdm.auto import tqdm

    lengths = [context_len] if lengths is None else list(lengths)
    count = lambda s: len(encode(s))  # noqa: E731
    cells, examples = [], []
    todo = [(n, r, L, d) for n, r in grid for L in lengths for d in depths]
    if todo:  # before any prompt is decoded
        check_text_context(count, min(n for n, _ in grid), min(lengths), value_digits)
        warn_long_context(model, max(lengths), len(todo) * samples_per_cell, batch_size)
    for n, r, L, d in tqdm(todo, desc="needle eval (text)", disable=not progress, leave=False):
        rng = random.Random(_cell_seed(seed, n, r, L, d))
        samples = [make_text_needle_sample(n, r, d, L, rng, count_tokens=count, value_digits=value_digits)
                   for _ in range(samples_per_cell)]
        counts = {k: 0 for k in OUTCOMES}
        per_sample = []
        new = max_new_tokens or (value_digits + 3) * r
        for i in range(0, len(samples), batch_size):
            chunk = samples[i:i + batch_size]
            gens = generate(model, [encode(s.prompt) for s in chunk], new, temperature=0.0, stop_tokens=stop_tokens,
                            backend=backend, pad_id=pad_id)
            for s, g in zip(chunk, gens):
                text = decode(g)
                res = score_text_answer(s, text, value_digits)
                per_sample.append(res.count("correct"))
                for o in res:
                    counts[o] += 1
                if len(examples) < 5 and any(o != "correct" for o in res):
                    examples.append({"n_needles": n, "n_query": r, "depth": d, "context_len": L,
                                     "expected": s.expected, "generated": text, "outcomes": res})
        cells.append(NeedleCell(n, r, L, d, len(samples), counts, per_sample))
    config = {"form": "text", "grid": [list(g) for g in grid], "depths": list(depths), "lengths": lengths,
              "samples_per_cell": samples_per_cell, "seed": seed, "value_digits": value_digits, "backend": backend}
    return NeedleResult(cells, config, examples)


class _PrefixEnds:
    """``ends[i]`` = characters of ``decode(ids[:i + 1])``, computed on demand (for bisection);
    raises where a decoded prefix is not a prefix of ``text``."""

    def __init__(self, ids: list[int], decode: Callable[[list[int]], str], text: str) -> None:
        self.ids, self.decode, self.text, self.cache = ids, decode, text, {}

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        if i not in self.cache:
            s = self.decode(self.ids[:i + 1])
            if not self.text.startswith(s):
                raise ValueError("the tokenizer's decoded prefixes are not prefixes of the prompt, so token roles "
                                 "cannot be aligned with the text")
            self.cache[i] = len(s)
        return self.cache[i]


def text_needle_roles(sample: TextNeedleSample, encode: Callable[[str], list[int]],
                      decode: Callable[[list[int]], str]) -> RolePrompt:
    """``sample``'s prompt in tokens with a role per token: *answer* where a token overlaps the
    digits of the answer needle's number (the first queried city's), *needle* where it overlaps
    any other needle sentence, *query* for the question, *filler* for the rest. Character
    offsets come from decoding prefixes of the ids, so ``decode`` must give the prompt back."""
    from bisect import bisect_left, bisect_right

    ids = list(encode(sample.prompt))
    if decode(ids) != sample.prompt:
        raise ValueError("the tokenizer does not decode the needle prompt back to itself, so token roles cannot be "
                         "aligned with the text")
    ends = _PrefixEnds(ids, decode, sample.prompt)
    roles = [ROLE_FILLER] * len(ids)

    def mark(a: int, b: int, role: int) -> None:  # every token overlapping characters [a, b)
        for i in range(bisect_right(ends, a), bisect_left(ends, b) + 1):
            roles[i] = role

    mark(len(sample.context), len(sample.prompt), ROLE_QUERY)
    for city, number in zip(sample.cities, sample.numbers):
        sentence = needle_sentence(city, number)
        start = sample.context.index(sentence)
        mark(start, start + len(sentence), ROLE_NEEDLE)
        if city == sample.query_cities[0]:
            digits = start + sentence.index(number)
            mark(digits, digits + len(number), ROLE_ANSWER)
    return RolePrompt(ids, roles)


def text_needle_probes(encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], n_needles: int,
                       n_query: int, depth: float, n_samples: int, context_len: int, seed: int = 0,
                       value_digits: int = 7) -> list[RolePrompt]:
    """The prompts of one cell of :func:`evaluate_needles_text` (same ``seed``: the same prompts)
    with a role per token (:func:`text_needle_roles`), for attention to the answer."""
    rng = random.Random(_cell_seed(seed, n_needles, n_query, context_len, depth))
    count = lambda s: len(encode(s))  # noqa: E731
    return [text_needle_roles(make_text_needle_sample(n_needles, n_query, depth, context_len, rng, count_tokens=count,
                                                      value_digits=value_digits), encode, decode)
            for _ in range(n_samples)]
