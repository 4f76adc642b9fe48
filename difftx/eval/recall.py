"""Multi-query associative recall (MQAR; Arora et al. 2023, "Zoology", arXiv 2312.04927), its noise
variants, example files, and scoring a model on them.

An example is a pair of equal-length token lists: ``inputs`` and ``labels``, where ``labels[i]`` is
the token to predict after reading ``inputs[0..i]`` and -100 marks positions that are not scored.

MQAR as Zoology defines it (``variant="mqar"``), for a vocabulary of ``V`` tokens, a length ``L`` and
``P`` key-value pairs:

- keys are drawn from ``1 .. V/2 - 1`` and values from ``V/2 .. V - 1``, each without repetition
  within an example;
- the ``P`` pairs come first, as ``key value key value ...`` (``2P`` tokens);
- each key is then queried once, in the remaining ``L - 2P`` positions: query ``j`` sits at
  ``2P + 2 g_j``, where the gaps ``g_j`` are distinct draws from ``0 .. (L - 2P)/2 - 1`` with
  probability proportional to ``a (g + 1)^(a - 1)`` (``power_a = a = 0.01``: short gaps are likely);
- the label at a query's position is its key's value; every other position is scored by nothing;
- every position that is neither a pair nor a query holds a uniformly random token of the whole
  vocabulary (the random tokens may repeat a key or a value: that is the noise).

Variants, each probing a kind of attention noise:

- ``reassigned``: after the ``P`` pairs, ``R = ceil(reassign * P)`` of the keys appear again with a
  new value (``2R`` more tokens); a query of such a key asks for its latest value, and its first
  value becomes a distractor;
- longer ``seq_len`` at the same ``P`` (irrelevant stretches: more random tokens between the pairs
  and their queries), and evaluation at 2-4 times the training length: both are settings of the
  same generator, not variants of it.

:func:`generate` draws examples (a seed gives the same examples on every machine: numpy's PCG64);
:func:`read_examples` / :func:`write_examples` read and write them as JSONL, one example a line,
``{"inputs": [...], "labels": [...]}`` (Zoology's layout); :func:`score` scores a model on them;
:func:`attention_mass` and :func:`attention_by_role` read where its queries attend;
:class:`RecallSource` is a training batch source of them (``difftx.training.train(config, data=...)``).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np
import torch

IGNORE = -100  # a label that is not scored
VARIANTS = ("mqar", "reassigned")
PathLike = Union[str, os.PathLike]


@dataclass(frozen=True)
class RecallSpec:
    """One kind of recall example: ``vocab_size`` tokens, ``seq_len`` positions, ``n_pairs`` key-value
    pairs, the gap law ``power_a``, the ``variant`` and, for ``reassigned``, the share of keys bound
    again (``reassign``). Checked on construction."""

    vocab_size: int = 8192
    seq_len: int = 64
    n_pairs: int = 8
    variant: str = "mqar"
    power_a: float = 0.01
    reassign: float = 0.5

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_pairs"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"RecallSpec.{name}: must be a positive integer, got {v!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"RecallSpec.variant: must be one of {VARIANTS}, got {self.variant!r}")
        if self.seq_len % 2:
            raise ValueError(f"RecallSpec.seq_len: must be even (pairs and queries take two positions), got "
                             f"{self.seq_len}")
        if not (isinstance(self.power_a, (int, float)) and 0 < self.power_a <= 1):
            raise ValueError(f"RecallSpec.power_a: must be in (0, 1], got {self.power_a!r}")
        if not (isinstance(self.reassign, (int, float)) and 0 < self.reassign <= 1):
            raise ValueError(f"RecallSpec.reassign: must be in (0, 1], got {self.reassign!r}")
        if self.n_pairs > self.vocab_size // 2 - 1:
            raise ValueError(f"RecallSpec: {self.n_pairs} pairs need at least {2 * self.n_pairs + 2} tokens of "
                             f"vocabulary (distinct keys in 1..V/2-1), got vocab_size={self.vocab_size}")
        values = self.vocab_size - self.vocab_size // 2
        if self.n_pairs + self.reassigned > values:
            raise ValueError(f"RecallSpec: {self.n_pairs} pairs{' and their new values' if self.reassigned else ''} "
                             f"need {self.n_pairs + self.reassigned} distinct values, the vocabulary has {values}")
        need = self.context + 2 * self.n_pairs
        if need > self.seq_len:
            again = " (and the keys bound again)" if self.reassigned else ""
            raise ValueError(f"RecallSpec: {self.n_pairs} pairs{again} and their queries need seq_len >= {need}, got "
                             f"{self.seq_len}")

    @property
    def reassigned(self) -> int:
        """How many keys are bound again (0 for plain MQAR)."""
        return math.ceil(self.reassign * self.n_pairs) if self.variant == "reassigned" else 0

    @property
    def context(self) -> int:
        """Positions before the query region: the pairs, and the keys bound again."""
        return 2 * (self.n_pairs + self.reassigned)

    def to_dict(self) -> dict:
        return {"vocab_size": self.vocab_size, "seq_len": self.seq_len, "n_pairs": self.n_pairs,
                "variant": self.variant, "power_a": self.power_a, "reassign": self.reassign}


@dataclass
class RecallExamples:
    """Examples of one length: ``inputs`` and ``labels`` ``(N, L)`` int64 (labels -100 where not
    scored). From the generator also, per scored position of each row, the position of the pair it
    asks for (``key_pos``, -1 elsewhere: the key of the latest binding; its value follows it) and
    whether that key was bound again (``rebound``); from a file neither is known (``None``)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    key_pos: Optional[torch.Tensor] = None
    rebound: Optional[torch.Tensor] = None
    source: str = "generated"

    def __len__(self) -> int:
        return int(self.inputs.shape[0])

    def head(self, n: int) -> "RecallExamples":
        """The first ``n`` examples."""
        cut = (lambda t: None if t is None else t[:n])
        return RecallExamples(self.inputs[:n], self.labels[:n], cut(self.key_pos), cut(self.rebound), self.source)


@dataclass(frozen=True)
class RecallBlock:
    """Associative recall as one task of a shared vocabulary (``difftx compare``'s recall batches):
    MQAR of ``vocab_size`` tokens at ``seq_len``, trained on a mixture of ``pairs`` (one pair count a
    batch, drawn at random), its ids shifted by ``first_id`` (after the other tasks' blocks)."""

    vocab_size: int = 256
    seq_len: int = 64
    pairs: tuple = (4, 8, 16)
    power_a: float = 0.01
    first_id: int = 0

    def __post_init__(self) -> None:
        pairs = self.pairs
        if isinstance(pairs, int) and not isinstance(pairs, bool):
            pairs = (pairs,)
        if not isinstance(pairs, (tuple, list)) or not pairs or len(set(pairs)) != len(pairs):
            raise ValueError(f"RecallBlock.pairs: must be distinct pair counts, got {self.pairs!r}")
        object.__setattr__(self, "pairs", tuple(pairs))
        if not isinstance(self.first_id, int) or isinstance(self.first_id, bool) or self.first_id < 0:
            raise ValueError(f"RecallBlock.first_id: must be a non-negative integer, got {self.first_id!r}")
        self.specs()  # each pair count checked against the vocabulary and the length

    @property
    def end(self) -> int:
        """The first id after this block."""
        return self.first_id + self.vocab_size

    def spec(self, n_pairs: int, seq_len: Optional[int] = None, variant: str = "mqar",
             reassign: float = 0.5) -> RecallSpec:
        """The examples of ``n_pairs`` pairs in this block's vocabulary (at ``seq_len``: the training length
        by default)."""
        return RecallSpec(vocab_size=self.vocab_size, seq_len=seq_len or self.seq_len, n_pairs=n_pairs,
                          variant=variant, power_a=self.power_a, reassign=reassign)

    def specs(self) -> list[RecallSpec]:
        """The training mixture: one spec per pair count."""
        return [self.spec(p) for p in self.pairs]

    def shifted(self, examples: "RecallExamples") -> "RecallExamples":
        """``examples`` (ids from 0) in this block's ids."""
        if not self.first_id:
            return examples
        k = self.first_id
        labels = torch.where(examples.labels == IGNORE, examples.labels, examples.labels + k)
        return RecallExamples(examples.inputs + k, labels, examples.key_pos, examples.rebound, examples.source)

    def training_batch(self, batch_size: int, rng) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(tokens (B, T+1), loss_mask (B, T), targets (B, T))`` of one training batch: a pair count and a
        generator seed drawn from ``rng`` (a ``random.Random``), the loss at the queries against their values
        (the next input there is noise); the last column of ``tokens`` is never read."""
        spec = self.spec(self.pairs[rng.randrange(len(self.pairs))])
        ex = self.shifted(generate(spec, batch_size, seed=rng.getrandbits(63)))
        mask = ex.labels != IGNORE
        tokens = torch.cat([ex.inputs, ex.inputs[:, -1:]], dim=1)
        return tokens, mask, torch.where(mask, ex.labels, ex.inputs)

    def to_dict(self) -> dict:
        return {"vocab_size": self.vocab_size, "seq_len": self.seq_len, "pairs": list(self.pairs),
                "power_a": self.power_a, "first_id": self.first_id}

    @classmethod
    def from_dict(cls, data: dict) -> "RecallBlock":
        return cls(**{**data, "pairs": tuple(data["pairs"])})


def _gaps(rng: np.random.Generator, space: int, count: int, power_a: float) -> np.ndarray:
    """``count`` distinct gaps in ``0 .. space - 1``, gap ``g`` with probability proportional to
    ``power_a (g + 1)^(power_a - 1)`` (drawn one after another without replacement)."""
    p = power_a * np.arange(1, space + 1, dtype=np.float64) ** (power_a - 1)
    return rng.choice(space, size=count, replace=False, p=p / p.sum())


def generate(spec: RecallSpec, n: int, seed: int = 0) -> RecallExamples:
    """``n`` examples of ``spec``, the same for the same seed on every machine."""
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"generate: n must be a positive integer, got {n!r}")
    rng = np.random.default_rng(seed)
    V, L, P, R = spec.vocab_size, spec.seq_len, spec.n_pairs, spec.reassigned
    half = V // 2
    inputs = rng.integers(0, V, size=(n, L), dtype=np.int64)  # the random tokens; pairs and queries overwrite them
    labels = np.full((n, L), IGNORE, dtype=np.int64)
    key_pos = np.full((n, L), -1, dtype=np.int64)
    rebound = np.zeros((n, L), dtype=bool)
    space = (L - spec.context) // 2
    for i in range(n):
        keys = rng.choice(np.arange(1, half), size=P, replace=False)
        values = rng.choice(np.arange(half, V), size=P + R, replace=False)
        inputs[i, 0:2 * P:2], inputs[i, 1:2 * P:2] = keys, values[:P]
        where = np.arange(P) * 2  # the latest binding of each key
        answer = values[:P].copy()
        if R:
            again = rng.choice(P, size=R, replace=False)
            start = 2 * P
            inputs[i, start:start + 2 * R:2], inputs[i, start + 1:start + 2 * R:2] = keys[again], values[P:]
            where[again] = start + 2 * np.arange(R)
            answer[again] = values[P:]
        queries = spec.context + 2 * _gaps(rng, space, P, spec.power_a)
        inputs[i, queries] = keys
        labels[i, queries] = answer
        key_pos[i, queries] = where
        if R:
            rebound[i, queries[again]] = True
    return RecallExamples(torch.from_numpy(inputs), torch.from_numpy(labels), torch.from_numpy(key_pos),
                          torch.from_numpy(rebound), f"generated: {spec.variant}, V={V}, L={L}, P={P}, seed {seed}")


def write_examples(examples: RecallExamples, path: PathLike) -> Path:
    """``examples`` as JSONL at ``path`` (atomically), one ``{"inputs": [...], "labels": [...]}`` a line."""
    from ..io import atomic_write

    lines = "".join(json.dumps({"inputs": x, "labels": y}) + "\n"
                    for x, y in zip(examples.inputs.tolist(), examples.labels.tolist()))
    atomic_write(path, lambda p: Path(p).write_text(lines, encoding="utf-8"))
    return Path(path)


def read_examples(path: PathLike, vocab_size: Optional[int] = None) -> RecallExamples:
    """The examples of a JSONL file (:func:`write_examples`' layout). A bad file is a ``ValueError`` of
    one line naming the file and the line: not JSON, not an object with integer lists ``inputs`` and
    ``labels`` of one length, a length other than the first line's, a token or label outside
    ``0 .. vocab_size - 1`` (labels may also be -100), a line without a scored position, or no lines."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: not found; expected recall examples (JSONL, one {{\"inputs\", \"labels\"}} a line)")
    rows_in, rows_lab, length = [], [], None
    with open(path, encoding="utf-8", errors="strict") as f:
        try:
            lines = list(enumerate(f, 1))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}: not a text file ({e})") from None
    for no, line in lines:
        if not line.strip():
            continue
        where = f"{path} line {no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or not {"inputs", "labels"} <= set(row):
            raise ValueError(f"{where}: expected an object with \"inputs\" and \"labels\"")
        x, y = row["inputs"], row["labels"]
        for name, v in (("inputs", x), ("labels", y)):
            if not isinstance(v, list) or not v or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                raise ValueError(f"{where}: \"{name}\" must be a non-empty list of integers")
        if len(x) != len(y):
            raise ValueError(f"{where}: \"inputs\" has {len(x)} tokens and \"labels\" {len(y)}; they must align")
        if length is None:
            length = len(x)
        elif len(x) != length:
            raise ValueError(f"{where}: {len(x)} tokens, where the first example has {length}; every example of a "
                             "file must have one length (write one file per length)")
        if vocab_size is not None:
            bad = next((t for t in x if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{where}: token {bad} is outside the model's vocabulary 0..{vocab_size - 1}")
            bad = next((t for t in y if t != IGNORE and not 0 <= t < vocab_size), None)
            if bad is not None:
                raise ValueError(f"{where}: label {bad} is outside the model's vocabulary 0..{vocab_size - 1} (and "
                                 f"is not {IGNORE}, which marks a position that is not scored)")
        if all(t == IGNORE for t in y):
            raise ValueError(f"{where}: no scored position (every label is {IGNORE})")
        rows_in.append(x)
        rows_lab.append(y)
    if not rows_in:
        raise ValueError(f"{path}: no examples (the file is empty)")
    return RecallExamples(torch.tensor(rows_in, dtype=torch.int64), torch.tensor(rows_lab, dtype=torch.int64),
                          source=str(path))


@torch.no_grad()
def score(model: torch.nn.Module, examples: RecallExamples, *, batch_size: int = 64,
          device: Union[str, torch.device] = "cpu") -> dict:
    """Greedy accuracy of ``model`` at every scored position: its most likely next token equals the
    label (examples longer than the model's ``max_seq_len`` are read as RoPE reads them: past training).
    Returns the overall accuracy (scored positions pooled) and per example its ``labelled`` and
    ``correct`` counts; for generated examples also the accuracy on keys bound again and on the others."""
    if int(examples.inputs.max()) >= model.config.vocab_size:
        raise ValueError(f"a token ({int(examples.inputs.max())}) is outside the model's vocabulary "
                         f"0..{model.config.vocab_size - 1}")
    model.eval()
    hits = torch.zeros_like(examples.labels, dtype=torch.bool)
    for start in range(0, len(examples), batch_size):
        x = examples.inputs[start:start + batch_size].to(device)
        y = examples.labels[start:start + batch_size].to(device)
        mask = y != IGNORE
        logits = model(x, logits_at=mask)  # (N, V) at the scored positions
        hits[start:start + batch_size][mask.cpu()] = (logits.argmax(-1) == y[mask]).cpu()
    scored = examples.labels != IGNORE
    labelled, correct = scored.sum(1), (hits & scored).sum(1)
    out = {"accuracy": int(correct.sum()) / int(labelled.sum()), "examples": len(examples),
           "scored": int(labelled.sum()), "seq_len": int(examples.inputs.shape[1]), "source": examples.source,
           "records": {"labelled": labelled.tolist(), "correct": correct.tolist()}}
    if examples.rebound is not None and bool(examples.rebound.any()):
        again = examples.rebound & scored
        out["accuracy_rebound"] = int((hits & again).sum()) / int(again.sum())
        out["accuracy_kept"] = int((hits & scored & ~again).sum()) / int((scored & ~again).sum())
    return out


@torch.no_grad()
def recall_nll(model: torch.nn.Module, examples: RecallExamples, *, batch_size: int = 64,
               device: Union[str, torch.device] = "cpu") -> float:
    """The mean negative log-likelihood (nats) of the label at every scored position: the loss recall is
    trained on, read on examples the model never saw (``difftx compare --tune`` chooses by it)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        x = examples.inputs[start:start + batch_size].to(device)
        y = examples.labels[start:start + batch_size].to(device)
        mask = y != IGNORE
        logits = model(x, logits_at=mask).double()  # (N, V) at the scored positions
        total += float(torch.nn.functional.cross_entropy(logits, y[mask], reduction="sum"))
        count += int(mask.sum())
    return total / count


class RecallSource:
    """A batch source (``difftx.training.train(config, data=RecallSource(...), model_config=...)``) of
    recall examples: step ``s`` draws the global batch of ``specs[s % len(specs)]`` (a mixture of
    difficulties, as Zoology trains) from seed ``(seed, s)``, and each rank takes its rows. The loss is
    taken at the queries alone (``loss_mask``), against their values (``targets``: the next input there
    is noise, not the answer). Every spec must fit the model (``seq_len`` at most its ``max_seq_len``,
    ``vocab_size`` at most its vocabulary)."""

    def __init__(self, specs: Sequence[RecallSpec], seed: int = 0):
        specs = list(specs)
        if not specs or not all(isinstance(s, RecallSpec) for s in specs):
            raise ValueError("RecallSource: needs one or more RecallSpec")
        self.specs, self.seed = specs, int(seed)

    def make_loader(self, config, dist=None, *, batch_size: Optional[int] = None) -> "RecallLoader":
        rank, world = (0, 1) if dist is None else (dist.rank, dist.world_size)
        return RecallLoader(self, batch_size or config.batch_size, rank, world)


class RecallLoader:
    """One rank's stream of :class:`RecallSource` batches; its position is its state."""

    def __init__(self, source: RecallSource, batch_size: int, rank: int = 0, world_size: int = 1):
        self.source, self.batch_size, self.rank, self.world = source, batch_size, rank, world_size
        self.step = 0

    def next_batch(self):
        from ..training.batches import Batch

        spec = self.source.specs[self.step % len(self.source.specs)]
        ex = generate(spec, self.batch_size * self.world, seed=self.source.seed * 1_000_003 + self.step)
        self.step += 1
        rows = slice(self.rank * self.batch_size, (self.rank + 1) * self.batch_size)
        x, y = ex.inputs[rows], ex.labels[rows]
        mask = y != IGNORE
        tokens = torch.cat([x, torch.zeros(x.shape[0], 1, dtype=x.dtype)], dim=1)  # (B, T+1); the last is unused
        return Batch(tokens, loss_mask=mask, kind="recall", mask_total=int((ex.labels != IGNORE).sum()),
                     targets=torch.where(mask, y, 0))

    def state_dict(self) -> dict:
        return {"step": self.step, "seed": self.source.seed}

    def load_state_dict(self, state: dict) -> None:
        if state.get("seed") != self.source.seed:
            raise ValueError(f"RecallLoader: the state is of seed {state.get('seed')}, this source's is "
                             f"{self.source.seed}")
        self.step = int(state["step"])


@torch.no_grad()
def attention_mass(model: torch.nn.Module, examples: RecallExamples, *, batch_size: int = 32,
                   device: Union[str, torch.device] = "cpu") -> dict:
    """The attention noise of recall (the paper's measurement, as :mod:`difftx.eval.attention_noise`
    takes it for needles): at every scored position, each layer's attention row (the effective map,
    ``A1 - lam * A2`` for DIFF) normalised by its L1 norm, and its mass on the binding asked for (the
    key's position and its value's) against every other position read. Per layer: the mean over
    queries, then the mean and the best over heads, for each variant (signed, absolute, positive).
    Generated examples only (a file does not say where a query's binding is)."""
    from .attention_noise import layer_mass
    from .capture import capture_attention

    if examples.key_pos is None:
        raise ValueError("attention_mass: needs generated examples (a file does not say where each query's key is)")
    model.eval()
    rows: list[list[torch.Tensor]] = []
    answer, noise = [], []
    for start in range(0, len(examples), batch_size):
        x = examples.inputs[start:start + batch_size].to(device)
        kp = examples.key_pos[start:start + batch_size]
        with capture_attention(model) as cap:
            model(x, logits_at=(examples.labels[start:start + batch_size] != IGNORE).to(device))
        b, q = torch.nonzero(kp >= 0, as_tuple=True)
        S = x.shape[1]
        pos = torch.arange(S)
        k = kp[b, q]
        ans = (pos[None] == k[:, None]) | (pos[None] == k[:, None] + 1)  # (N, S): the key and its value
        answer.append(ans)
        noise.append((pos[None] <= q[:, None]) & ~ans)  # everything else the query reads
        for layer in range(len(cap.maps)):
            eff = cap.last(layer).effective  # (B, H, T, S)
            if len(rows) <= layer:
                rows.append([])
            rows[layer].append(eff[b, :, q, :])  # (N, H, S)
    answer_keys, noise_keys = torch.cat(answer), torch.cat(noise)
    return {"queries": int(answer_keys.shape[0]), "answer": "the queried key's position and its value's",
            "noise": "every other position the query reads",
            "layers": [layer_mass(torch.cat(r), answer_keys, noise_keys, layer).to_dict()
                       for layer, r in enumerate(rows)]}


# the roles a position plays for a query, relative to the binding it asks for (key_pos k, query position q); a
# position takes the first role it fits, so the roles split the positions the query reads
ROLES = ("key", "value", "next_pair", "recent", "elsewhere")
ROLE_TEXT = {"key": "the queried key's position (key_pos)", "value": "its value's (key_pos + 1)",
             "next_pair": "the following pair's key and value (key_pos + 2, + 3), inside the pairs",
             "recent": "the query itself and the position before it (q, q - 1)",
             "elsewhere": "every other position the query reads"}


def role_masks(q: torch.Tensor, key_pos: torch.Tensor, pairs_end: torch.Tensor, S: int) -> torch.Tensor:
    """``(N, len(ROLES), S)`` bool: for queries at positions ``q`` ``(N,)`` asking for the binding whose key
    is at ``key_pos`` ``(N,)``, with the bindings in ``0 .. pairs_end - 1`` ``(N,)``, which of the ``S``
    positions plays each role of :data:`ROLES` (each position read, ``0 .. q``, plays exactly one)."""
    pos = torch.arange(S)[None]  # (1, S)
    k, q, end = key_pos[:, None], q[:, None], pairs_end[:, None]
    wants = [pos == k, pos == k + 1, ((pos == k + 2) | (pos == k + 3)) & (pos < end), (pos == q) | (pos == q - 1),
             pos <= q]
    taken = torch.zeros(k.shape[0], S, dtype=torch.bool)
    out = []
    for want in wants:
        mine = want & (pos <= q) & ~taken
        out.append(mine)
        taken |= mine
    return torch.stack(out, 1)


@torch.no_grad()
def attention_by_role(model: torch.nn.Module, examples: RecallExamples, *, batch_size: int = 32,
                      device: Union[str, torch.device] = "cpu") -> dict:
    """Where each head looks from a query, by the role each position plays for the binding asked for
    (:data:`ROLES`: the key, its value, the next pair, the query and the position before it, elsewhere):
    a wider reading than :func:`attention_mass`, for a model that recalls by another route (a head that
    reads the value after a matching key, one that copies the previous token). At every scored
    position, each layer's effective map row (``A1 - lam * A2`` for DIFF) per head gives, per role:
    ``share``, its mass in the L1-normalised row (``|row| / sum |row|``; the roles sum to 1), and
    ``signed``, the plain signed mass of the row (the roles sum to the row's total: 1 for softmax,
    ``1 - lam`` for DIFF). Each is the mean over queries, per head (``share[role][h]``), with the mean
    over heads beside it (``share_mean``, ``signed_mean``). ``uniform[role]``: what a uniform map over
    the causal row puts on the role (its positions / the positions read, mean over queries). The pairs
    region (for the next pair) ends after the latest binding any query of the example asks for, which
    is the region's last for generated examples (every binding of it is queried). Generated examples
    only."""
    from ..io import eval_mode
    from .capture import capture_attention

    if examples.key_pos is None:
        raise ValueError("attention_by_role: needs generated examples (a file does not say where each query's key "
                         "is)")
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"attention_by_role: batch_size must be a positive integer, got {batch_size!r}")
    R = len(ROLES)
    share: list[torch.Tensor] = []  # per layer (H, R), summed over queries
    signed: list[torch.Tensor] = []
    uniform = torch.zeros(R, dtype=torch.float64)
    n = 0
    with eval_mode(model):
        for start in range(0, len(examples), batch_size):
            x = examples.inputs[start:start + batch_size].to(device)
            kp = examples.key_pos[start:start + batch_size]
            if not bool((kp >= 0).any()):
                continue
            with capture_attention(model) as cap:
                model(x, logits_at=(kp >= 0).to(device))
            b, q = torch.nonzero(kp >= 0, as_tuple=True)
            end = kp.max(1).values[b] + 2  # the pairs end after the latest binding asked for
            masks = role_masks(q, kp[b, q], end, x.shape[1]).double()  # (N, R, S)
            uniform += (masks.sum(-1) / (q[:, None] + 1).double()).sum(0)
            n += int(b.numel())
            for layer in range(len(cap.maps)):
                rows = cap.last(layer).effective[b, :, q, :].double()  # (N, H, S)
                norm = rows.abs() / rows.abs().sum(-1, keepdim=True).clamp_min(1e-30)
                got = (torch.einsum("nhs,nrs->hr", norm, masks), torch.einsum("nhs,nrs->hr", rows, masks))
                if len(share) <= layer:
                    share.append(torch.zeros_like(got[0]))
                    signed.append(torch.zeros_like(got[1]))
                share[layer] += got[0]
                signed[layer] += got[1]
    if not n:
        raise ValueError("attention_by_role: the examples have no scored query")

    def per_role(t: torch.Tensor) -> dict:  # (H, R) summed -> {role: [per head]}
        return {role: (t[:, i] / n).tolist() for i, role in enumerate(ROLES)}

    def mean_role(t: torch.Tensor) -> dict:
        return {role: float(t[:, i].mean() / n) for i, role in enumerate(ROLES)}

    return {"queries": n, "roles": dict(ROLE_TEXT), "uniform": {r: float(u / n) for r, u in zip(ROLES, uniform)},
            "layers": [{"layer": i, "heads": int(s.shape[0]), "share": per_role(s), "signed": per_role(g),
                        "share_mean": mean_role(s), "signed_mean": mean_role(g)}
                       for i, (s, g) in enumerate(zip(share, signed))]}


def best_heads(layer: dict, variant: str = "share") -> dict:
    """Per role, ``(head, mass)`` of the head of ``layer`` (an entry of :func:`attention_by_role`'s
    ``layers``) with the most ``variant`` mass on it."""
    out = {}
    for role, per_head in layer[variant].items():
        h = max(range(len(per_head)), key=lambda i: per_head[i])
        out[role] = (h, per_head[h])
    return out
