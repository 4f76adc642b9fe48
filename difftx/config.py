"""Model configuration: a typed dataclass, validated on construction, with named presets."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Optional

from .attention.kernels import backend_names

ATTENTION_KINDS = ("diff", "diff_v2", "standard")


def _err(field: str, rule: str) -> ValueError:
    return ValueError(f"ModelConfig.{field}: {rule}")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only LM (SPEC section 3). ``attention`` picks the attention kind; all else is shared.

    Head counts mean what each attention kind makes of them: for ``diff`` and ``diff_v2``,
    ``n_heads`` is the number of *differential* heads (``diff``: component width
    ``dim / (2 n_heads)``; ``diff_v2``: ``2 n_heads`` query heads of width ``dim / n_heads``);
    for ``standard`` it is the number of ordinary heads. ``n_kv_heads`` defaults to ``n_heads``.
    """

    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    attention: str = "diff"
    ffn_hidden: Optional[int] = None  # SwiGLU width; default 8/3 * dim rounded up to a multiple of 64
    max_seq_len: int = 256  # training context; longer inputs work (RoPE), this is what presets train on
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    backend: str = "auto"
    lambda_init: Optional[float] = None  # diff only: a constant instead of the depth schedule (ablations)
    use_subln: bool = True  # diff only: the per-head RMSNorm (turning it off is an ablation)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise _err(name, f"must be a positive integer, got {v!r}")
        if self.n_kv_heads is not None and (not isinstance(self.n_kv_heads, int) or self.n_kv_heads <= 0):
            raise _err("n_kv_heads", f"must be a positive integer or null, got {self.n_kv_heads!r}")
        if self.ffn_hidden is not None and (not isinstance(self.ffn_hidden, int) or self.ffn_hidden <= 0):
            raise _err("ffn_hidden", f"must be a positive integer or null, got {self.ffn_hidden!r}")
        if self.attention not in ATTENTION_KINDS:
            raise _err("attention", f"must be one of {ATTENTION_KINDS}, got {self.attention!r}")
        if self.backend not in backend_names():
            raise _err("backend", f"unknown attention backend {self.backend!r}; choose one of {backend_names()}")
        if not (self.rope_theta > 0 and self.norm_eps > 0 and self.init_std > 0):
            raise _err("rope_theta/norm_eps/init_std", "must be positive")
        H, Hkv, D = self.n_heads, self.kv_groups, self.dim
        if H % Hkv:
            raise _err("n_kv_heads", f"n_heads={H} must be divisible by n_kv_heads={Hkv}")
        if self.attention == "diff":
            if D % (2 * H):
                raise _err("dim", f"{D} must be divisible by 2*n_heads={2 * H} (two components per differential head)")
        elif D % H:
            raise _err("dim", f"{D} must be divisible by n_heads={H}")
        if self.head_dim % 2:
            raise _err("dim", f"the {self.attention} head width {self.head_dim} (see head_dim) must be even for RoPE")
        if self.attention != "diff" and (self.lambda_init is not None or not self.use_subln):
            raise _err("lambda_init/use_subln", "apply only to attention='diff'")

    # -- derived quantities -------------------------------------------------------------------
    @property
    def kv_groups(self) -> int:
        """Key/value groups ``Hkv``: each shared by ``n_heads / kv_groups`` heads (for DIFF a group
        holds two ``d``-wide key sub-heads and one ``2d``-wide value, so the attention module's
        count of key sub-heads is ``2 * kv_groups``)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def head_dim(self) -> int:
        """Query/key width per (sub-)head: ``d`` of SPEC sections 1-2."""
        return self.dim // (2 * self.n_heads) if self.attention == "diff" else self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 64 * math.ceil(8 * self.dim / 3 / 64)

    # -- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "ModelConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text_or_path) -> "ModelConfig":
        text = Path(text_or_path).read_text() if isinstance(text_or_path, Path) else text_or_path
        return cls.from_dict(json.loads(text))

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def baseline_config(config: ModelConfig) -> ModelConfig:
    """The parameter-matched baseline of a DIFF config (SPEC section 1).

    ``diff``: standard attention with ``2H`` heads of width ``d`` and ``2Hkv`` kv heads, the
    same projections and RoPE; parameters equal up to the lambda vectors and ``subln`` gains.
    ``diff_v2``: standard attention with ``H`` heads of width ``d`` and ``Hkv`` kv heads (the V2
    paper's comparison; V2 has ``dim*dim + dim*H`` more attention parameters).
    ``standard``: returned unchanged.
    """
    if config.attention == "standard":
        return config
    common = dict(attention="standard", lambda_init=None, use_subln=True)
    if config.attention == "diff":
        return config.replace(n_heads=2 * config.n_heads, n_kv_heads=2 * config.kv_groups, **common)
    return config.replace(n_heads=config.n_heads, n_kv_heads=config.kv_groups, **common)


PRESETS: dict[str, ModelConfig] = {
    # for tests: a few thousand parameters
    "test": ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=64),
    # CPU demo / synthetic tasks: ~0.2M parameters (byte vocabulary)
    "tiny": ModelConfig(vocab_size=256, dim=64, n_layers=2, n_heads=2, max_seq_len=256),
    # CPU language modelling: ~5M and ~17M parameters with a byte vocabulary
    "cpu-5m": ModelConfig(vocab_size=256, dim=256, n_layers=6, n_heads=4, max_seq_len=256),
    "cpu-17m": ModelConfig(vocab_size=256, dim=384, n_layers=10, n_heads=6, max_seq_len=256),
    # GPU sizes, GPT-2 BPE vocabulary, paper-style shapes
    "gpu-120m": ModelConfig(vocab_size=50304, dim=768, n_layers=12, n_heads=6, max_seq_len=2048),
    "gpu-350m": ModelConfig(vocab_size=50304, dim=1024, n_layers=24, n_heads=8, max_seq_len=2048),
    "gpu-1b": ModelConfig(vocab_size=50304, dim=2048, n_layers=24, n_heads=8, n_kv_heads=4, max_seq_len=2048),
}


def preset(name: str, **overrides) -> ModelConfig:
    """A named preset (see :data:`PRESETS`), with field overrides applied and validated."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides)
