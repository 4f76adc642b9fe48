"""Model configuration: a typed dataclass, validated on construction, with named presets."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

# the arm table (names, descriptions, sets, the primary pair, labels): plain data, read here and through here
from .arm_table import ARM_LABELS, ARM_SETS, ARM_WORDS, ARMS, PAPER_MODELS, PRIMARY  # noqa: F401
from .attention.kernels import backend_names
from .attention.registry import ATTENTIONS  # the attention kinds by name (register_attention adds one)
from .attention.registry import load_kinds

# Fields added after configs were first written: ``to_dict`` leaves them out while they hold these
# defaults, so a config that does not use them serialises exactly as before (resuming an older run
# compares these dicts) and stays readable by an older difftx.
_LATER_FIELDS = {"gate": None, "head_norm": None, "subtract": True, "options": None, "rope": True, "init": "normal",
                 "out_scale": None, "qkv_bias": False}

INITS = ("normal", "torch")  # ModelConfig.init: how the weights are drawn (Transformer.reset_parameters)
OUT_SCALE_SCHEDULE = "schedule"  # ModelConfig.out_scale: 1 - the depth schedule's lambda_init at each layer


MAX_WEIGHT = 2 ** 40  # elements of one weight matrix (4 TiB in float32): a larger config is a typo, not a model


def _err(field: str, rule: str) -> ValueError:
    return ValueError(f"ModelConfig.{field}: {rule}")


@dataclass(frozen=True)
class ModelConfig:
    """Decoder-only LM (SPEC section 3). ``attention`` picks the attention kind; all else is shared.

    Head counts mean what each attention kind makes of them: for ``diff`` and ``diff_v2``,
    ``n_heads`` is the number of *differential* heads (``diff``: component width
    ``dim / (2 n_heads)``; ``diff_v2``: ``2 n_heads`` query heads of width ``dim / n_heads``);
    for ``standard`` and ``gated`` it is the number of ordinary heads; for ``converted`` (a standard model made
    differential by ``difftx convert``) it is the source's heads, each of width ``dim / n_heads`` with two
    query/key components and one value. ``n_kv_heads`` defaults to ``n_heads``.

    Options of the attention kinds (docs/design.md §5b), each validated here:

    - ``gate`` (``gated`` only): ``"elementwise"`` (the default when ``None``; ``W_g: D -> H*d``)
      or ``"headwise"`` (``W_g: D -> H``), the output gate ``sigmoid(x W_g)`` of Qiu et al. 2025.
    - ``subtract`` (``diff`` only): ``False`` is the no-subtraction control, lambda fixed at 0
      (``O_h = (1 - lambda_init) RMSNorm(A1 V)``; the lambda vectors are not created).
    - ``head_norm``: the per-head RMSNorm. ``None`` means the kind's default: on for ``diff``,
      off for the others; ``True`` is allowed for ``diff`` and ``standard`` only (Table 6's
      "Transformer + per-head norm"), ``False`` for every kind. ``use_subln`` is the older,
      ``diff``-only name of the same switch, kept so that older configs load unchanged
      (``use_subln=False`` means ``head_norm=False``); see :attr:`uses_head_norm`.
    - ``lambda_init`` (``diff`` only): a constant in (0, 1) instead of the depth schedule.
    - ``out_scale`` (``diff`` and ``standard``): the constant each head's output is multiplied by before
      ``out_proj`` (after the per-head norm, if any). ``None`` is the kind's own: ``1 - lambda_init`` for ``diff``
      (the paper's), 1 for ``standard``. A number ``> 0`` decouples it from ``lambda_init``; ``"schedule"`` is
      ``1 - lambda_init_for_layer(l)`` at layer ``l`` (the depth schedule's scale, for the baseline too).
    - ``options``: the options of a registered kind (a dict its ``Options`` type takes; docs/attention-kinds.md).
    - ``qkv_bias`` (``standard``, ``converted``, ``dex``): a learned bias on the query, key and value projections
      (none on ``out_proj``), added before RoPE, as Qwen2 has them; zeros at initialisation. A parameter-matched
      baseline keeps it (the source of a ``converted``/``dex`` model has the same biases).

    ``init`` (every kind) says how :meth:`~difftx.model.Transformer.reset_parameters` draws the weights:
    ``"normal"`` is ``N(0, init_std)`` for every linear map and embedding; ``"torch"`` is PyTorch's module
    defaults (``nn.Linear``: uniform in ``+-1/sqrt(fan_in)``, Kaiming-uniform with ``a = sqrt(5)``;
    ``nn.Embedding``: ``N(0, 1)``). The lambda vectors are ``N(0, 0.1)`` under either.

    Each field above is checked against the kind: a kind reads the built-in fields it lists in its
    ``config_fields`` and validates the rest itself (``AttentionKind.check_config``).
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
    rope: bool = True  # False: no positional encoding at all (NoPE: causal attention alone orders the tokens)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02  # the standard deviation of init="normal"
    init: str = "normal"  # "normal": N(0, init_std) everywhere; "torch": PyTorch's module defaults (see above)
    backend: str = "auto"
    lambda_init: Optional[float] = None  # diff only: a constant instead of the depth schedule (ablations)
    use_subln: bool = True  # diff only: older name of head_norm (False turns the norm off; kept for old configs)
    gate: Optional[str] = None  # gated only: "elementwise" (default) or "headwise"
    head_norm: Optional[bool] = None  # per-head RMSNorm; None: the attention kind's default (on for diff only)
    subtract: bool = True  # diff only: False is the no-subtraction control (lambda fixed at 0)
    out_scale: Optional[float | str] = None  # diff/standard: each head's output scale; None: 1 - lambda_init / 1
    qkv_bias: bool = False  # standard/converted/dex: biases on q_proj, k_proj, v_proj (Qwen2's), added before RoPE
    options: Optional[dict] = field(default=None, hash=False)  # a registered kind's own options

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise _err(name, f"must be a positive integer, got {v!r}")
        if self.n_kv_heads is not None and (not isinstance(self.n_kv_heads, int) or self.n_kv_heads <= 0):
            raise _err("n_kv_heads", f"must be a positive integer or null, got {self.n_kv_heads!r}")
        if self.ffn_hidden is not None and (not isinstance(self.ffn_hidden, int) or self.ffn_hidden <= 0):
            raise _err("ffn_hidden", f"must be a positive integer or null, got {self.ffn_hidden!r}")
        if self.attention not in ATTENTIONS:
            raise _err("attention", f"must be one of {tuple(ATTENTIONS)}, got {self.attention!r} (a kind of your own: "
                                    f"register it with difftx.register_attention, or load its file with "
                                    f"difftx --kinds FILE / DIFFTX_KINDS)")
        if self.backend not in backend_names():
            raise _err("backend", f"unknown attention backend {self.backend!r}; choose one of {backend_names()}")
        for name in ("rope_theta", "norm_eps", "init_std"):  # finite: inf trained a constant loss (ln V) with exit 0
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise _err(name, f"must be a finite positive number, got {v!r}")
        if self.norm_eps >= 1:
            raise _err("norm_eps", f"{self.norm_eps!r} is not a small epsilon (it would swamp every RMS below 1): use "
                                   f"a value such as 1e-5 or 1e-6")
        H, Hkv, D = self.n_heads, self.kv_groups, self.dim
        if H % Hkv:
            raise _err("n_kv_heads", f"n_heads={H} must be divisible by n_kv_heads={Hkv}")
        C = self.width_parts
        if C > 1 and D % (C * H):
            raise _err("dim", f"{D} must be divisible by {C}*n_heads={C * H} ({C} components per differential head)")
        if D % H:
            raise _err("dim", f"{D} must be divisible by n_heads={H}")
        if self.head_dim % 2:
            raise _err("dim", f"the {self.attention} head width {self.head_dim} (see head_dim) must be even for RoPE")
        largest = max(self.vocab_size * D, D * self.hidden_dim)  # the embedding / LM head, or an MLP weight
        if largest > MAX_WEIGHT:  # PyTorch cannot even describe it: "Storage size calculation overflowed"
            raise _err("dim" if D * self.hidden_dim >= self.vocab_size * D else "vocab_size",
                       f"a weight of {largest:,} elements (dim={D}, vocab_size={self.vocab_size}, hidden "
                       f"{self.hidden_dim}): more than {MAX_WEIGHT:,} (2**40); no such model can be built")
        self._check_options()

    def _check_options(self) -> None:
        kind, accepts = self.attention, self.kind_class.config_fields
        for name in ("use_subln", "subtract", "rope", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise _err(name, f"must be true or false, got {getattr(self, name)!r}")
        if self.init not in INITS:
            raise _err("init", f"must be one of {INITS} (normal: N(0, init_std) everywhere; torch: PyTorch's module "
                               f"defaults), got {self.init!r}")
        v = self.out_scale
        if v is not None and v != OUT_SCALE_SCHEDULE and (
                isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0):
            raise _err("out_scale", f"must be a positive number, {OUT_SCALE_SCHEDULE!r} (1 - the depth schedule's "
                                    f"lambda_init at each layer) or null (the kind's own), got {v!r}")
        if self.head_norm is not None and not isinstance(self.head_norm, bool):
            raise _err("head_norm", f"must be true, false or null (the attention kind's default), "
                                    f"got {self.head_norm!r}")
        if self.options is not None and not isinstance(self.options, dict):
            raise _err("options", f"must be a mapping of option names to values or null, got {self.options!r}")
        hints = {"use_subln": " (use head_norm)", "subtract": " (false is DIFF's no-subtraction control)",
                 "qkv_bias": " (true: biases on the q/k/v projections)"}
        for name, plain in {**_PLAIN, **_KEPT}.items():
            if name != "options" and getattr(self, name) != plain and name not in accepts and not (name == "head_norm" and not self.head_norm):
                takers = [n for n, c in ATTENTIONS.items() if name in c.config_fields]
                where = f"attention={takers[0]!r}" if len(takers) == 1 else f"attention in {tuple(takers)}"
                what = "true applies" if name == "head_norm" else "applies"
                raise _err(name, f"{what} only to {where}{hints.get(name, '')}, not {kind!r}")
        if self.head_norm and not self.use_subln:
            raise _err("head_norm", "true contradicts use_subln=false (the older name of the same switch); "
                                    "set head_norm alone")
        self.kind_class.check_config(self)

    # -- derived quantities -------------------------------------------------------------------
    @property
    def kv_groups(self) -> int:
        """Key/value groups ``Hkv``: each shared by ``n_heads / kv_groups`` heads (for DIFF a group
        holds two ``d``-wide key sub-heads and one ``2d``-wide value, so the attention module's
        count of key sub-heads is ``2 * kv_groups``)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def kind_class(self) -> type:
        """The attention kind's class (:data:`~difftx.attention.registry.ATTENTIONS`), which says what it implies."""
        return ATTENTIONS[self.attention]

    @property
    def components(self) -> int:
        """Softmax maps per head of the attention kind (2 for ``diff``, whose heads have two ``d``-wide
        components; 1 for the others)."""
        return self.kind_class.components

    @property
    def width_parts(self) -> int:
        """``d``-wide parts of the model width per head: ``dim = width_parts * n_heads * head_dim`` (the kind's
        ``width_parts``, by default its ``components``: 2 for ``diff``; 1 for ``converted``, whose two components
        share one ``d``-wide value)."""
        return self.kind_class.width_parts or self.components

    @property
    def head_dim(self) -> int:
        """Query/key width per (sub-)head: ``d`` of SPEC sections 1-2."""
        return self.dim // (self.width_parts * self.n_heads)

    @property
    def uses_head_norm(self) -> bool:
        """Whether each head's output goes through the per-head RMSNorm: ``head_norm`` if given,
        else the kind's default (``diff``: ``use_subln``, i.e. on unless turned off the old way;
        every other kind: off)."""
        if self.head_norm is not None:
            return self.head_norm
        return self.kind_class.head_norm_default and self.use_subln

    @property
    def gate_kind(self) -> Optional[str]:
        """The output gate of a kind that reads ``gate`` (``gated``; default ``"elementwise"``); else ``None``."""
        if "gate" not in self.kind_class.config_fields:
            return None
        return self.gate or "elementwise"

    def options_dict(self) -> dict:
        """A registered kind's options with their defaults filled in (its ``Options``), as keywords; ``{}`` for a
        kind without options."""
        cls = self.kind_class.Options
        return {} if cls is None else dataclasses.asdict(cls(**(self.options or {})))

    def plain(self, **changes) -> "ModelConfig":
        """This config with every attention option at its default (no ablation, gate or kind options; ``qkv_bias``
        kept), then ``changes``: what a parameter-matched baseline starts from."""
        return self.replace(**{**_PLAIN, **changes})

    @property
    def hidden_dim(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return 64 * math.ceil(8 * self.dim / 3 / 64)

    # -- (de)serialisation ----------------------------------------------------------------------
    def to_dict(self) -> dict:
        """All fields, except those added later (``gate``, ``head_norm``, ``subtract``, ``rope``, ``init``,
        ``out_scale``, ``qkv_bias``) while they hold their defaults: a config that does not use them serialises
        exactly as before."""
        data = asdict(self)
        for name, default in _LATER_FIELDS.items():
            if data[name] is default or (isinstance(default, str) and data[name] == default):
                del data[name]
        return data

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
    """The parameter-matched baseline of a config (SPEC section 1; docs/design.md): what the attention kind's
    ``baseline_config`` says.

    ``diff``: standard attention with ``2H`` heads of width ``d`` and ``2Hkv`` kv heads, the
    same projections and RoPE; parameters equal up to the lambda vectors and ``subln`` gains.
    The DIFF options (``lambda_init``, ``head_norm``/``use_subln``, ``subtract``) are dropped.
    ``diff_v2``: standard attention with ``H`` heads of width ``d`` and ``Hkv`` kv heads (the V2
    paper's comparison; V2 has ``dim*dim + dim*H`` more attention parameters).
    ``gated``: the same heads without the gate (the gate's ``W_g`` is all it adds).
    ``standard``: returned unchanged, or without its per-head norm if it has one.
    A registered kind: its own rule (by default standard attention with its query/key width).
    :func:`attention_parameter_delta` lists what each kind adds to its baseline.
    """
    return config.kind_class.baseline_config(config)


# the option fields at their defaults: what a config without any ablation, gate or kind options holds
_PLAIN = dict(lambda_init=None, use_subln=True, gate=None, head_norm=None, subtract=True, options=None,
              out_scale=None)
# fields that only some kinds accept (checked like the options above) but that a parameter-matched baseline keeps:
# the q/k/v biases are part of the projections a baseline shares, not an ablation of one kind
_KEPT = dict(qkv_bias=False)


def attention_parameter_delta(config: ModelConfig) -> list[tuple[str, int, str]]:
    """What one layer of ``config`` holds beyond its :func:`baseline_config`, as
    ``(parameters, count, formula or reason)`` rows (``D`` width, ``H`` the config's ``n_heads``, ``d`` its
    ``head_dim``): the attention kind's ``parameter_delta``. The model's difference is ``n_layers`` times the
    sum (tests check it)."""
    return config.kind_class.parameter_delta(config)


# -- arms: the configurations a paired comparison can hold (the table itself: difftx/arm_table.py) ---------------


def arm_names() -> list[str]:
    """The names an arm can have: :data:`ARMS`, then every attention kind registered beyond the built-in ones
    (:func:`~difftx.attention.registry.register_attention`)."""
    from .attention.registry import BUILTIN_KINDS

    builtin = set(BUILTIN_KINDS.values())
    return [*ARMS, *(n for n, c in ATTENTIONS.items() if c not in builtin and n not in ARMS)]


def arm_config(base: ModelConfig, arm: str) -> ModelConfig:
    """The config of ``arm`` (a name of :data:`ARMS`) derived from the DIFF V1 config ``base``.

    Every arm keeps ``base``'s width, depth, vocabulary, MLP, RoPE and backend, so its
    same-named parameters start from the same values as the other arms' (paired initialisation).
    ``diff`` is ``base`` itself; arms named ``diff_*``/``no_subtraction`` change one option of
    it; ``baseline*``, ``gated*`` and ``diff_v2`` start from the plain options. ``diff_v2``
    uses ``n_heads = 2H`` (its ``2H`` output heads have DIFF's component width ``d`` and its kv
    heads the baseline's), so that its own ``baseline_config`` is the ``baseline`` arm.
    A registered kind (:func:`arm_names`) is the arm of its name: heads of DIFF's query/key width ``d``
    (``2H / components`` of them, the baseline's count for a one-map kind), options at their defaults.
    """
    if not isinstance(base, ModelConfig) or base.attention != "diff":
        got = base.attention if isinstance(base, ModelConfig) else type(base).__name__
        raise ValueError(f"arm_config: base must be a DIFF V1 ModelConfig (attention='diff'), got {got!r}")
    if arm not in ARMS:
        if arm not in arm_names():
            raise ValueError(f"unknown arm {arm!r}; choose one of {arm_names()}")
        C = ATTENTIONS[arm].components
        return base.plain(attention=arm, n_heads=2 * base.n_heads // C, n_kv_heads=2 * base.kv_groups // C)
    baseline = baseline_config(base)
    H, Hkv = base.n_heads, base.kv_groups
    wide = base.replace(attention="standard", n_heads=H, n_kv_heads=Hkv, **_PLAIN)
    derived = {
        "baseline": lambda: baseline,
        "diff": lambda: base,
        "diff_v2": lambda: base.replace(attention="diff_v2", n_heads=2 * H, n_kv_heads=2 * Hkv, **_PLAIN),
        "gated": lambda: baseline.replace(attention="gated", gate="elementwise"),
        "gated_headwise": lambda: baseline.replace(attention="gated", gate="headwise"),
        # the gate's D x 2H*d weights paid for by round(2H*d / 3) fewer SwiGLU hidden units (3 D each)
        "gated_matched": lambda: baseline.replace(attention="gated", gate="elementwise",
                                                  ffn_hidden=base.hidden_dim - round(2 * H * base.head_dim / 3)),
        "no_subtraction": lambda: base.replace(subtract=False),
        "diff_no_head_norm": lambda: base.replace(head_norm=False),
        **{f"diff_lambda_{v}": (lambda v=v: base.replace(lambda_init=float(v)))
           for v in ("0.2", "0.4", "0.5", "0.6", "0.8")},
        "diff_out_0.2": lambda: base.replace(out_scale=0.2),
        "diff_lambda_0.8_out_0.8": lambda: base.replace(lambda_init=0.8, out_scale=0.8),
        **{f"baseline{norm}_out_{v}": (lambda v=v, norm=norm: baseline.replace(
            head_norm=True if norm else None, out_scale=v if v == "schedule" else float(v)))
           for v in ("0.2", "0.8", "schedule") for norm in ("", "_head_norm")},
        "baseline_head_norm": lambda: baseline.replace(head_norm=True),
        "baseline_wide": lambda: wide,
        "baseline_wide_head_norm": lambda: wide.replace(head_norm=True),
        "temperature": lambda: baseline.replace(attention="temperature"),
        "diff_nope": lambda: base.replace(rope=False),
        "baseline_nope": lambda: baseline.replace(rope=False),
    }
    return derived[arm]()


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


# The files named in DIFFTX_KINDS (difftx --kinds FILE), in this process and its workers: imported once this module
# is complete, so that a kinds file may import any of difftx (a training task's registry too, difftx.compare).
load_kinds()
