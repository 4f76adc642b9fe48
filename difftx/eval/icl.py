"""In-context learning order robustness (SPEC section 5; paper section 3.5), synthetic form.

An episode is a classification problem drawn afresh for every sequence: ``n_classes`` classes,
each owning a disjoint set of feature tokens, and a random *label map* assigning each class a
label token. An input is ``input_len`` feature tokens of its class. The prompt is
``BOS (x -> y ;) * n_demos x_query ->`` and the model must name the query's label, which it
can only learn from the demonstrations. The prediction is the arg-max of the next-token logits
over the episode's label tokens (constrained classification).

Robustness, as the paper measures it (:func:`evaluate_icl_instances`): a *task instance* fixes one
label map and one set of demonstrations; the same demonstrations are shown in ``n_orders`` orders
of each kind (``random``: a seeded shuffle; ``class_sorted``: grouped by class, the class order
seeded; ``alternating``: round-robin by class, class order and within-class order seeded) and
each order is scored on the instance's ``n_queries`` queries. The metric is the spread of accuracy
over the orders *of one instance* (best - worst), averaged over instances, with the mean accuracy.
(Re-permuting independent episodes for every order would measure binomial sampling noise rather
than order sensitivity.)
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Optional, Sequence

import torch

from ..io import eval_mode

ORDER_KINDS = ("random", "class_sorted", "alternating")


@dataclass(frozen=True)
class ICLBlock:
    """The ICL task's block of token ids and its sizes. Local ids: ``PAD=0 BOS=1 ARROW=2 SEP=3``,
    then ``n_features`` feature tokens, then ``n_labels`` label tokens; every id is offset by
    ``first_id`` so the task can share a vocabulary with another (for example after a :class:`NeedleBlock`)."""

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
                raise ValueError(f"ICLBlock.{name}: must be a positive integer, got {v!r}")
        if self.n_classes < 2:
            raise ValueError(f"ICLBlock.n_classes: need at least 2 classes, got {self.n_classes}")
        if self.n_classes * self.features_per_class > self.n_features:
            raise ValueError(f"ICLBlock.n_features: {self.n_features} cannot give {self.n_classes} classes "
                             f"{self.features_per_class} disjoint features each")
        if self.n_labels < self.n_classes:
            raise ValueError(f"ICLBlock.n_labels: {self.n_labels} label tokens for {self.n_classes} classes")
        if self.n_demos % self.n_classes:
            raise ValueError(f"ICLBlock.n_demos: {self.n_demos} must be a multiple of n_classes={self.n_classes} "
                             "(balanced demonstrations)")
        if self.first_id < 0:
            raise ValueError(f"ICLBlock.first_id: must be >= 0, got {self.first_id}")

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

    def prompt(self, task: ICLBlock, demos: Optional[Sequence[tuple[list[int], int]]] = None) -> list[int]:
        toks = [task.BOS]
        for x, c in (self.demos if demos is None else demos):
            toks += [*x, task.ARROW, self.label_of_class[c], task.SEP]
        return toks + [*self.query, task.ARROW]

    @property
    def answer(self) -> int:
        return self.label_of_class[self.query_class]


def _classes_and_labels(task: ICLBlock, rng: random.Random) -> tuple[list[list[int]], list[int]]:
    """Each class's feature tokens and label token: one problem's label map."""
    feats = rng.sample(range(task.first_feature, task.first_label), task.n_classes * task.features_per_class)
    sets = [feats[c * task.features_per_class:(c + 1) * task.features_per_class] for c in range(task.n_classes)]
    return sets, rng.sample(range(task.first_label, task.first_label + task.n_labels), task.n_classes)


def _draw(task: ICLBlock, sets: list[list[int]], c: int, rng: random.Random) -> list[int]:
    return [rng.choice(sets[c]) for _ in range(task.input_len)]


def make_episode(task: ICLBlock, rng: random.Random) -> Episode:
    sets, labels = _classes_and_labels(task, rng)
    demos = [(_draw(task, sets, c, rng), c) for c in range(task.n_classes)
             for _ in range(task.n_demos // task.n_classes)]
    rng.shuffle(demos)
    qc = rng.randrange(task.n_classes)
    return Episode(labels, demos, _draw(task, sets, qc, rng), qc)


def make_instance(task: ICLBlock, rng: random.Random, n_queries: int) -> list[Episode]:
    """One task instance: a fixed label map and demonstration set, and ``n_queries`` queries
    (classes balanced as far as they divide), each as an :class:`Episode` sharing the demos."""
    sets, labels = _classes_and_labels(task, rng)
    demos = [(_draw(task, sets, c, rng), c) for c in range(task.n_classes)
             for _ in range(task.n_demos // task.n_classes)]
    rng.shuffle(demos)
    classes = [q % task.n_classes for q in range(n_queries)]
    rng.shuffle(classes)
    return [Episode(labels, demos, _draw(task, sets, c, rng), c) for c in classes]


def order_demos(demos: Sequence[tuple[list[int], int]], kind: str, rng: random.Random) -> list[tuple[list[int], int]]:
    """The same demonstrations in a ``random``, ``class_sorted`` or class-``alternating`` order."""
    if kind == "random":
        out = list(demos)
        rng.shuffle(out)
        return out
    if kind not in ORDER_KINDS:
        raise ValueError(f"kind: must be one of {ORDER_KINDS}, got {kind!r}")
    classes = sorted({c for _, c in demos})
    rng.shuffle(classes)
    queues = {c: [d for d in demos if d[1] == c] for c in classes}
    for q in queues.values():
        rng.shuffle(q)
    if kind == "class_sorted":
        return [d for c in classes for d in queues[c]]
    out = []
    while any(queues.values()):
        for c in classes:
            if queues[c]:
                out.append(queues[c].pop())
    return out


def training_batch(task: ICLBlock, batch_size: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
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
def classify(model: torch.nn.Module, task: ICLBlock, prompts: Sequence[Sequence[int]],
             candidates: Sequence[Sequence[int]], *, batch_size: int = 32, backend: Optional[str] = None) -> list[int]:
    """For each prompt, the candidate token with the largest next-token logit."""
    device = next(model.parameters()).device
    preds: list[int] = []
    with eval_mode(model):
        for i in range(0, len(prompts), batch_size):
            x = torch.tensor([list(p) for p in prompts[i:i + batch_size]], device=device)
            last = model(x, backend=backend)[:, -1].float().cpu()  # (b, V)
            for row, cand in zip(last, candidates[i:i + batch_size]):
                c = torch.tensor(list(cand))
                preds.append(int(c[row[c].argmax()]))
    return preds


def evaluate_icl_instances(model: torch.nn.Module, task: ICLBlock, *, n_instances: int = 50, n_queries: int = 20,
                           n_orders: int = 5, kinds: Sequence[str] = ORDER_KINDS, seed: int = 0, batch_size: int = 32,
                           backend: Optional[str] = None, progress: bool = False) -> dict:
    """Order robustness over ``n_instances`` task instances (see the module docstring).

    Returns ``{"config", "chance", kind: {"accuracy": [per instance, per order], "mean",
    "best_minus_worst": mean over instances of max - min over orders, "instance_spread": [per
    instance], "instance_accuracy": [per instance, mean over orders], "above_chance": bool}}``.
    """
    from tqdm.auto import tqdm

    if n_orders < 2:
        raise ValueError(f"n_orders: need at least 2 orders to measure robustness, got {n_orders}")
    for name, v in (("n_instances", n_instances), ("n_queries", n_queries)):
        if not isinstance(v, int) or v <= 0:
            raise ValueError(f"{name}: must be a positive integer, got {v!r}")
    instances = [make_instance(task, random.Random(f"icl-instance:{seed}:{i}"), n_queries) for i in range(n_instances)]
    chance = 1.0 / task.n_classes
    out: dict = {"config": {"task": task.to_dict(), "n_instances": n_instances, "n_queries": n_queries,
                            "n_orders": n_orders, "seed": seed}, "chance": chance}
    for kind in kinds:
        acc = []  # (instances, orders)
        for i, queries in enumerate(tqdm(instances, desc=f"icl {kind}", disable=not progress, leave=False)):
            orders = [order_demos(queries[0].demos, kind, random.Random(f"icl-order:{seed}:{i}:{kind}:{s}"))
                      for s in range(n_orders)]
            prompts = [q.prompt(task, o) for o in orders for q in queries]
            preds = classify(model, task, prompts, [q.label_of_class for o in orders for q in queries],
                             batch_size=batch_size, backend=backend)
            right = [p == q.answer for p, q in zip(preds, [q for _ in orders for q in queries])]
            acc.append([sum(right[s * n_queries:(s + 1) * n_queries]) / n_queries for s in range(n_orders)])
        spread = [max(a) - min(a) for a in acc]
        per_instance = [sum(a) / n_orders for a in acc]
        mean = sum(per_instance) / n_instances
        out[kind] = {"accuracy": acc, "mean": mean, "best_minus_worst": sum(spread) / n_instances,
                     "instance_spread": spread, "instance_accuracy": per_instance,
                     "above_chance": above_chance(mean, chance, n_instances * n_queries)}
    return out


def above_chance(accuracy: float, chance: float, n: int, z: float = 2.0) -> bool:
    """True when ``accuracy`` over ``n`` episodes exceeds ``chance`` by more than ``z`` binomial
    standard errors. When it does not, the task was not learned and best - worst over orders is
    only sampling noise: report it as such, not as robustness."""
    return accuracy - chance > z * (chance * (1 - chance) / max(n, 1)) ** 0.5
