"""Hugging Face ``transformers`` folders <-> difftx model folders (SPEC section 4).

``diff`` models map to ``DiffLlamaForCausalLM`` (model_type ``diffllama``), ``standard``
models to ``LlamaForCausalLM`` (model_type ``llama``), ``standard`` models with q/k/v biases (``qkv_bias``) to
``Qwen2ForCausalLM`` (model_type ``qwen2``: Llama's architecture plus those biases); a ``MistralForCausalLM`` folder
(model_type ``mistral``) whose sliding window covers its whole context is read as a ``standard`` model too (it
computes what Llama computes), as is a Qwen2 folder without a window shorter than its context; ``diff_v2``,
``gated`` and the options
that change what a head computes (no per-head norm or a constant ``lambda_init`` for ``diff``,
the no-subtraction control, a per-head norm for ``standard``) have no equivalent: :func:`export_hf`
writes those with difftx's own modeling code (:mod:`difftx.interop.remote`, ``trust_remote_code``), or, with
``fold="llama"``, a plain Llama for the kinds a Llama computes with other weights (:mod:`difftx.interop.fold`). The
converters only move tensors between safetensors files, so this module does not import
``transformers``; the tests prove each conversion by comparing logits with transformers'
own implementation.

Legend: ``D`` model width, ``H`` differential heads, ``Hkv`` kv groups, ``d`` component
(head) width, ``c`` component (0 or 1), ``i < d/2`` a RoPE frequency index.

Row layouts of the attention projections (each row is one output channel)::

    tensor   difftx (diff)                     DiffLlama
    q_proj   (H,   c, d): sub-head 2h + c      (c, H,   d): head c*H + h
    k_proj   (Hkv, c, d): sub-head 2g + c      (c, Hkv, d): head c*Hkv + g
    v_proj   (Hkv, c, d): the 2d value of g    (c, Hkv, d): head c*Hkv + g (d wide)
    o_proj   columns (H, 2d), unchanged; DiffLlama's per-head norm has no gain, so ours
             (``subln.weight``, 2d wide, shared by heads) is folded into the columns:
             o_proj[:, h*2d + j] = out_proj[:, h*2d + j] * subln[j]

RoPE: difftx rotates dims ``(2i, 2i+1)`` of each q/k head (GPT-J), transformers rotates
``(i, i + d/2)`` (rotate-half, NeoX), same frequencies; so within every d-wide q/k head,
HF row ``c*d/2 + i`` is difftx row ``2i + c``. Values are not rotated and keep their order.
A bias (Qwen2's q/k/v) is one entry per row: it moves with its row.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor
from tqdm.auto import tqdm

from ..checkpoint import (CONFIG_NAME, WEIGHTS_NAME, CheckpointError, load_config, load_state, save_weights,
                          verify_digest)
from ..config import ModelConfig
from ..io import atomic_folder, atomic_write, work_marker, write_json
from ..model import Transformer
from ..training.checkpointing import resolve_checkpoint
from . import remote
from .fold import check_fold, to_llama
from .hf_tokenizer import TOKENIZER_FILES, copy_tokenizer, export_tokenizer
from .state import ConversionError, _check_shapes, _expected_state

PathLike = Union[str, os.PathLike]

HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
TOKENIZER_SUBDIR = "tokenizer"  # where training checkpoints keep their tokenizer
# DiffLlama's lambda init std (only used by transformers to initialise new models); ours is reset_lambda's 0.1
LAMBDA_STD_DEV = 0.1


# -- permutations (pure functions on weight matrices ``(rows, in)``) -----------------------------

def rope_interleaved_to_half(w: Tensor, d: int) -> Tensor:
    """Rows of ``d``-wide heads from GPT-J order ``(i, c)`` to rotate-half order ``(c, i)``."""
    n = w.shape[0] // d
    return w.reshape(n, d // 2, 2, -1).transpose(1, 2).reshape(n * d, -1)  # (n, d/2, 2, in) -> (n, 2, d/2, in)


def rope_half_to_interleaved(w: Tensor, d: int) -> Tensor:
    """Inverse of :func:`rope_interleaved_to_half`."""
    n = w.shape[0] // d
    return w.reshape(n, 2, d // 2, -1).transpose(1, 2).reshape(n * d, -1)  # (n, 2, d/2, in) -> (n, d/2, 2, in)


def pairs_to_halves(w: Tensor, d: int) -> Tensor:
    """Rows ``(G, c, d)`` (difftx: components adjacent) to ``(c, G, d)`` (DiffLlama: by halves)."""
    g = w.shape[0] // (2 * d)
    return w.reshape(g, 2, d, -1).transpose(0, 1).reshape(2 * g * d, -1)  # (G, 2, d, in) -> (2, G, d, in)


def halves_to_pairs(w: Tensor, d: int) -> Tensor:
    """Inverse of :func:`pairs_to_halves`."""
    g = w.shape[0] // (2 * d)
    return w.reshape(2, g, d, -1).transpose(0, 1).reshape(2 * g * d, -1)  # (2, G, d, in) -> (G, 2, d, in)


# -- configs ----------------------------------------------------------------------------------------

# the transformers model types difftx reads and writes, and the attention kind each becomes (the kinds name
# their model type in ``hf_model_type``; Qwen2 is Llama's layout with q/k/v biases, ModelConfig.qkv_bias: these
# layouts are what this module converts)
HF_LAYOUTS = {"diffllama": "diff", "llama": "standard", "qwen2": "standard"}
# the model types difftx reads: those it writes, and Mistral. MistralForCausalLM is LlamaForCausalLM without its
# bias switches (no biases at all) plus a sliding-window mask: query i sees keys i - sliding_window + 1 .. i. A
# window of at least max_position_embeddings (difftx's max_seq_len) hides no key of any sequence that long, so
# such a folder is read as a Llama one; a shorter window is refused (see _check_window). Qwen2's window applies
# only with use_sliding_window, in its sliding layers (layer_types, else those from max_window_layers on): the
# same rule holds there (see _check_qwen2_window).
HF_READS = {**HF_LAYOUTS, "mistral": "standard"}
# transformers' defaults (the config classes') for the fields a config.json may leave out, where they matter here
_HF_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "diffllama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-5},
    "mistral": {"max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-6, "num_key_value_heads": 8,
                "sliding_window": 4096},
    "qwen2": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "num_key_value_heads": 32,
              "sliding_window": 4096, "max_window_layers": 28},
}

def check_exportable(config: ModelConfig) -> None:
    """Raise :class:`ConversionError` unless ``config`` has an exact transformers equivalent (the attention
    kind's ``hf_refusal`` says why not)."""
    kind = config.kind_class
    reason = kind.hf_refusal(config)
    if reason is None and not config.rope:
        reason = ("rope=false (NoPE) cannot be exported: Llama and DiffLlama always rotate q and k by RoPE, and no "
                  "rope setting of theirs turns it off")
    if reason is None and kind.hf_model_type not in HF_LAYOUTS:
        reason = (f"attention={config.attention!r} names transformers model_type {kind.hf_model_type!r}, which "
                  f"difftx cannot write (it writes {sorted(HF_LAYOUTS)})")
    if reason is not None:
        raise ConversionError(reason)


def _is_diff(config: ModelConfig) -> bool:
    """Whether ``config``'s kind has DiffLlama's layout (paired heads, lambda vectors, a per-head norm)."""
    return config.kind_class.hf_model_type == "diffllama"


def hf_model_type(config: ModelConfig) -> str:
    """The transformers ``model_type`` an exportable ``config`` is written as: ``diffllama``, ``llama``, or ``qwen2``
    for a Llama layout with q/k/v biases (``qkv_bias``)."""
    kind = config.kind_class.hf_model_type
    return "qwen2" if kind == "llama" and config.qkv_bias else kind


_ARCHITECTURES = {"diffllama": "DiffLlamaForCausalLM", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def hf_config(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The transformers ``config.json`` (as a dict) of the exported ``config``."""
    check_exportable(config)
    diff, model_type = _is_diff(config), hf_model_type(config)
    n_heads = 2 * config.n_heads if diff else config.n_heads  # transformers counts d-wide heads
    n_kv = 2 * config.kv_groups if diff else config.kv_groups
    out = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.dim,
        "intermediate_size": config.hidden_dim,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_seq_len,
        "initializer_range": config.init_std,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,  # transformers 4.x reads this key ...
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},  # ... and 5.x this one
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
        "use_cache": True,
        "dtype": _dtype_name(dtype),  # transformers 5.x
        "torch_dtype": _dtype_name(dtype),  # transformers 4.x
    }
    if diff:
        out["lambda_std_dev"] = LAMBDA_STD_DEV
    elif model_type == "qwen2":  # q/k/v biases always on, o_proj and the MLP without: no switches to set
        del out["attention_bias"]
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=config.n_layers,
                   layer_types=["full_attention"] * config.n_layers)
    else:
        out["mlp_bias"] = False
        out["pretraining_tp"] = 1
    return out


def _check_window(window, context: int, source: str, model: str = "Mistral", where: str = "") -> Optional[str]:
    """Refuse a ``sliding_window`` that hides keys from a sequence of ``context`` tokens (null: none); ``where``
    says which layers it applies to, when not all. A window that covers the context: the note to give once the
    folder is read (the model matches on sequences up to the window only)."""
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ConversionError(f"{source}: sliding_window must be null or an integer >= 1, got {window!r}")
    if window < context:
        raise ConversionError(f"{source}: sliding_window={window} is shorter than the context "
                              f"(max_position_embeddings={context}){where}: difftx attends to the whole context and "
                              f"cannot compute {model}'s windowed attention")
    return (f"{source}: sliding_window={window}{where}: the model read computes {model}'s function on sequences of "
            f"up to {window} tokens; on longer ones difftx attends to every key, {model} to the last {window} only")


def _check_qwen2_window(hf: dict, layers: int, context: int, source: str) -> Optional[str]:
    """Refuse a Qwen2 config whose sliding window hides keys in some layer from a sequence of ``context`` tokens.
    As ``Qwen2Config`` reads it: no window unless ``use_sliding_window``; then ``sliding_window`` (null: none) in the
    layers ``layer_types`` names ``sliding_attention``, or without ``layer_types`` those from ``max_window_layers``
    on."""
    defaults = _HF_DEFAULTS["qwen2"]
    use = hf.get("use_sliding_window", False)
    if not isinstance(use, bool):
        raise ConversionError(f"{source}: use_sliding_window must be true or false, got {use!r}")
    window = hf.get("sliding_window", defaults["sliding_window"])
    if not use or window is None:
        return None
    types = hf.get("layer_types")
    if types is None:
        first = hf.get("max_window_layers", defaults["max_window_layers"])
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            raise ConversionError(f"{source}: max_window_layers must be an integer >= 0, got {first!r}")
        sliding, rule = list(range(first, layers)), f"max_window_layers={first}"
    else:
        kinds = ("full_attention", "sliding_attention")
        if not isinstance(types, list) or len(types) != layers or any(t not in kinds for t in types):
            raise ConversionError(f"{source}: layer_types must list {layers} of {kinds}, got {types!r}")
        sliding, rule = [i for i, t in enumerate(types) if t == "sliding_attention"], "layer_types"
    if not sliding:
        return None
    where = f" in layer(s) {sliding[:8]} ({rule}, use_sliding_window=true)"
    return _check_window(window, context, source, "Qwen2", where)


def config_from_hf(hf: dict, source: str = "config.json") -> ModelConfig:
    """The difftx :class:`ModelConfig` of a DiffLlama, Llama, Mistral or Qwen2 ``config.json`` dict (fields it
    leaves out take their transformers class's default). Qwen2 is read as ``standard`` with ``qkv_bias``.

    Raises :class:`ConversionError` (naming ``source``) for anything difftx cannot represent
    exactly: Llama's biases, non-SiLU MLPs, scaled or partial RoPE, odd head counts in DiffLlama, a
    Mistral or Qwen2 sliding window shorter than the context, ...
    """
    def need(key: str):
        if key not in hf:
            raise ConversionError(f"{source}: missing field {key!r}")
        return whole(key, hf[key])

    def whole(key: str, value, minimum: int = 1):
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ConversionError(f"{source}: {key} must be an integer >= {minimum}, got {value!r}")
        return value

    def refuse(rule: str) -> ConversionError:
        return ConversionError(f"{source}: {rule}")

    model_type = hf.get("model_type")
    if model_type is None:
        raise refuse("no 'model_type' field, which names the transformers architecture of the weights: add it ("
                     + ", ".join(f"{t!r}" for t in HF_READS) + " are read) and run the command again")
    if model_type not in HF_READS:
        raise refuse(f"model_type {model_type!r} is not supported; difftx imports " + ", ".join(
            f"{t!r} (-> attention={k!r})" for t, k in HF_READS.items()))
    diff = model_type == "diffllama"
    defaults = _HF_DEFAULTS[model_type]
    D, L, V = need("hidden_size"), need("num_hidden_layers"), need("vocab_size")
    n_heads = need("num_attention_heads")
    n_kv = hf.get("num_key_value_heads", defaults.get("num_key_value_heads"))  # an explicit null: one per head
    n_kv = n_heads if n_kv is None else whole("num_key_value_heads", n_kv)
    head_dim = D // n_heads if hf.get("head_dim") is None else whole("head_dim", hf["head_dim"])
    context = whole("max_position_embeddings", hf.get("max_position_embeddings", defaults["max_position_embeddings"]))
    windowed = model_type in ("mistral", "qwen2")  # their window fields are read; any other type's is refused
    window_note = _check_window(hf.get("sliding_window", defaults["sliding_window"]), context, source) \
        if model_type == "mistral" else _check_qwen2_window(hf, L, context, source) if model_type == "qwen2" else None
    for key in ("quantization_config",) if windowed else ("sliding_window", "quantization_config"):
        if hf.get(key):
            raise refuse(f"{key}={hf[key]!r}: difftx attends to the whole context with unquantised weights; "
                         "it cannot represent this model exactly")
    if hf.get("hidden_act", "silu") != "silu":
        raise refuse(f"hidden_act={hf['hidden_act']!r}: difftx's MLP is SwiGLU (silu) only")
    for key in ("attention_bias", "mlp_bias") if model_type != "qwen2" else ():  # Qwen2 reads neither switch
        if hf.get(key):
            raise refuse(f"{key}=true: difftx's projections have no bias (but q/k/v biases alone, as Qwen2's)")
    rope = hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise refuse(f"rope_parameters must be an object, got {rope!r}")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" or hf.get("rope_scaling"):
        raise refuse(f"RoPE scaling ({rope_type!r} / rope_scaling={hf.get('rope_scaling')!r}) is not supported; "
                     "difftx implements plain RoPE")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise refuse("partial_rotary_factor != 1 is not supported; difftx rotates whole heads")
    theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0))
    if head_dim * n_heads != D:
        raise refuse(f"head_dim={head_dim} * num_attention_heads={n_heads} != hidden_size={D}; difftx needs "
                     "the attention width to equal the model width")
    if n_heads % n_kv:
        raise refuse(f"num_attention_heads={n_heads} must be divisible by num_key_value_heads={n_kv}")
    if diff:
        if n_heads % 2 or n_kv % 2:
            raise refuse(f"DiffLlama pairs heads by halves, so num_attention_heads ({n_heads}) and "
                         f"num_key_value_heads ({n_kv}) must both be even (transformers refuses odd kv heads too)")
        n_heads, n_kv = n_heads // 2, n_kv // 2
    ffn = need("intermediate_size")
    try:
        cfg = ModelConfig(
            vocab_size=V, dim=D, n_layers=L, n_heads=n_heads, n_kv_heads=None if n_kv == n_heads else n_kv,
            attention=HF_READS[model_type], ffn_hidden=ffn,
            max_seq_len=context, rope_theta=float(theta),
            # transformers' defaults when the field is missing: DiffLlama 1e-5, Llama, Mistral and Qwen2 1e-6
            norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)), qkv_bias=model_type == "qwen2")
    except (TypeError, ValueError) as e:
        raise refuse(f"no valid difftx config: {e}") from e
    if cfg.replace(ffn_hidden=None).hidden_dim == ffn:
        cfg = cfg.replace(ffn_hidden=None)  # the default SwiGLU width: keep the config minimal
    if window_note is not None:  # once every check passed: a refused folder gets its error line alone
        import warnings

        warnings.warn(window_note, stacklevel=2)
    return cfg


# -- state dicts ------------------------------------------------------------------------------------

def _progress(it, desc: str):
    return tqdm(it, desc=desc, unit="layer", disable=None, leave=False)


# difftx state-dict names -> transformers names: the whole model, then each layer (``subln.weight``
# has no counterpart: it is folded into o_proj on export and becomes ones on import)
_MODEL_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "mlp_norm.weight": "post_attention_layernorm.weight",
                **{f"mlp.{n}.weight": f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")},
                **{f"attn.{n}.weight": f"self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj")},
                "attn.out_proj.weight": "self_attn.o_proj.weight"}
_DIFF_NAMES = {f"attn.{n}": f"self_attn.{n}" for n in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2")}
_BIAS_NAMES = {f"attn.{n}.bias": f"self_attn.{n}.bias" for n in ("q_proj", "k_proj", "v_proj")}  # Qwen2's


def _per_row(permute: Callable[[Tensor, int], Tensor], t: Tensor, d: int) -> Tensor:
    """``permute`` (a row permutation above) applied to a weight ``(rows, in)`` or a bias ``(rows,)``."""
    return permute(t, d) if t.dim() > 1 else permute(t[:, None], d)[:, 0]


def hf_names(config: ModelConfig) -> dict[str, str]:
    """Every tensor name of ``config``'s difftx state dict that transformers has -> its name there
    (read backwards by :func:`to_difftx_state`)."""
    names = dict(_MODEL_NAMES)
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    layer = {**_LAYER_NAMES, **(_DIFF_NAMES if _is_diff(config) else {}), **(_BIAS_NAMES if config.qkv_bias else {})}
    for i in range(config.n_layers):
        names.update({f"layers.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in layer.items()})
    return names


def to_hf_state(config: ModelConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """difftx state dict -> transformers state dict (DiffLlama, Llama or Qwen2), exact up to the norm fold:
    the tensors renamed by :func:`hf_names`, the attention rows reordered (see the module doc)."""
    check_exportable(config)
    diff = _is_diff(config)
    d = config.head_dim
    out = {theirs: state[ours] for ours, theirs in hf_names(config).items()}
    for i in _progress(range(config.n_layers), "to transformers"):
        a, sa = f"layers.{i}.attn.", f"model.layers.{i}.self_attn."
        q, k, v, o = (out[sa + f"{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        q, k = rope_interleaved_to_half(q, d), rope_interleaved_to_half(k, d)
        if config.qkv_bias:  # Qwen2 (never DiffLlama: the diff kind takes no biases); v's bias keeps its order
            for n in ("q_proj", "k_proj"):
                out[sa + f"{n}.bias"] = _per_row(rope_interleaved_to_half, out[sa + f"{n}.bias"], d)
        if diff:
            q, k, v = pairs_to_halves(q, d), pairs_to_halves(k, d), pairs_to_halves(v, d)
            gain = state[a + "subln.weight"].float().repeat(config.n_heads)  # (H*2d,): shared by heads
            o = (o.float() * gain).to(o.dtype)  # (D, H*2d): column h*2d + j scaled by subln[j]
        out.update({sa + "q_proj.weight": q, sa + "k_proj.weight": k, sa + "v_proj.weight": v,
                    sa + "o_proj.weight": o})
    return {k: v.contiguous() for k, v in out.items()}


def to_difftx_state(config: ModelConfig, hf: dict[str, Tensor]) -> dict[str, Tensor]:
    """transformers state dict -> difftx state dict: the exact inverse of :func:`to_hf_state` for
    models whose ``subln`` gain is one (DiffLlama has no gain: ours becomes ones)."""
    diff = _is_diff(config)
    d = config.head_dim
    out = {ours: hf[theirs] for ours, theirs in hf_names(config).items()}
    for i in _progress(range(config.n_layers), "to difftx"):
        a = f"layers.{i}.attn."
        q, k, v, o = (out[a + f"{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "out_proj"))
        if diff:
            q, k, v = halves_to_pairs(q, d), halves_to_pairs(k, d), halves_to_pairs(v, d)
            out[a + "subln.weight"] = torch.ones(2 * d, dtype=o.dtype)
        q, k = rope_half_to_interleaved(q, d), rope_half_to_interleaved(k, d)
        if config.qkv_bias:
            for n in ("q_proj", "k_proj"):
                out[a + f"{n}.bias"] = _per_row(rope_half_to_interleaved, out[a + f"{n}.bias"], d)
        out.update({a + "q_proj.weight": q, a + "k_proj.weight": k, a + "v_proj.weight": v})
    return {k: v.contiguous() for k, v in out.items()}


# -- folders ----------------------------------------------------------------------------------------

def _write_safetensors(path: Path, state: dict[str, Tensor], metadata: dict[str, str]) -> None:
    """The exported weights with their SHA-256 in their own header (:func:`difftx.checkpoint.save_weights`):
    transformers ignores the extra metadata, and an import verifies it."""
    save_weights(path, state, metadata)


def _output_dir(out_dir: PathLike, sources: list[Path], overwrite: bool = False) -> Path:
    """``out_dir`` after checking, before any work, that writing it loses nothing: it must not be
    a file, nor an input folder or one that holds an input, and a non-empty folder is refused
    unless ``overwrite`` (its files would be replaced)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConversionError(f"{out}: exists and is not a folder; choose a folder path")
    for s in sources:
        if s is not None and (out.resolve() == s.resolve() or out.resolve() in s.resolve().parents):
            raise ConversionError(f"{out}: the output folder must differ from the input folder {s} and not hold it")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConversionError(f"{out}: not empty; refusing to write into it (its files would be replaced). Choose a "
                              f"new or empty folder, or pass --overwrite (overwrite=True) to replace the folder")
    if out.is_dir() and overwrite:
        found = work_marker(out)
        if found is not None:
            marker, what = found
            raise ConversionError(f"{out}: holds {what} ({marker}); --overwrite replaces model folders only, "
                                  "never a run, a comparison or a study, nor a folder above one. Choose another folder")
    return out


def replaced(out: Path) -> str | None:
    """What writing ``out`` replaces, in words (``None``: nothing), for the --overwrite note."""
    if not out.is_dir():
        return None
    files = sorted(p for p in out.rglob("*") if p.is_file())
    if not files:
        return None
    names = ", ".join(str(p.relative_to(out)) for p in files[:4]) + (", ..." if len(files) > 4 else "")
    return f"{out}: {len(files)} file(s), {sum(p.stat().st_size for p in files):,} bytes ({names})"


def resolve_model_folder(path: PathLike) -> Path:
    """A folder ``load_model`` reads: ``path`` itself, or the latest checkpoint of a training run folder."""
    path = Path(path)
    if not path.is_dir():
        raise ConversionError(f"{path}: not a folder (expected a difftx model or checkpoint folder "
                              f"with {CONFIG_NAME} and {WEIGHTS_NAME}, or a training run folder)")
    try:
        return resolve_checkpoint(path)
    except CheckpointError as e:
        raise ConversionError(str(e)) from e


def export_target(config: ModelConfig, remote_code: Optional[bool] = None) -> str:
    """``"exact"`` (a transformers class computes ``config``: DiffLlama, Llama or Qwen2) or ``"remote"`` (difftx's
    own modeling file, loaded with ``trust_remote_code=True``). ``remote_code``: None picks the exact class where one
    exists, else the modeling file; True always the modeling file; False the exact class only. Raises
    :class:`ConversionError` (one line naming the kind or the field) when neither can be written: a registered kind
    of your own (its code is not in the modeling file), or with ``remote_code=False`` a config with no exact class."""
    if remote_code is False:
        check_exportable(config)
        return "exact"
    if remote_code is None:
        try:
            check_exportable(config)
            return "exact"
        except ConversionError:
            pass
    reason = remote.refusal(config)
    if reason is not None:
        raise ConversionError(reason)
    return "remote"


def export_hf(model_or_folder: Union[Transformer, PathLike], out_dir: PathLike, *,
              tokenizer_dir: Optional[PathLike] = None, overwrite: bool = False,
              remote_code: Optional[bool] = None, fold: Optional[str] = None) -> Path:
    """Write a transformers model folder for a difftx model, or for a folder ``load_model`` reads
    (a training run folder means its latest checkpoint).

    ``diff`` -> ``DiffLlamaForCausalLM``, ``standard`` -> ``LlamaForCausalLM`` (with ``qkv_bias``:
    ``Qwen2ForCausalLM``); every other built-in kind (and
    the options DiffLlama and Llama cannot compute: NoPE, DIFF's ablations, a per-head norm or output scale on
    ``standard``) -> difftx's own ``DifftxForCausalLM``, whose code (``modeling_difftx.py``,
    ``configuration_difftx.py``, no difftx import) is written beside the weights and loads with
    ``trust_remote_code=True`` (``remote_code``: see :func:`export_target`). Writes
    ``config.json``, ``model.safetensors`` and the tokenizer found in ``tokenizer_dir``
    (default: the source folder's ``tokenizer/``, where training checkpoints keep it, else the
    source folder itself): a ``tokenizer.json`` is copied (a ``tokenizer_config.json`` is
    written if absent), difftx's byte tokenizer (``difftx_tokenizer.json``) becomes an
    equivalent ``tokenizer.json``. The result loads with
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` (and ``AutoTokenizer``), with ``trust_remote_code=True``
    for the modeling file. Raises :class:`ConversionError` (before writing anything) for a kind neither way can
    write (see :func:`export_target`), or
    when ``out_dir`` is a non-empty folder and not ``overwrite``. The folder is assembled beside
    ``out_dir`` and renamed into place: it is complete or absent, never half-written.

    ``fold="llama"`` (``difftx export --as llama``) writes a plain ``LlamaForCausalLM`` for a model whose function a
    Llama computes with other weights: ``temperature`` (into ``q_proj``), ``dex`` (into ``o_proj``), ``converted``
    with lambda exactly 0 in every layer (its source), plain ``standard``; anything else is refused in one line
    (:func:`difftx.interop.fold.to_llama`), as is ``fold`` with ``remote_code=True``. A model with q/k/v biases
    (``qkv_bias``) folds the same way into a ``Qwen2ForCausalLM`` (Llama plus those biases).
    """
    check_fold(fold, remote_code)
    src: Optional[Path] = None
    scales: list[float] = []
    model_or_folder = getattr(model_or_folder, "_orig_mod", model_or_folder)  # a torch.compile'd model
    if isinstance(model_or_folder, torch.nn.Module) and not isinstance(model_or_folder, Transformer):
        raise TypeError(f"export_hf expects a difftx Transformer or a folder, got {type(model_or_folder).__name__}")
    if isinstance(model_or_folder, Transformer):
        config = model_or_folder.config
        state = {k: v.detach().cpu() for k, v in model_or_folder.state_dict().items()}
        if config.tie_embeddings:
            state.pop("lm_head.weight", None)
        scales = [float(getattr(block.attn, "lambda_scale", 1.0)) for block in model_or_folder.layers]
        source = "model"
    else:
        src = resolve_model_folder(model_or_folder)
        _output_dir(out_dir, [src], overwrite)  # before reading the weights
        try:
            config, state = load_config(src), load_state(src)
        except CheckpointError as e:
            raise ConversionError(str(e)) from e
        source = str(src / WEIGHTS_NAME)
    if tokenizer_dir is not None:
        tok_src: Optional[Path] = Path(tokenizer_dir)
        if not tok_src.is_dir():
            raise ConversionError(f"{tok_src}: tokenizer folder not found")
    else:  # a training checkpoint keeps its tokenizer in tokenizer/; a bare model folder beside the weights
        tok_src = src / TOKENIZER_SUBDIR if src is not None and (src / TOKENIZER_SUBDIR).is_dir() else src
    meta = {"format": "pt"}
    low = state["tok_embeddings.weight"].dtype in (torch.bfloat16, torch.float16)
    folded = None  # what a fold multiplied into the weights, said when they round it
    if fold is None:
        target = export_target(config, remote_code)
        _check_shapes(state, _expected_state(config), source)
        if low and target == "exact" and _is_diff(config) and any(
                not bool((v == 1).all()) for k, v in state.items() if k.endswith("attn.subln.weight")):
            folded = "the head norm's gain into o_proj"
    else:  # a Llama's config and weights computing the same function, or a refusal
        meta["difftx_folded_from"] = config.attention
        if low and config.kind_class.llama_fold_multiplies:
            folded = f"{config.attention}'s parameters into the Llama's weights"
        config, state = to_llama(config, state, source=source, lambda_scales=scales)
        check_exportable(config)  # what a fold writes, a transformers class computes
        target = "exact"
    if folded is not None:
        import warnings

        warnings.warn(f"the weights are {state['tok_embeddings.weight'].dtype}: the fold of {folded} rounds each "
                      f"product to it, so the exported model's logits differ from this model's by about 1e-3 "
                      f"(relative); exact in float32 (export a float32 copy: model.float())", stacklevel=2)
    hf_state = to_hf_state(config, state) if target == "exact" else remote.remote_state(config, state)
    out = _output_dir(out_dir, [src], overwrite)
    dtype = state["tok_embeddings.weight"].dtype
    with atomic_folder(out, replace=True) as tmp:
        _write_safetensors(tmp / HF_WEIGHTS, hf_state, meta)
        _, eos_id = export_tokenizer(tok_src, tmp, config.max_seq_len, config.vocab_size)
        cfg = hf_config(config, dtype) if target == "exact" else remote.remote_config(config, dtype)
        if eos_id is not None:
            cfg["eos_token_id"] = eos_id
        if target == "remote":
            remote.copy_code(tmp)
        write_json(tmp / "config.json", cfg, indent=2)
    return out


def load_hf_folder(hf_dir: PathLike) -> tuple[dict, dict[str, Tensor]]:
    """``config.json`` (dict) and all safetensors weights of a transformers model folder."""
    folder = Path(hf_dir)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise ConversionError(f"{cfg_path}: missing (is {folder} a Hugging Face model folder?)")
    try:
        hf_cfg = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{cfg_path}: not valid JSON ({e})") from e
    if (folder / HF_WEIGHTS).is_file():
        files = [folder / HF_WEIGHTS]
    elif (folder / HF_INDEX).is_file():
        try:
            weight_map = json.loads((folder / HF_INDEX).read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ConversionError(f"{folder / HF_INDEX}: not a safetensors index ({e})") from e
        files = [folder / f for f in sorted(set(weight_map.values()))]
    else:
        other = [p.name for p in folder.glob("*.bin")]
        hint = f" (found {other}: re-save with safe_serialization=True)" if other else ""
        raise ConversionError(f"{folder}: no {HF_WEIGHTS} or {HF_INDEX}; only safetensors weights are read{hint}")
    state: dict[str, Tensor] = {}
    for f in files:
        try:  # a file difftx exported records its SHA-256 (a damaged one is refused); the Hub's record none
            verify_digest(f, notice=False)
        except CheckpointError as e:
            raise ConversionError(str(e)) from e
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise ConversionError(f"{f}: cannot read weights ({e})") from e
    return hf_cfg, state


def read_hf_model(src: Path) -> tuple[dict, ModelConfig, dict[str, Tensor]]:
    """A transformers DiffLlama, Llama, Mistral or Qwen2 folder read as difftx reads it: its ``config.json`` (dict),
    the difftx :class:`ModelConfig` and the difftx state dict (tensors in their stored dtype), after checking every
    weight's name and shape. A tied config with a stored head that differs from the embedding is read untied, as
    transformers loads it. Raises :class:`ConversionError` naming the field or file."""
    hf_cfg, hf_state = load_hf_folder(src)
    config = config_from_hf(hf_cfg, str(src / "config.json"))
    head, embedding = hf_state.get("lm_head.weight"), hf_state.get("model.embed_tokens.weight")
    if config.tie_embeddings and head is not None:
        if embedding is not None and head.shape == embedding.shape and not torch.equal(head, embedding):
            # transformers keeps a stored head that differs from the embedding (it does not tie them): so do we
            config = config.replace(tie_embeddings=False)
        else:  # a stored copy of the embedding: tied
            hf_state.pop("lm_head.weight")
    expected_hf = to_hf_state(config, _expected_state(config))
    _check_shapes(hf_state, expected_hf, str(src), ignore=lambda k: k.endswith("rotary_emb.inv_freq"))
    return hf_cfg, config, to_difftx_state(config, hf_state)


def import_hf(hf_dir: PathLike, out_folder: PathLike, *, overwrite: bool = False) -> Path:
    """Convert a local transformers DiffLlama (-> ``diff``), Llama or Mistral (-> ``standard``; a Mistral
    sliding window must cover the whole context) or Qwen2 (-> ``standard`` with ``qkv_bias``; the same window rule)
    folder into
    a difftx model folder that :func:`difftx.checkpoint.load_model` and the trainer's
    ``--init-from`` read: ``config.json``, ``model.safetensors`` and the tokenizer files (if
    any) in ``tokenizer/``, as training checkpoints keep them.

    Tensors keep their dtype and values, so exporting the result gives back the same weights
    bit for bit. DiffLlama's per-head norm has no gain: ``subln.weight`` becomes ones.
    A non-empty ``out_folder`` is refused unless ``overwrite``; the folder is assembled beside
    it and renamed into place (complete or absent).
    """
    src = Path(hf_dir)
    if not src.is_dir():
        raise ConversionError(f"{src}: not a folder (expected a Hugging Face model folder)")
    _output_dir(out_folder, [src], overwrite)  # before reading the weights
    hf_cfg, config, state = read_hf_model(src)
    out = _output_dir(out_folder, [src], overwrite)
    meta = {"format": "difftx", "source": f"transformers:{hf_cfg['model_type']}"}
    with atomic_folder(out, replace=True) as tmp:
        save_weights(tmp / WEIGHTS_NAME, state, meta)  # with its digest, as every difftx weights file
        atomic_write(tmp / CONFIG_NAME, lambda p: Path(p).write_text(config.to_json() + "\n"))
        if any((src / name).is_file() for name in TOKENIZER_FILES):
            copy_tokenizer(src, tmp / TOKENIZER_SUBDIR)  # where the trainer's --init-from looks for it
    return out
