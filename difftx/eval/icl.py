"""In-context learning order robustness (SPEC section 5; paper section 3.5), synthetic form.

An episode is a classification problem drawn afresh for every sequence: ``n_classes`` classes,
each owning a disjoint set of feature tokens, and a random *label map* assigning each class a
label token. An input is ``input_len`` feature tokens of its class. The prompt is
``BOS (x -> y ;) * n_demos x_query ->`` and the model must name the query's label, which it
can only learn from the demonstrations. The prediction is the arg-max of the next-token logits
over the episode's label tokens (constrained classification).

Robustness: the *same* demonstrations are shown in several orders: ``random`` (a seeded
shuffle) and ``alternating`` (round-robin by class, class order and within-class order seeded).
For each order kind, accuracy is measured per order seed over the same episodes; the metric is
best - worst accuracy over the order seeds (lower is more robust), with the mean accuracy.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

ORDER_KINDS = ("random", "alternating")


@dataclass(frozen=True)
class ICLTask:
    """Vocabulary and sizes. Local ids: ``PAD=0 BOS=1 ARROW=2 SEP=3``, then ``n_features``
    feature tokens, then ``n_labels`` label tokens; every id is offset by ``first_id`` so the
    task can share a vocabulary with another (for example after a :class:`NeedleTask`)."""

    n_classes: int = 4
    n_features: int = 48
    features_per_class: int = 4
    input_len: int = 3
    n_labels: int = 8
    n_demos: int = 16
    first_id: int = 0

    def __post_init__(self) -> None:
        for name in ("n_classes", "n_features", "features_per_class", "input_len", "n_labels", "n_demos"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ICLTask.{name}: must be a positive integer, got {v!r}")
        if self.n_classes < 2:
            raise ValueError(f"ICLTask.n_classes: need at least 2 classes, got {self.n_classes}")
        if self.n_classes * self.features_per_class > self.n_features:
            raise ValueError(f"ICLTask.n_features: {self.n_features} cannot give {self.n_classes} classes "
                             f"{self.features_per_class} disjoint features each")
        if self.n_labels < self.n_classes:
            raise ValueError(f"ICLTask.n_labels: {self.n_labels} label tokens for {self.n_classes} classes")
        if self.n_demos % self.n_classes:
            raise ValueError(f"ICLTask.n_demos: {self.n_demos} must be a multiple of n_classes={self.n_classes} "
                             "(balanced demonstrations)")
        if self.first_id < 0:
            raise ValueError(f"ICLTask.first_id: must be >= 0, got {self.first_id}")

    @property
    def PAD(self) -> int:
        return self.first_id

    @property
    def BOS(self) -> int:
        return self.first_id + 1

    @property
    def ARROW(self) -> int:
        return self.first_id + 2

    @property
    def SEP(self) -> int:
        return self.first_id + 3

    @property
    def first_feature(self) -> int:
        return self.first_id + 4

    @property
    def first_label(self) -> int:
        return self.first_feature + self.n_features

    @property
    def vocab_size(self) -> int:
        """Ids ``0 .. vocab_size-1`` cover the task (including the ``first_id`` offset)."""
        return self.first_label + self.n_labels

    @property
    def prompt_len(self) -> int:
        return 1 + self.n_demos * (self.input_len + 3) + self.input_len + 1

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Episode:
    """One classification problem: demonstrations ``(input, class)`` and a query."""

    label_of_class: list[int]  # label token of each class
    demos: list[tuple[list[int], int]]
    query: list[int]
    query_class: int

    def prompt(self, task: ICLTask, demos: Optional[Sequence[tuple[list[int], int]]] = None) -> list[int]:
        toks = [task.BOS]
        for x, c in (self.demos if demos is None else demos):
            toks += [*x, task.ARROW, self.label_of_class[c], task.SEP]
        return toks + [*self.query, task.ARROW]

    @property
    def answer(self) -> int:
        return self.label_of_class[self.query_class]


def make_episode(task: ICLTask, rng: random.Random) -> Episode:
    feats = rng.sample(range(task.first_feature, task.first_label), task.n_classes * task.features_per_class)
    sets = [feats[c * task.features_per_class:(c + 1) * task.features_per_class] for c in range(task.n_classes)]
    labels = rng.sample(range(task.first_label, task.first_label + task.n_labels), task.n_classes)

    def draw(c: int) -> list[int]:
        return [rng.choice(sets[c]) for _ in range(task.input_len)]

    demos = [(draw(c), c) for c in range(task.n_classes) for _ in range(task.n_demos // task.n_classes)]
    rng.shuffle(demos)
    qc = rng.randrange(task.n_classes)
    return Episode(labels, demos, draw(qc), qc)


def order_demos(demos: Sequence[tuple[list[int], int]], kind: str, rng: random.Random) -> list[tuple[list[int], int]]:
    """The same demonstrations in a ``random`` or class-``alternating`` order."""
    if kind == "random":
        out = list(demos)
        rng.shuffle(out)
        return out
    if kind != "alternating":
        raise ValueError(f"kind: must be one of {ORDER_KINDS}, got {kind!r}")
    classes = sorted({c for _, c in demos})
    rng.shuffle(classes)
    queues = {c: [d for d in demos if d[1] == c] for c in classes}
    for q in queues.values():
        rng.shuffle(q)
    out = []
    while any(queues.values()):
        for c in classes:
            if queues[c]:
                out.append(queues[c].pop())
    return out


def training_batch(task: ICLTask, batch_size: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens (B, prompt_len+1)`` (prompt + query label) and ``loss_mask (B, prompt_len)``
    aligned with ``tokens[:, 1:]``: True on every label token (demonstrations and query)."""
    L = task.prompt_len + 1
    tokens = torch.empty(batch_size, L, dtype=torch.long)
    for b in range(batch_size):
        ep = make_episode(task, rng)
        tokens[b] = torch.tensor(ep.prompt(task) + [ep.answer])
    targets = tokens[:, 1:]
    mask = (targets >= task.first_label) & (targets < task.first_label + task.n_labels)
    return tokens, mask


@torch.no_grad()
def classify(model: torch.nn.Module, task: ICLTask, prompts: Sequence[Sequence[int]],
             candidates: Sequence[Sequence[int]], *, batch_size: int = 32, backend: Optional[str] = None) -> list[int]:
    """For each prompt, the candidate token with the largest next-token logit."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    preds: list[int] = []
    try:
        for i in range(0, len(prompts), batch_size):
            x = torch.tensor([list(p) for p in prompts[i:i + batch_size]], device=device)
            last = model(x, backend=backend)[:, -1].float().cpu()  # (b, V)
            for row, cand in zip(last, candidates[i:i + batch_size]):
                c = torch.tensor(list(cand))
                preds.append(int(c[row[c].argmax()]))
    finally:
        model.train(was_training)
    return preds


def evaluate_icl_order(model: torch.nn.Module, task: ICLTask, *, n_episodes: int = 100, n_orders: int = 5,
                       kinds: Sequence[str] = ORDER_KINDS, seed: int = 0, batch_size: int = 32,
                       backend: Optional[str] = None, progress: bool = False) -> dict:
    """Accuracy per order seed for each order kind over the same ``n_episodes`` episodes.

    Returns ``{"config": .., "chance": 1/n_classes, kind: {"accuracies": [..], "mean": ..,
    "best_minus_worst": .., "above_chance": bool, "correct": [[0/1 per episode] per order]}}``.
    """
    from tqdm.auto import tqdm

    if n_orders < 2:
        raise ValueError(f"n_orders: need at least 2 orders to measure robustness, got {n_orders}")
    rng = random.Random(f"icl:{seed}")
    episodes = [make_episode(task, rng) for _ in range(n_episodes)]
    cands = [e.label_of_class for e in episodes]
    chance = 1.0 / task.n_classes
    out: dict = {"config": {"task": task.to_dict(), "n_episodes": n_episodes, "n_orders": n_orders, "seed": seed},
                 "chance": chance}
    for kind in kinds:
        accs, correct = [], []
        for s in tqdm(range(n_orders), desc=f"icl {kind}", disable=not progress, leave=False):
            prompts = [e.prompt(task, order_demos(e.demos, kind, random.Random(f"icl:{seed}:{kind}:{s}:{i}")))
                       for i, e in enumerate(episodes)]
            preds = classify(model, task, prompts, cands, batch_size=batch_size, backend=backend)
            correct.append([int(p == e.answer) for p, e in zip(preds, episodes)])
            accs.append(sum(correct[-1]) / n_episodes)
        mean = sum(accs) / len(accs)
        out[kind] = {"accuracies": accs, "mean": mean, "best_minus_worst": max(accs) - min(accs),
                     "above_chance": above_chance(mean, chance, n_episodes), "correct": correct}
    return out


def above_chance(accuracy: float, chance: float, n: int, z: float = 2.0) -> bool:
    """True when ``accuracy`` over ``n`` episodes exceeds ``chance`` by more than ``z`` binomial
    standard errors. When it does not, the task was not learned and best - worst over orders is
    only sampling noise: report it as such, not as robustness."""
    return accuracy - chance > z * (chance * (1 - chance) / max(n, 1)) ** 0.5
