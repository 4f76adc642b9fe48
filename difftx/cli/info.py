"""``difftx info``: a config, its parameter counts and its parameter-matched baseline; or the
parameter counts of every comparison arm (``--arms``)."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from ..io import read_json
from ..overrides import parse_value, split_override


def register(sub) -> None:
    p = sub.add_parser("info", help="show a model config, its parameter counts and its matched baseline",
                       description="Print a preset (or a config.json), its parameter count, and the same for "
                                   "its parameter-matched baseline, with what the model's attention adds per layer "
                                   "(e.g. an output gate: D*H*d elementwise, D*H head-wise). --arms lists the "
                                   "comparison arms derived from a DIFF config instead.")
    p.add_argument("config", nargs="?", default="tiny",
                   help="a model preset, a training or compare preset (its settings, then the model it trains), or a "
                        "path to a config.json / checkpoint folder (default: tiny)")
    p.add_argument("--attention", metavar="KIND",
                   help="override the attention kind: diff, diff_v2, standard, gated, temperature, or one registered "
                        "by difftx --kinds FILE; from a DIFF config (the presets), the model the compare arm of that "
                        "kind trains (standard: the baseline), heads of DIFF's query/key width")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field (e.g. --set model.lambda_init=0.3, as compare, scale and "
                        "train spell it, or --set gate=headwise, --set head_norm=true); repeatable, applied after "
                        "--attention")
    p.add_argument("--arm", metavar="NAME",
                   help="show the arm NAME derived from the (DIFF) config, e.g. gated, gated_headwise, "
                        "no_subtraction, baseline_head_norm (--arms lists them all)")
    p.add_argument("--arms", nargs="?", const="all", metavar="SET",
                   help="list the arms of SET (default: all; also default, paper-ablations, alternatives) "
                        "derived from the (DIFF) config: parameters, and what each adds to its baseline")
    p.set_defaults(func=run)


def _preset_model(spec: str):
    """A training or compare preset's settings, printed, and the model config it trains (a compare preset's DIFF
    arm), or None when that is known only when the command runs (a compare from a source)."""
    import json

    from ..compare.presets import PRESETS as COMPARE_PRESETS  # lazy: torch; --help stays fast
    from ..compare.presets import get_preset
    from ..config import preset
    from ..training.config import FINETUNE_PRESET, TRAIN_PRESETS

    if spec in TRAIN_PRESETS:
        t = TRAIN_PRESETS[spec]
        print(f"training preset {spec!r} (difftx train --preset {spec}):")
        print(json.dumps(t.to_dict(), indent=2))
        if spec == FINETUNE_PRESET:
            print(f"its model is the checkpoint's (--init-from); shown: the placeholder {t.model!r}")
        return preset(t.model)
    if spec in COMPARE_PRESETS:
        c = get_preset(spec)
        print(f"compare preset {spec!r} (difftx compare --preset {spec}): {c.description}")
        print(json.dumps(c.to_dict(), indent=2))
        try:
            plan = c.resolve()
            cfg = plan.arms[plan.primary[0]]
        except (ValueError, OSError) as e:  # a preset that needs its source (--from) or a text
            print(f"its models depend on what the command is given: {e}")
            return None
        print("its DIFF arm (--arms lists every arm; with --from the arms are the source and its conversion):")
        return cfg
    return None


def _load(spec: str):
    from ..checkpoint import CONFIG_NAME, CheckpointError, load_config  # lazy: torch; --help stays fast
    from ..compare.presets import PRESETS as COMPARE_PRESETS  # lazy: torch; --help stays fast
    from ..config import PRESETS, ModelConfig, preset  # lazy: torch; --help stays fast
    from ..training.checkpointing import resolve_checkpoint  # lazy: torch; --help stays fast
    from ..training.config import TRAIN_PRESETS  # lazy: torch; --help stays fast

    if spec in PRESETS:  # a model preset (training presets of the same name train it)
        return preset(spec)
    shown = _preset_model(spec) if spec in TRAIN_PRESETS or spec in COMPARE_PRESETS else None
    if shown is not None or spec in TRAIN_PRESETS or spec in COMPARE_PRESETS:
        return shown
    path = Path(spec)
    if not path.exists():
        raise ValueError(f"{spec!r} is neither a preset (models: {', '.join(sorted(PRESETS))}; training: "
                         f"{', '.join(sorted(TRAIN_PRESETS))}; compare: {', '.join(sorted(COMPARE_PRESETS))}) "
                         f"nor a path")
    if path.is_dir():  # a model or checkpoint folder, or a run folder (its latest checkpoint)
        path = resolve_checkpoint(path) / CONFIG_NAME
    if path.name == CONFIG_NAME:  # as every command reads a model's config: a transformers folder is named as one
        return load_config(path.parent)
    data = read_json(path, "a model config", error=CheckpointError)
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: not a valid model config ({e})") from None


def _apply_overrides(cfg, overrides: list[str]):
    from ..config import ModelConfig  # lazy: torch; --help stays fast

    known = {f.name for f in fields(ModelConfig)}
    changes = {}
    for text in overrides:
        key, value = split_override(text)
        key = key[len("model."):] if key.startswith("model.") else key  # model.lambda_init: compare's spelling
        if key not in known:
            raise ValueError(f"--set {text}: unknown ModelConfig field {key!r}; known fields are {sorted(known)}")
        changes[key] = parse_value(value)
    return cfg.replace(**changes) if changes else cfg


def _options(c) -> str:
    """The non-default options of a config, as ``name=value`` words."""
    out = []
    if c.gate_kind is not None:
        out.append(f"gate={c.gate_kind}")
    if c.uses_head_norm != c.kind_class.head_norm_default:
        out.append(f"head_norm={'on' if c.uses_head_norm else 'off'}")
    if not c.subtract:
        out.append("subtract=off")
    if c.lambda_init is not None:
        out.append(f"lambda_init={c.lambda_init:g}")
    if not c.rope:
        out.append("rope=off")
    if c.out_scale is not None:
        out.append(f"out_scale={c.out_scale}")
    if c.init != "normal":
        out.append(f"init={c.init}")
    out.extend(f"{k}={v}" for k, v in (c.options or {}).items())
    return " ".join(out)


def _delta_text(c) -> str:
    """What one layer of ``c`` adds to its baseline, with the formulas evaluated: ``4·d + 2·d = 96``."""
    from ..config import attention_parameter_delta  # lazy: torch; --help stays fast

    rows = attention_parameter_delta(c)
    if not rows:
        return "nothing"
    values = {"D": c.dim, "H": c.n_heads, "d": c.head_dim}
    formulas = " + ".join(f for _, _, f in rows)
    numbers = " + ".join("·".join(str(values.get(t, t)) for t in f.split("·")) for _, _, f in rows)
    parts = dict.fromkeys([formulas, numbers, f"{sum(n for _, n, _ in rows):,}"])  # in order, repeats dropped
    return f"{' = '.join(parts)} (D={c.dim}, H={c.n_heads}, d={c.head_dim})"


def run(args: argparse.Namespace) -> int:
    from ..config import (  # lazy: torch; --help stays fast
        ARM_SETS, PRIMARY, arm_config, arm_names, attention_parameter_delta, baseline_config,
    )

    cfg = _load(args.config)
    if cfg is None:  # a preset whose model is not known before the command runs (said above)
        return 0
    if args.attention:
        # from a DIFF config, a kind that is a compare arm is shown as that arm is built (its heads of DIFF's query/key
        # width: the baseline's count for a one-map kind), so `info --attention K` and the compare arm K agree
        arm = PRIMARY[1] if args.attention == "standard" else args.attention  # standard: the baseline arm
        cfg = (arm_config(cfg, arm) if cfg.attention == "diff" and arm in arm_names() else
               cfg.replace(attention=args.attention))
    cfg = _apply_overrides(cfg, args.overrides)
    if args.arms is not None:
        if args.arms not in ARM_SETS:
            raise ValueError(f"--arms {args.arms}: unknown arm set; choose one of {sorted(ARM_SETS)}")
        if cfg.attention != "diff":  # before the table's header: the arms derive from a DIFF V1 model
            raise ValueError(f"--arms: the arms derive from a DIFF V1 model (attention=diff), not attention="
                             f"{cfg.attention}: name a DIFF model or preset (without --attention)")
        # "all": every arm, and every attention kind registered beyond the built-in ones (--kinds)
        return _print_arms(cfg, arm_names() if args.arms == "all" else ARM_SETS[args.arms])
    if args.arm:
        cfg = arm_config(cfg, args.arm)
    base = baseline_config(cfg)
    print(cfg.to_json())
    counts = []
    for name, c in (("model", cfg), (PRIMARY[1], base)):  # the model and its parameter-matched baseline
        n = parameter_count(c)
        counts.append(n)
        opts = _options(c)
        print(f"{name:9s} attention={c.attention:8s} heads={c.n_heads} kv_groups={c.kv_groups} "
              f"head_dim={c.head_dim} parameters={n:,}{' ' + opts if opts else ''}")
    delta = counts[0] - counts[1]
    print(f"model - baseline = {delta:+,} = {cfg.n_layers} layers x ({_delta_text(cfg)})")
    for what, n, formula in attention_parameter_delta(cfg):
        print(f"  per layer: {what}: {formula} = {n:,}")
    return 0


def parameter_count(cfg) -> int:
    """Parameters of a model of ``cfg``, counted on PyTorch's meta device: shapes only, no memory
    and no initialisation (a 0.9B config takes a second, not a minute and gigabytes)."""
    import torch  # lazy: torch; --help stays fast

    from ..model import Transformer  # lazy: torch; --help stays fast

    with torch.device("meta"):
        return Transformer(cfg).num_parameters()


def _print_arms(cfg, arms) -> int:
    from ..config import arm_config, baseline_config  # lazy: torch; --help stays fast

    print(f"arms derived from: dim={cfg.dim} n_layers={cfg.n_layers} n_heads={cfg.n_heads} "
          f"kv_groups={cfg.kv_groups} (DIFF component width d={cfg.head_dim}) vocab_size={cfg.vocab_size}")
    w = max(24, *(len(a) for a in arms))
    head = f"{'arm':{w}s} {'attention':11s} {'heads x width':>13s} {'kv':>3s} {'parameters':>12s} {'vs baseline':>12s}"
    print(f"{head}  added per layer")
    for arm in arms:
        c = arm_config(cfg, arm)
        n = parameter_count(c)
        delta = n - parameter_count(baseline_config(c))
        opts = _options(c)
        kind = c.attention
        print(f"{arm:{w}s} {kind:11s} {f'{c.n_heads} x {c.head_dim}':>13s} {c.kv_groups:>3d} {n:>12,} {delta:>+12,}  "
              f"{_delta_text(c)}{'  [' + opts + ']' if opts else ''}")
    print("vs baseline: the arm's parameters minus those of its own baseline_config (standard attention without "
          "the arm's additions: the 'baseline' arm for diff*, no_subtraction, diff_v2, gated*, temperature and "
          "baseline_head_norm; 'baseline_wide' for baseline_wide_head_norm; the baseline without RoPE for the NoPE "
          "arms)")
    return 0
