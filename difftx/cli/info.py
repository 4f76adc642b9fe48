"""``difftx info``: a config, its parameter counts and its parameter-matched baseline."""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser("info", help="show a model config, its parameter counts and its matched baseline",
                       description="Print a preset (or a config.json), its parameter count, and the same for "
                                   "its parameter-matched baseline.")
    p.add_argument("config", nargs="?", default="tiny",
                   help="preset name or path to a config.json / checkpoint folder (default: tiny)")
    p.add_argument("--attention", choices=["diff", "diff_v2", "standard"], help="override the attention kind")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..checkpoint import CheckpointError, read_json
    from ..config import PRESETS, ModelConfig, baseline_config, preset
    from ..model import Transformer
    from ..training.checkpointing import resolve_checkpoint

    if args.config in PRESETS:
        cfg = preset(args.config)
    else:
        path = Path(args.config)
        if not path.exists():
            raise ValueError(f"{args.config!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a path")
        if path.is_dir():  # a model or checkpoint folder, or a run folder (its latest checkpoint)
            path = resolve_checkpoint(path) / "config.json"
        data = read_json(path, "not found", "not a model config: not valid JSON")
        try:
            cfg = ModelConfig.from_dict(data)
        except (TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path}: not a valid model config ({e})") from None
    if args.attention:
        cfg = cfg.replace(attention=args.attention)
    base = baseline_config(cfg)
    print(cfg.to_json())
    for name, c in (("model", cfg), ("baseline", base)):
        n = Transformer(c).num_parameters()
        print(f"{name:9s} attention={c.attention:8s} heads={c.n_heads} kv_groups={c.kv_groups} "
              f"head_dim={c.head_dim} parameters={n:,}")
    return 0
