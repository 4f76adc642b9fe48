"""Convert a pretrained standard-attention model to differential attention (issue 40).

:func:`convert_model` reads a difftx ``standard`` model folder, or a local transformers Llama, Mistral or Qwen2
folder (read as ``difftx import`` reads it: GQA, tied embeddings, the RoPE layout and Qwen2's q/k/v biases included;
a Mistral or Qwen2 sliding window must cover the whole context), and writes a difftx model
folder of the ``converted`` attention kind (:mod:`difftx.attention.converted`), or of the ``dex`` kind
(:mod:`difftx.attention.dex`) for the method ``dex``.

With ``zero``, ``mirror`` and ``random``, every head keeps the source's query, key and value; it gains a negative
query/key component and computes ``(softmax(Q1 K1^T / sqrt(d)) - lambda * softmax(Q2 K2^T / sqrt(d))) V``.
``lambda`` starts at exactly 0. The method sets the negative component's query and key rows:

- ``zero``: zeros. The second map is then uniform over the visible keys (their running mean), and it stays
  so under training: with both ``Q2`` and ``K2`` zero, each one's gradient is zero. Only lambda learns,
  on that mean. The first recipe of axolotl's converter.
- ``mirror``: a copy of the positive component. The second map starts equal to the first; once lambda
  moves, the two components get gradients of opposite signs and part. Axolotl's mirror recipe.
- ``random``: normal draws with the model's ``init_std``, from ``seed``. The second map starts as a fresh,
  nearly uniform one, and is learned from there.

With q/k/v biases (a Qwen2 source, ``qkv_bias``) the negative component's query and key biases follow its rows:
``mirror`` copies the source's (the second map starts equal to the first), ``zero`` and ``random`` start them at
zero (a zero component stays one; a fresh one starts as difftx initialises a projection, with zero biases). lambda
is 0 at conversion, so any choice keeps the function; this one keeps each method's meaning. The value bias is
the source's.

``dex`` (after DEX, Kong et al. 2025, arXiv 2505.16333) keeps each head's one softmax map and takes the difference
on the value side of selected heads: ``O_h = A_h V_h (I - lambda W)``, ``W`` one learned ``d x d`` map per layer
(the identity at conversion), ``lambda`` from 0 as above. No second map is computed. ``dex_heads`` chooses the
heads: ``"all"`` (the default), a count or a fraction of each layer's heads, the ones whose attention is the most
diffuse (the highest mean attention entropy, normalised by the log of the keys each row sees) on a calibration
sample: the bundled corpus's held-out text through the source's tokenizer when it has one difftx reads, else
random tokens from ``seed`` (a data-free stand-in, recorded as such). The selection and every head's entropy are
recorded in :data:`CONVERSION_NAME`.

Every method preserves the function at conversion, because lambda is 0 there: the second map (the value-side term)
is computed and multiplied by zero. Learning it, and lambda, is what training does (``difftx train --init-from
OUT``). Before anything is written, the converted model's float32 logits are compared with the source's on a
few rows of random tokens; a relative difference above ``1e-5`` is refused. ``seed`` also draws the lambda
vectors (two equal pairs, ``N(0, 0.1)``; see the kinds' docs).

Refused, each with one line naming the field: another transformers ``model_type`` than ``llama``, ``mistral``
and ``qwen2``, what ``difftx import`` refuses (a Mistral or Qwen2 sliding window shorter than the context, RoPE
scaling, Llama's biases, missing or mismatched weights, ...), a difftx model of
another kind or with a per-head norm, and an OUT folder that is not empty (``overwrite`` as for ``difftx
import``). Nothing is downloaded.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from torch import Tensor

from ..attention.modules import LAMBDA_INIT_STD
from ..checkpoint import CONFIG_NAME, WEIGHTS_NAME, CheckpointError, check_weights_fit, load_config, load_state, \
    save_weights
from ..config import ModelConfig
from ..data.sources import bundled_source, iter_documents
from ..data.tokenizer import load_tokenizer
from ..eval.capture import capture_attention
from ..io import atomic_folder, atomic_write, write_json
from ..model import Transformer
from ..training.optim import set_lambda_scale
from .hf import TOKENIZER_SUBDIR, ConversionError, PathLike, _output_dir, read_hf_model, resolve_model_folder
from .hf_tokenizer import TOKENIZER_FILES, copy_tokenizer

METHODS = ("zero", "mirror", "random", "dex")
KIND = "converted"
DEX_KIND = "dex"  # the kind of the method "dex"
DEX_SAMPLE_ROWS, DEX_SAMPLE_TOKENS = 8, 128  # the calibration sample of the head selection (at most max_seq_len)
CONVERSION_NAME = "conversion.json"  # written beside the model: source, method, seed and the logits check
CHECK_ROWS, CHECK_TOKENS = 4, 32  # random token rows (and their length, at most max_seq_len) of the logits check
CHECK_TOLERANCE = 1e-5  # max |converted - source| / max |source| over those logits, float32
SOURCE_TYPES = ("llama", "mistral", "qwen2")  # the transformers model types convert reads (as `difftx import` does)


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert_model` wrote and the check it made."""

    out: Path
    source: str  # "transformers:llama" or "difftx:standard"
    method: str
    seed: int
    max_rel_error: float  # max |converted - source| / max |source| over the checked logits
    rows: int
    tokens: int
    lambda_init: float = 0.0
    attention: str = KIND  # the converted model's kind: "converted", or "dex" for the method dex
    heads: Optional[tuple] = None  # dex: the selected heads of each layer
    head_rule: Optional[str] = None  # dex: how they were chosen

    def summary(self) -> str:
        where = "lambda 0 in every layer" if not self.lambda_init else \
            "with lambda scaled to 0, as at the first step of a lambda warm-up"
        dex = "" if self.heads is None else \
            f"; DEX on {sum(map(len, self.heads))} heads in {len(self.heads)} layers ({self.head_rule})"
        return (f"logits check: max relative difference {self.max_rel_error:.1e} over {self.rows} rows of "
                f"{self.tokens} random tokens (limit {CHECK_TOLERANCE:.0e}, float32), {where}{dex}")

    def warning(self) -> Optional[str]:
        """What the user must know when the model as loaded does not compute the source's function."""
        if not self.lambda_init:
            return None
        return (f"lambda_init={self.lambda_init}: the converted model as loaded subtracts lambda = {self.lambda_init} "
                f"+ its learned part, so it does NOT compute the source's function; it does at the first step of a "
                f"lambda warm-up (`difftx train --init-from OUT --set lambda_warmup=N`)")


# -- reading the source ---------------------------------------------------------------------------------------------

def _hf_model_type(src: Path) -> Optional[str]:
    """The ``model_type`` of ``src/config.json`` when it is a transformers config, else None (a difftx one)."""
    path = src / CONFIG_NAME
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ConversionError(f"{path}: expected a JSON object, got {type(data).__name__}")
    if "model_type" not in data:
        return None
    model_type = data["model_type"]
    where = f"{path}: model_type {model_type!r}"
    if model_type in SOURCE_TYPES:  # read as `difftx import` reads them: a Mistral or Qwen2 window shorter than the
        return model_type           # context is refused there, in one line naming sliding_window
    if model_type == "diffllama":
        raise ConversionError(f"{where} is differential attention already; convert reads 'llama', 'mistral' and "
                              f"'qwen2' folders (read this one with `difftx import`)")
    raise ConversionError(f"{where} is not supported; convert reads transformers 'llama', 'mistral' and 'qwen2' "
                          f"folders and difftx 'standard' models")


def read_source(src: PathLike) -> tuple[str, ModelConfig, dict[str, Tensor], Path]:
    """``(source kind, config, difftx state dict, folder read)`` of a transformers Llama, Mistral or Qwen2 folder or a
    difftx
    ``standard`` model folder (a training run folder means its latest checkpoint); tensors in their stored
    dtype. Raises :class:`ConversionError` naming the field or file."""
    src = Path(src)
    if not src.is_dir():
        raise ConversionError(f"{src}: not a folder (expected a transformers Llama, Mistral or Qwen2 folder or a "
                              f"difftx 'standard' model folder)")
    model_type = _hf_model_type(src)
    if model_type is not None:
        _, config, state = read_hf_model(src)
        return f"transformers:{model_type}", config, state, src
    folder = resolve_model_folder(src)
    try:
        config = load_config(folder)
        state = check_weights_fit(config, load_state(folder), str(folder / WEIGHTS_NAME))
    except CheckpointError as e:
        raise ConversionError(str(e)) from e
    where = folder / CONFIG_NAME
    if config.attention != "standard":
        raise ConversionError(f"{where}: attention={config.attention!r}; convert turns 'standard' models (and "
                              f"transformers Llama, Mistral and Qwen2 folders) differential")
    if config.uses_head_norm:
        raise ConversionError(f"{where}: head_norm=true; the converted kind has no per-head norm (one would change "
                              f"the function at conversion), so this model cannot be converted exactly")
    if config.tie_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}  # stored once, as the embedding
    return "difftx:standard", config, state, folder


# -- the conversion -------------------------------------------------------------------------------------------------

def converted_config(config: ModelConfig, lambda_init: float = 0.0) -> ModelConfig:
    """The ``converted`` config of a standard ``config``: the same heads, kv groups, width and everything else;
    ``lambda_init`` the constant offset of lambda (0: the source's function as loaded)."""
    return config.plain(attention=KIND, lambda_init=float(lambda_init) if lambda_init else None)


def converted_state(config: ModelConfig, state: dict[str, Tensor], method: str = "mirror", seed: int = 0
                    ) -> dict[str, Tensor]:
    """The state dict of :func:`converted_config` ``(config)`` from a standard model's ``state``: the source's
    tensors, each layer's q/k rows paired with the negative component's (``method``; with ``qkv_bias`` their
    biases too: ``mirror`` a copy, ``zero`` and ``random`` zeros), and the lambda vectors (``lq2 = lq1``,
    ``lk2 = lk1``, ``N(0, 0.1)`` from ``seed``: lambda exactly 0)."""
    if method not in METHODS:
        raise ConversionError(f"method: must be one of {list(METHODS)}, got {method!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConversionError(f"seed: must be a non-negative integer, got {seed!r}")
    g = torch.Generator().manual_seed(seed)
    D, H, Hkv, d = config.dim, config.n_heads, config.kv_groups, config.head_dim
    out = dict(state)
    for i in range(config.n_layers):
        a = f"layers.{i}.attn."
        lam = _lambda_pairs(g, d, a)  # drawn first: equal across methods
        for name, heads in (("q_proj.weight", H), ("k_proj.weight", Hkv)):
            pos = state[a + name]  # (heads * d, D), RoPE-interleaved rows per head
            if method == "zero":
                neg = torch.zeros_like(pos)
            elif method == "mirror":
                neg = pos.clone()
            else:
                neg = (torch.randn(pos.shape, generator=g) * config.init_std).to(pos.dtype)
            out[a + name] = torch.stack([pos.view(heads, d, D), neg.view(heads, d, D)], 1).reshape(2 * heads * d, D)
            if config.qkv_bias:  # the bias of each row follows it: a copy for mirror, else a bias at its start, 0
                bias = a + name.replace(".weight", ".bias")
                pos = state[bias]  # (heads * d,)
                neg = pos.clone() if method == "mirror" else torch.zeros_like(pos)
                out[bias] = torch.stack([pos.view(heads, d), neg.view(heads, d)], 1).reshape(2 * heads * d)
        out.update(lam)
    return {k: v.contiguous() for k, v in out.items()}


def _lambda_pairs(g: torch.Generator, d: int, prefix: str) -> dict[str, Tensor]:
    """One layer's lambda vectors as two equal pairs (``lq2 = lq1``, ``lk2 = lk1``, ``N(0, 0.1)`` from ``g``):
    lambda exactly 0, with a gradient."""
    lq, lk = (torch.randn(d, generator=g) * LAMBDA_INIT_STD for _ in range(2))
    return {prefix + "lambda_q1": lq, prefix + "lambda_k1": lk, prefix + "lambda_q2": lq.clone(),
            prefix + "lambda_k2": lk.clone()}


# -- the dex method -------------------------------------------------------------------------------------------------

def dex_config(config: ModelConfig, heads: Optional[Sequence[Sequence[int]]] = None,
               lambda_init: float = 0.0) -> ModelConfig:
    """The ``dex`` config of a standard ``config``: the same heads and everything else; ``heads`` the selected
    heads of each layer (None: every head); ``lambda_init`` the constant offset of lambda (0: the source's
    function as loaded)."""
    options = None if heads is None else {"heads": [[int(h) for h in layer] for layer in heads]}
    return config.plain(attention=DEX_KIND, lambda_init=float(lambda_init) if lambda_init else None, options=options)


def dex_state(config: ModelConfig, state: dict[str, Tensor], seed: int = 0) -> dict[str, Tensor]:
    """The state dict of :func:`dex_config` ``(config)`` from a standard model's ``state``: the source's tensors,
    each layer's ``dex_map`` the identity (float32) and its lambda vectors as two equal pairs from ``seed``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ConversionError(f"seed: must be a non-negative integer, got {seed!r}")
    g = torch.Generator().manual_seed(seed)
    d = config.head_dim
    out = dict(state)
    for i in range(config.n_layers):
        a = f"layers.{i}.attn."
        out.update(_lambda_pairs(g, d, a))
        out[a + "dex_map"] = torch.eye(d)
    return {k: v.contiguous() for k, v in out.items()}


def dex_head_count(spec: Union[None, str, int, float], n_heads: int) -> Optional[int]:
    """The heads per layer ``spec`` asks for: None for every head (``None``, ``"all"``, the count ``n_heads``, the
    fraction 1.0); else a count from 1 to ``n_heads - 1``. An integer is a count, a float ``F`` in ``(0, 1]`` a
    fraction (``ceil(F * H)`` heads). Raises :class:`ConversionError` naming ``dex_heads``."""
    value = spec
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "all":
            return None
        try:
            value = int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                value = spec
    if value is None:
        return None
    rule = f"'all', a count of heads per layer (1 to {n_heads}) or a fraction in (0, 1]"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConversionError(f"dex_heads: must be {rule}, got {spec!r}")
    if isinstance(value, float):
        if not 0 < value <= 1:
            raise ConversionError(f"dex_heads: a fraction must be in (0, 1] (a count is a whole number), got {spec!r}")
        count = math.ceil(value * n_heads - 1e-9)
    else:
        count = int(value)
        if not 1 <= count <= n_heads:
            raise ConversionError(f"dex_heads: must be {rule}; the source has {n_heads} heads per layer, got {spec!r}")
    return None if count >= n_heads else count


def head_entropies(model: Transformer, tokens: Tensor) -> Tensor:
    """``(L, H)``: each head's mean attention entropy on ``tokens`` ``(B, T)``, every query row's entropy divided
    by the log of the keys it sees (1 for a uniform map, 0 for one key), the first row (one key) left out."""
    found: dict[int, Tensor] = {}

    def add(cap) -> None:
        p = cap.probs  # (B, H, T, S), causal from key 0
        ent = -(p * p.clamp_min(1e-30).log()).sum(-1)[..., 1:]  # (B, H, T - 1)
        keys = torch.arange(2, p.shape[-2] + 1, dtype=ent.dtype)  # row t sees t + 1 keys
        found[cap.layer] = (ent / keys.log()).mean((0, 2))

    with torch.no_grad(), capture_attention(model, store=False, callback=add):
        model(tokens)
    return torch.stack([found[i] for i in range(len(found))])


def _bundled_heldout_text() -> tuple[str, str]:
    """The first held-out document of the bundled corpus: ``(text, origin)``."""
    for doc in iter_documents([bundled_source()]):
        if doc.split == "val":
            return doc.text, doc.origin
    raise ConversionError("the bundled corpus has no held-out document")  # pragma: no cover - it has several


def dex_sample(source: str, folder: Path, config: ModelConfig, seed: int = 0) -> tuple[Tensor, str]:
    """The calibration sample of the head selection, ``(tokens (rows, T), what they are)``: the bundled corpus's
    held-out text through the source's tokenizer (a transformers folder's ``tokenizer.json``, a difftx checkpoint's
    ``tokenizer/``) when it has one whose ids fit the model; else random tokens from ``seed``."""
    T = min(DEX_SAMPLE_TOKENS, config.max_seq_len)
    n = DEX_SAMPLE_ROWS * T
    path = folder / "tokenizer.json" if source.startswith("transformers:") else folder / TOKENIZER_SUBDIR
    if path.exists():
        try:
            tok = load_tokenizer(path)
        except (OSError, ValueError, ImportError) as e:
            raise ConversionError(f"{path}: cannot read the source's tokenizer for the head selection's sample "
                                  f"({e}); choose the heads without it (dex_heads='all')") from e
        if tok.vocab_size <= config.vocab_size:
            text, origin = _bundled_heldout_text()
            ids = tok.encode(text[:64 * n])
            if len(ids) >= n:
                return torch.tensor(ids[:n]).view(DEX_SAMPLE_ROWS, T), \
                    f"{DEX_SAMPLE_ROWS} rows of {T} tokens of the bundled {origin} through the source's tokenizer"
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (DEX_SAMPLE_ROWS, T), generator=g), \
        f"{DEX_SAMPLE_ROWS} rows of {T} random tokens (no tokenizer of the source that difftx reads)"


def select_dex_heads(entropy: Tensor, count: int) -> list[list[int]]:
    """Per layer, the ``count`` heads of the highest ``entropy`` ``(L, H)`` (ties: the lower index), sorted."""
    return [sorted(sorted(range(len(row)), key=lambda h: (-float(row[h]), h))[:count]) for row in entropy]


def _choose_dex_heads(spec, src_model: Transformer, source: str, folder: Path, config: ModelConfig,
                      seed: int) -> tuple[Optional[list[list[int]]], dict]:
    """``(heads or None for every head, the record of the choice)`` for ``dex_heads=spec``."""
    H, L = config.n_heads, config.n_layers
    if isinstance(spec, (list, tuple)):  # explicit per-layer lists (the Python API)
        heads = [list(layer) for layer in spec]
        try:
            dex_config(config, heads)
        except ValueError as e:
            raise ConversionError(f"dex_heads: {e}") from e
        return heads, {"rule": "given", "heads": heads}
    count = dex_head_count(spec, H)
    if count is None:
        return None, {"rule": "all", "heads": [list(range(H)) for _ in range(L)]}
    tokens, what = dex_sample(source, folder, config, seed)
    entropy = head_entropies(src_model, tokens)
    heads = select_dex_heads(entropy, count)
    return heads, {"rule": f"the {count} of {H} heads per layer of the highest attention entropy", "sample": what,
                   "heads": heads, "entropy": [[round(float(e), 6) for e in row] for row in entropy]}


def float32_model(config: ModelConfig, state: dict[str, Tensor], source: str = "state dict") -> Transformer:
    """A float32 model of ``config`` holding ``state`` (no random initialisation drawn)."""
    with torch.device("meta"):
        model = Transformer(config)
    model.to_empty(device="cpu")
    state = check_weights_fit(config, {k: v.float() for k, v in state.items()}, source)
    model.load_state_dict(state)
    return model.eval()


def logits_difference(source: Transformer, converted: Transformer, seed: int = 0) -> tuple[float, int, int]:
    """``(max |converted - source| / max |source|, rows, tokens)`` of both models' logits on random token rows
    (eager kernel, float32)."""
    c = source.config
    T = min(CHECK_TOKENS, c.max_seq_len)
    x = torch.randint(0, c.vocab_size, (CHECK_ROWS, T), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        a, b = source(x, backend="eager"), converted(x, backend="eager")
    return float((a - b).abs().max() / a.abs().max()), CHECK_ROWS, T


def convert_model(src: PathLike, out: PathLike, *, method: str = "mirror", seed: int = 0,
                  overwrite: bool = False, lambda_init: float = 0.0,
                  dex_heads: Union[None, str, int, float, Sequence[Sequence[int]]] = None) -> Conversion:
    """Convert the standard-attention model in ``src`` (a transformers Llama, Mistral or Qwen2 folder, or a difftx
    ``standard`` model, checkpoint or run folder) into a ``converted`` difftx model folder ``out`` (a ``dex`` one for
    the method ``dex``) that :func:`difftx.checkpoint.load_model` and ``difftx train --init-from`` read:
    ``config.json``, ``model.safetensors`` (the source's dtype; the lambda vectors and ``dex_map`` float32),
    :data:`CONVERSION_NAME`, and the source's tokenizer in ``tokenizer/``. See the module doc for ``method`` and what
    is refused.

    ``dex_heads`` (method ``dex`` only): ``"all"`` (None, the default), a count (int) or fraction (float in
    ``(0, 1]``) of each layer's heads, chosen by their attention entropy (see the module doc), or explicit lists
    of head indices, one per layer.

    The converted model's float32 logits are checked against the source's first; a relative difference above
    :data:`CHECK_TOLERANCE` is a :class:`ConversionError` and nothing is written. ``out`` follows
    ``difftx import``'s rule: a non-empty folder is refused unless ``overwrite`` (never a folder holding a run, a
    comparison or a study); the folder is assembled beside it and renamed into place.

    ``lambda_init`` (in ``[0, 1)``) is a constant offset of lambda, reached during fine-tuning by a lambda warm-up
    (``TrainConfig.lambda_warmup``); above 0 the model as loaded does not compute the source's function, so the
    logits check is made with lambda scaled to 0, as the warm-up's first step computes it
    (:meth:`Conversion.warning` says so)."""
    if method not in METHODS:
        raise ConversionError(f"method: must be one of {list(METHODS)}, got {method!r}")
    if isinstance(lambda_init, bool) or not isinstance(lambda_init, (int, float)) or not 0 <= lambda_init < 1:
        raise ConversionError(f"lambda_init: must be a number in [0, 1), got {lambda_init!r}")
    if dex_heads is not None and method != "dex":
        raise ConversionError(f"dex_heads: applies only to method 'dex' (got method {method!r})")
    src = Path(src)
    _output_dir(out, [src], overwrite)  # before reading the weights
    source, config, state, folder = read_source(src)
    src_model = float32_model(config, state, str(folder))
    kind, dex = KIND, None
    if method == "dex":
        kind = DEX_KIND
        heads, dex = _choose_dex_heads(dex_heads, src_model, source, folder, config, seed)
        conv_config, conv_state = dex_config(config, heads, lambda_init), dex_state(config, state, seed)
    else:
        conv_config, conv_state = converted_config(config, lambda_init), converted_state(config, state, method, seed)
    conv_model = float32_model(conv_config, conv_state, "the converted weights")
    lambdas = [block.attn.lambda_reading() for block in conv_model.layers]  # the offset alone (float32)
    if any(abs(lam - lambda_init) > 1e-6 for lam in lambdas):  # pragma: no cover - the pairs are equal by construction
        raise ConversionError(f"lambda: not 0 after conversion ({lambdas}); nothing written")
    if lambda_init:  # the first step of a warm-up: lambda scaled to 0
        set_lambda_scale(conv_model, 0.0)
    err, rows, tokens = logits_difference(src_model, conv_model, seed)
    if not err <= CHECK_TOLERANCE:
        raise ConversionError(f"logits check: the converted model's float32 logits differ from the source's by "
                              f"{err:.2e} (relative), above {CHECK_TOLERANCE:.0e}; nothing written")
    result = Conversion(Path(out), source, method, seed, err, rows, tokens, float(lambda_init), kind,
                        None if dex is None else tuple(tuple(h) for h in dex["heads"]),
                        None if dex is None else dex["rule"])
    record = {"source": str(folder.resolve()), "source_kind": source, "method": method, "seed": seed,
              "attention": kind, "lambda": float(lambda_init), "lambda_init": float(lambda_init),
              "function_preserving": "as loaded" if not lambda_init else "at lambda scale 0 (a warm-up's first step)",
              "logits_check": {"rows": rows, "tokens": tokens, "max_rel_error": err, "tolerance": CHECK_TOLERANCE,
                               "lambda_scale": 0.0 if lambda_init else 1.0}}
    if dex is not None:
        record["dex"] = dex
    out = _output_dir(out, [src, folder], overwrite)
    meta = {"format": "difftx", "source": source, "converted": method, "seed": str(seed)}
    with atomic_folder(out, replace=True) as tmp:
        save_weights(tmp / WEIGHTS_NAME, conv_state, meta)
        atomic_write(tmp / CONFIG_NAME, lambda p: Path(p).write_text(conv_config.to_json() + "\n"))
        write_json(tmp / CONVERSION_NAME, record, indent=2)
        if source.startswith("transformers:"):
            if any((folder / name).is_file() for name in TOKENIZER_FILES):
                copy_tokenizer(folder, tmp / TOKENIZER_SUBDIR)
        elif (folder / TOKENIZER_SUBDIR).is_dir():  # a training checkpoint's tokenizer
            shutil.copytree(folder / TOKENIZER_SUBDIR, tmp / TOKENIZER_SUBDIR)
    return result
