"""``difftx train``: train a model from a preset / config file with overrides; resumable."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("train", help="train a DIFF model or its baseline (resumable; torchrun for many GPUs)",
                       description="Train with a preset and/or a YAML/JSON config file plus KEY=VALUE overrides "
                                   "(precedence: preset < file < --set < flags). Under torchrun every process "
                                   "runs this command. See docs/training.md.")
    p.add_argument("--config", help="YAML or JSON training config file")
    p.add_argument("--preset", help="training preset (default: the file's 'preset' key, else 'tiny'); "
                                    "see --list-presets")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, dotted for nested ones (e.g. --set lr=3e-4 "
                        "--set model_overrides.dim=128); repeatable")
    p.add_argument("--out", help="output folder (out_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in the output folder")
    p.add_argument("--init-from", help="checkpoint (or run) folder whose weights start this run (fine-tuning)")
    p.add_argument("--attention", choices=["diff", "diff_v2", "standard"],
                   help="attention kind of the model (same n_heads; --baseline gives the parameter-matched one)")
    p.add_argument("--baseline", action="store_true",
                   help="train the parameter-matched baseline of the configured DIFF model")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--list-presets", action="store_true", help="list training presets and exit")
    p.set_defaults(func=run)


def build_config(args: argparse.Namespace):
    """The TrainConfig the command line describes."""
    from ..config import baseline_config
    from ..training.config import load_train_config

    cfg = load_train_config(args.config, args.overrides, args.preset)
    changes = {}
    if args.out:
        changes["out_dir"] = args.out
    if args.init_from:
        changes["init_from"] = args.init_from
    if args.attention or args.baseline:
        overrides = dict(cfg.model_overrides)
        if args.attention:
            overrides["attention"] = args.attention
        if args.baseline:
            base = baseline_config(cfg.replace(model_overrides=overrides).model_config())
            overrides.update(attention=base.attention, n_heads=base.n_heads, n_kv_heads=base.n_kv_heads,
                             lambda_init=None, use_subln=True)
        changes["model_overrides"] = overrides
    return cfg.replace(**changes) if changes else cfg


def run(args: argparse.Namespace) -> int:
    from ..training import TRAIN_PRESETS, train

    if args.list_presets:
        for name, c in TRAIN_PRESETS.items():
            print(f"{name:10s} model={c.model:9s} batch={c.batch_size}x{c.seq_len} accum={c.grad_accum} "
                  f"steps={c.steps} lr={c.lr:g} device={c.device} dtype={c.dtype}")
        return 0
    cfg = build_config(args)
    if args.print_config:
        print(cfg.to_json())
        return 0
    result = train(cfg, resume=args.resume)  # errors: the CLI's boundary (a bad checkpoint exits 2, divergence 1)
    import os

    if int(os.environ.get("RANK", "0")) == 0:
        val = result.val_losses[max(result.val_losses)] if result.val_losses else None
        loss = "n/a" if result.final_loss is None else f"{result.final_loss:.4f}"
        print(f"done: step {result.step}, train loss {loss}"
              + (f", val loss {val:.4f}" if val is not None else "")
              + f", {result.tokens_seen:,} tokens in {result.elapsed_s:.1f}s; checkpoint {result.last_checkpoint}")
    return 0
