"""``difftx convert``: a standard-attention model (difftx ``standard``, or transformers Llama / Mistral / Qwen2) made
differential."""

from __future__ import annotations

import argparse
from pathlib import Path

from .args import check_not_input, seed_int

METHODS = ("zero", "mirror", "random", "dex")  # difftx.interop.convert.METHODS (not imported here: it imports torch)


def register(sub) -> None:
    p = sub.add_parser(
        "convert", help="make a standard / Llama / Mistral / Qwen2 model differential, with the same function at "
                        "conversion",
        description="Convert a difftx 'standard' model folder (or a training run folder: its latest checkpoint) or "
                    "a local transformers Llama, Mistral or Qwen2 folder (config.json + safetensors) into a difftx "
                    "model of the "
                    "'converted' attention kind: each head keeps its query, key and value and gains a negative "
                    "query/key component, mixed in by a learned lambda that starts at 0. --method dex gives the "
                    "'dex' kind instead: each selected head keeps its one softmax map A and computes A V (I - lambda "
                    "W), W a learned map per layer. The converted model's float32 logits are checked against the "
                    "source's before anything is written. Fine-tune it with `difftx train --init-from OUT`. Nothing "
                    "is downloaded. See docs/interop.md.")
    p.add_argument("src", help="difftx 'standard' model, checkpoint or run folder, or transformers Llama / Mistral / "
                               "Qwen2 folder")
    p.add_argument("out", help="output difftx model folder (created; an existing one must be empty, see --overwrite)")
    p.add_argument("--method", choices=METHODS, default="mirror",
                   help="the negative component's query/key rows: zero (zeros; that map stays uniform under "
                        "training), mirror (a copy of the positive one) or random (normal draws with the model's "
                        "init_std); or dex (no second map: the difference is taken on the value side, A V (I - "
                        "lambda W) with W the identity at conversion, on the heads --dex-heads selects; after DEX, "
                        "Kong et al. 2025); default: mirror")
    p.add_argument("--dex-heads", default=None, metavar="SPEC",
                   help="with --method dex, the heads of each layer that take the difference: all (the default), a "
                        "count N or a fraction F in (0, 1] of each layer's heads, those whose attention is the most "
                        "diffuse (highest mean entropy) on the bundled held-out text through the source's tokenizer, "
                        "or on random tokens when it has none difftx reads")
    p.add_argument("--seed", type=seed_int, default=0, metavar="N",
                   help="seed of the random draws: the lambda vectors and, with --method random, the negative "
                        "rows (default: 0)")
    p.add_argument("--lambda-init", type=float, default=0.0, metavar="X",
                   help="a constant offset of lambda in [0, 1), reached by fine-tuning with a lambda warm-up "
                        "(`difftx train --set lambda_warmup=N`); above 0 the model as loaded does not compute the "
                        "source's function, only the warm-up's first step does (default: 0, the source's function)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT when it is a non-empty folder (refused otherwise; never a folder holding a run, a "
                        "comparison or a study, at any depth)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..interop.convert import convert_model  # lazy: torch; --help stays fast
    from ..interop.hf import replaced  # lazy: torch; --help stays fast

    if args.seed < 0:
        raise ValueError(f"--seed: must be a non-negative integer, got {args.seed}")
    check_not_input(args.out, "OUT", {"SRC": args.src}, folder=True)
    gone = replaced(Path(args.out)) if args.overwrite else None
    if args.dex_heads is not None and args.method != "dex":
        raise ValueError(f"--dex-heads: applies only to --method dex (got --method {args.method})")
    res = convert_model(args.src, args.out, method=args.method, seed=args.seed, overwrite=args.overwrite,
                        lambda_init=args.lambda_init, dex_heads=args.dex_heads)
    if gone:
        print(f"replaced {gone}")
    print(f"converted {args.src} ({res.source}) -> {res.out} (attention={res.attention!r}, method={res.method}, "
          f"seed={res.seed}); {res.summary()}")
    if res.warning():
        print(f"note: {res.warning()}")
    return 0
