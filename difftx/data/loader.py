"""``PackedLoader``: deterministic, resumable, rank-sliced batches of packed windows.

The stream (notation: ``N`` tokens in the store, ``T`` = seq_len, ``B`` = per-rank batch,
``W`` = world size, ``G = W*B`` the global batch)::

    windows per epoch   n = (N - T) // T
    epoch e             rng = numpy.random.default_rng([seed, e])
                        shift_e = rng.integers(T)          # where this epoch's windows start
                        perm_e  = rng.permutation(n)       # the order in which they are visited
    global row i        e, j = divmod(i, n);  k = perm_e[j]
                        window = tokens[shift_e + k*T : shift_e + k*T + T + 1]

So within an epoch every window is visited once, in a seeded random order; the random shift
changes the window boundaries from epoch to epoch. Step ``s`` of the global stream is rows
``s*G .. s*G + G - 1``; rank ``r`` takes rows ``s*G + r*B .. s*G + (r+1)*B - 1``. The stream
therefore depends only on (store, seed, seq_len), and a batch on the global batch size: W
processes with batch B together see exactly what one process with batch W*B sees.

``doc_ids`` numbers the documents inside each row from 0 (the row's first token belongs to
document 0), derived from the store's document offsets; equal ids <=> same document.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .sources import DataError
from .store import TokenStore

STATE_VERSION = 1


class PackedLoader:
    """Batches ``(tokens, doc_ids)``, both ``torch.int64`` ``(B, T+1)``: inputs ``tokens[:, :-1]``,
    targets ``tokens[:, 1:]`` (use ``doc_ids[:, :-1]`` for the inputs' attention mask)."""

    def __init__(self, store: TokenStore, batch_size: int, seq_len: int, seed: int = 0, rank: int = 0,
                 world_size: int = 1, *, vocab_size: Optional[int] = None) -> None:
        for name, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("world_size", world_size, 1),
                                 ("rank", rank, 0), ("seed", seed, 0)):
            if not isinstance(value, (int, np.integer)) or value < low:
                raise ValueError(f"PackedLoader: {name} must be an int >= {low}, got {value!r}")
        if rank >= world_size:
            raise ValueError(f"PackedLoader: rank must be < world_size ({world_size}), got {rank}")
        self.store = store
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.global_batch = self.batch_size * self.world_size
        if vocab_size is not None and vocab_size != store.vocab_size:
            store.check_vocab(vocab_size)  # a model vocabulary smaller than the tokenizer's is caught here
        self.windows_per_epoch = (len(store) - self.seq_len) // self.seq_len
        if self.windows_per_epoch < self.global_batch:
            need = (self.global_batch + 1) * self.seq_len
            raise DataError(f"{store.name} ({store.origin}): {len(store):,} tokens are fewer than one batch needs: "
                            f"global batch "
                            f"{self.global_batch} x seq_len {self.seq_len} needs at least (batch + 1) * seq_len = "
                            f"{need:,} tokens (the extra seq_len allows each epoch's random shift)")
        self.row = 0  # global rows consumed so far (the whole resumable state)
        self._epoch_cache: dict[int, tuple[int, np.ndarray]] = {}

    # ------------------------------------------------------------------ stream
    def _epoch(self, e: int) -> tuple[int, np.ndarray]:
        if e not in self._epoch_cache:
            rng = np.random.default_rng([self.seed, e])
            shift = int(rng.integers(self.seq_len))
            perm = rng.permutation(self.windows_per_epoch)
            if len(self._epoch_cache) >= 2:
                self._epoch_cache.pop(min(self._epoch_cache))
            self._epoch_cache[e] = (shift, perm)
        return self._epoch_cache[e]

    def window_start(self, row: int) -> int:
        """Token position where global row ``row`` starts."""
        e, j = divmod(int(row), self.windows_per_epoch)
        shift, perm = self._epoch(e)
        return shift + int(perm[j]) * self.seq_len

    @property
    def step(self) -> int:
        """Global batches consumed so far."""
        return self.row // self.global_batch

    @property
    def epoch(self) -> float:
        return self.row / self.windows_per_epoch

    def next_batch(self):
        """This rank's slice of the next global batch: ``(tokens, doc_ids)``, torch.int64 ``(B, T+1)``."""
        import torch

        first = self.row + self.rank * self.batch_size
        T1 = self.seq_len + 1
        toks = np.empty((self.batch_size, T1), dtype=np.int64)  # (B, T+1)
        docs = np.empty((self.batch_size, T1), dtype=np.int64)  # (B, T+1)
        for b in range(self.batch_size):
            toks[b], docs[b] = self.store.window(self.window_start(first + b), T1)
        self.row += self.global_batch
        return torch.from_numpy(toks), torch.from_numpy(docs)

    def __iter__(self):
        while True:
            yield self.next_batch()

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position; ``load_state_dict`` restores the exact stream."""
        return {"version": STATE_VERSION, "row": self.row, "seed": self.seed, "seq_len": self.seq_len,
                "global_batch": self.global_batch, "num_tokens": len(self.store), "num_docs": self.store.num_docs,
                "store": self.store.fingerprint}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``. The seed, seq_len, global batch and the store's token and
        document counts must match (the stream would differ otherwise); a different world size
        with the same global batch is fine."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"PackedLoader state has version {state.get('version')!r}, expected {STATE_VERSION}")
        for key, mine in (("seed", self.seed), ("seq_len", self.seq_len), ("num_tokens", len(self.store)),
                          ("num_docs", self.store.num_docs), ("global_batch", self.global_batch)):
            if state.get(key) != mine:
                raise ValueError(f"PackedLoader state has {key}={state.get(key)!r} but this loader has {mine!r}; "
                                 f"resuming would not continue the same data stream")
        row = state.get("row")
        if not isinstance(row, int) or row < 0:
            raise ValueError(f"PackedLoader state has an invalid row {row!r}")
        self.row = row

    def __repr__(self) -> str:
        return (f"PackedLoader({self.store.name!r}, batch_size={self.batch_size}, seq_len={self.seq_len}, "
                f"seed={self.seed}, rank={self.rank}/{self.world_size}, step={self.step})")
