"""``difftx compare --from SRC``: a pretrained standard-attention model fine-tuned as it is (the ``source`` arm)
against the same model converted to differential attention (the ``converted`` arm, :func:`difftx.interop.convert.
convert_model`), per seed on the same batches.

The source is read once per comparison for its config and tokenizer (:func:`read_source_model`); each model's
starting weights are written into its own folder when it is first trained (:func:`initial_weights`): the source
as a difftx folder for the source arm (a transformers Llama folder is imported; a difftx model is used in place),
and its conversion with the model's seed for the converted arm (the seed draws the lambda vectors and, with
``--method random``, the negative query/key rows). Both arms then train with the comparison's schedule and batches
(:func:`difftx.compare.train.train_models`), so the pair differs only in the conversion.

The vocabulary is the source's: the text is tokenized with the source's tokenizer (or ``--tokenizer``), and the
recall task, when trained (``recall_every``), uses the ids ``0 .. recall_vocab - 1`` of that vocabulary. The
needle and ICL tasks need ids of their own, so a comparison from a source has neither.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..config import ModelConfig

INIT_DIR = "init"  # a model's starting weights, in its folder until it is trained


@dataclass(frozen=True)
class Source:
    """The source of a comparison (``ComparePlan.source``): where it is, what it is, how it is converted."""

    path: str  # the folder given (absolute)
    kind: str  # "transformers:llama" or "difftx:standard"
    folder: str  # the folder read (a run folder's latest checkpoint; the path itself for transformers)
    tokenizer: Optional[str]  # the source's tokenizer folder, or None
    method: str
    lambda_init: float

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "folder": self.folder, "tokenizer": self.tokenizer,
                "method": self.method, "lambda_init": self.lambda_init}


def read_source_model(path: str) -> tuple[str, ModelConfig, str, Optional[str]]:
    """``(kind, config, folder read, tokenizer folder or None)`` of the source in ``path``, checked as ``difftx
    convert`` checks it (:func:`difftx.interop.convert.read_source`; a :class:`~difftx.interop.ConversionError`
    naming the field). Cached per folder and modification time of its files."""
    p = Path(path).expanduser().resolve()
    if not p.is_dir():
        raise ValueError(f"ComparePreset.source: {path} is not a folder (a difftx 'standard' model or run folder, or a "
                         f"transformers Llama folder)")
    stamp = tuple(sorted((f.name, f.stat().st_mtime_ns) for f in p.iterdir() if f.is_file()))
    return _read(str(p), stamp)


@functools.lru_cache(maxsize=8)
def _read(path: str, stamp: tuple) -> tuple[str, ModelConfig, str, Optional[str]]:
    from ..interop.convert import read_source
    from ..interop.hf import TOKENIZER_SUBDIR

    kind, config, _, folder = read_source(path)
    # a difftx checkpoint keeps its tokenizer in tokenizer/; a transformers folder holds tokenizer.json itself (read
    # and carried by `difftx convert` alike)
    tok = Path(folder) / ("tokenizer.json" if kind.startswith("transformers:") else TOKENIZER_SUBDIR)
    return kind, config, str(folder), str(tok) if tok.exists() else None


def source_identity(source: Source) -> dict:
    """``{"folder", "sha256"}``: the folder read and the SHA-256 of its ``config.json`` and weights files (every
    ``*.safetensors``, in name order), so that a model fine-tuned from a source is reused only from the same one."""
    import hashlib

    folder = Path(source.folder)
    h = hashlib.sha256()
    for f in [folder / "config.json", *sorted(folder.glob("*.safetensors"))]:
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return {"folder": str(folder), "sha256": h.hexdigest()}


SOURCE_ARM, CONVERTED_ARM = "source", "converted"  # the arms of a comparison from a source, and their folders
FROM_PRIMARY = (CONVERTED_ARM, SOURCE_ARM)  # its pair: the conversion against the source fine-tuned as it is


def source_arms(config: ModelConfig, method: str, lambda_init: float) -> dict[str, ModelConfig]:
    """The two arms of a comparison from a source of ``config``: the source and its conversion by ``method`` (``dex``
    on every head: a selection measured per model would give each seed another config)."""
    from ..interop.convert import converted_config, dex_config

    conv = dex_config(config, None, lambda_init) if method == "dex" else converted_config(config, lambda_init)
    return {SOURCE_ARM: config, CONVERTED_ARM: conv}


def initial_weights(source: Source, arm: str, seed: int, folder: Path) -> Path:
    """The model folder the model of ``arm`` and ``seed`` starts from: for the source, the source itself
    (a difftx folder) or its import into ``folder/init``; for the conversion, the source converted with ``seed``
    into ``folder/init`` (``dex``: every head). Written once (complete or absent); :func:`drop_initial_weights`
    removes it once the model is trained."""
    from ..checkpoint import CONFIG_NAME
    from ..interop.convert import convert_model
    from ..interop.hf import import_hf

    if arm == SOURCE_ARM and source.kind.startswith("difftx:"):
        return Path(source.folder)
    init = Path(folder) / INIT_DIR
    if (init / CONFIG_NAME).is_file():  # written by an earlier call (atomically: complete)
        return init
    if arm == SOURCE_ARM:
        import_hf(source.folder, init, overwrite=True)
    else:
        convert_model(source.folder, init, method=source.method, seed=seed, overwrite=True,
                      lambda_init=source.lambda_init)
    return init


def drop_initial_weights(folder: Path) -> None:
    """Remove ``folder/init`` (the trained model no longer needs it)."""
    import shutil

    init = Path(folder) / INIT_DIR
    if init.is_dir():
        shutil.rmtree(init, ignore_errors=True)


def default_name(path: str) -> str:
    """``from-NAME`` for a source folder ``.../NAME`` (the default output folder's part)."""
    name = os.path.basename(os.path.normpath(path)) or "source"
    return f"from-{name}"


def kv_cache_bytes_per_token(config: dict, bytes_per_value: int = 4) -> int:
    """Bytes the KV cache holds per token of context, summed over layers (keys and values of every kv group)."""
    import torch

    from ..model import Transformer

    with torch.device("meta"):
        model = Transformer(ModelConfig.from_dict(config))
    total = 0
    for block in model.layers:
        (kh, kw), (vh, vw) = block.attn.cache_shapes()
        total += (kh * kw + vh * vw) * bytes_per_value
    return total


def render_source(result) -> str:
    """The report's section on a comparison from a source (a :class:`~.schema.CompareResult`): what was converted
    how, and what the conversion costs (parameters and KV cache exactly; training throughput as measured, each arm's
    stack on its own clock)."""
    from ..tasks.reporting import fmt, table

    p, arms = result.preset, result.arms
    conv, src_arm = result.primary.arms  # the converted model, the source
    src = Path(p["source"]).name
    params = {a: arms[a].parameters for a in (src_arm, conv)}
    kv = {a: kv_cache_bytes_per_token(arms[a].config) for a in (src_arm, conv)}
    speed = result.primary.metrics.get("train_tokens_per_s", {}).get("means", {})
    rows = [["parameters", f"{params[src_arm]:,}", f"{params[conv]:,}", f"{params[conv] / params[src_arm] - 1:+.1%}"],
            ["KV cache, bytes per token of context (float32)", f"{kv[src_arm]:,}", f"{kv[conv]:,}",
             f"{kv[conv] / kv[src_arm] - 1:+.1%}"]]
    if speed.get(src_arm) and speed.get(conv):
        rows.append(["training throughput, tokens/s (as measured)", fmt(speed[src_arm], 0), fmt(speed[conv], 0),
                     f"{speed[conv] / speed[src_arm] - 1:+.1%}"])
    lam = p.get("convert_lambda_init") or 0.0
    warm = p.get("lambda_warmup", 0)
    start = ("lambda starts at 0, so at step 0 it computes the source's function (checked: logits within 1e-5 "
             "relative)" if not lam else
             f"lambda_init {lam}: its first step computes the source's function, and a lambda warm-up brings lambda in "
             f"(lambda_warmup = {warm} steps)" if warm else
             f"lambda_init {lam} without a warm-up: it starts off the source's function")
    return "\n".join([
        "## The source and its conversion\n",
        f"Both arms start from `{src}` ({p['source']}). `{src_arm}` is the source fine-tuned as it is; "
        f"`{conv}` is the source converted to differential attention "
        f"(`difftx convert --method {p['convert_method']}`"
        + (" on every head" if p["convert_method"] == "dex" else "") + ", the model's seed drawing its lambda "
        "vectors"
        + (" and its negative query/key rows" if p["convert_method"] == "random" else "")
        + f"), fine-tuned the same way: same steps, batches and learning rate. The converted model's {start}.\n",
        table(rows, ["cost", src_arm, conv, f"{conv} / {src_arm} - 1"]),
        "\nParameters and the KV cache are exact. The throughput is each arm's own measurement while it trained; "
        "the arms trained side by side, so it is as comparable as the machine was quiet.\n"])
