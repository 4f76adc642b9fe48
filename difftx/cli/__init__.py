"""The ``difftx`` command. Each subcommand lives in its own module of this package and is a thin
wrapper over one library function.

A subcommand module defines ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments) as a default. Modules are listed in
``SUBCOMMANDS``; one that cannot be imported (a missing optional dependency) is reported
when used, not when ``difftx --help`` runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

from .. import __version__

# module name -> one-line help (kept here so --help works without importing heavy modules)
SUBCOMMANDS: dict[str, str] = {
    "demo": "short DIFF-vs-baseline demo on built-in data",
    "info": "show a model config, its parameter counts and its matched baseline",
    "train": "train a DIFF model or its baseline (resumable; torchrun for many GPUs)",
    "runs": "training runs side by side (params, tokens/s, best and final validation loss); --plot curves",
    "generate": "sample text from a checkpoint with the KV cache",
    "tokenizer": "train a BPE tokenizer locally on text files",
    "bench": "benchmark DIFF attention against the parameter-matched baseline",
    "export": "export a model folder to Hugging Face transformers (DiffLlama / Llama)",
    "import": "import a local Hugging Face DiffLlama / Llama folder as a difftx model",
    "compare": "train DIFF and its matched baseline over paired seeds, evaluate both, write a report",
    "eval": "run one evaluation task (needle, lm, attention, outliers, quant, icl, diagnostics, training) on a checkpoint",
}

# subcommand -> module name, where they differ (``import`` is a Python keyword)
MODULE_NAMES: dict[str, str] = {"import": "import_"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="difftx", description="Differential Transformer toolkit: models, training, evaluation, interop.")
    parser.add_argument("--version", action="version", version=f"difftx {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in SUBCOMMANDS.items():
        try:
            module = importlib.import_module(f".{MODULE_NAMES.get(name, name)}", __name__)
        except ImportError as e:  # optional dependency missing: keep the command, explain on use
            p = sub.add_parser(name, help=f"{help_text} (unavailable: {e})")
            p.set_defaults(func=lambda args, e=e, name=name: _unavailable(name, e))
            continue
        module.register(sub)
    return parser


def _unavailable(name: str, error: Exception) -> int:
    print(f"difftx {name}: unavailable because an optional dependency is missing: {error}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        code = int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:
        print(f"difftx {args.command}: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print(f"difftx {args.command}: interrupted", file=sys.stderr)
        code = 130
    from ..training.distributed import exit_worker, under_torchrun

    if under_torchrun():  # a torchrun worker skips interpreter shutdown (see exit_worker)
        exit_worker(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
