"""``difftx train``: train a model from a preset / config file with overrides; resumable."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import os
import sys
from pathlib import Path

from .args import check_not_input


def strict_unknown_flags(parser: argparse.ArgumentParser) -> None:
    """Make an unrecognised flag of this subcommand an error of ``parser`` itself, which prints
    the subcommand's usage (argparse otherwise reports it with the top-level usage)."""
    parse_known = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extra = parse_known(args, namespace)
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra

    parser.parse_known_args = parse_known_args


def register(sub) -> None:
    p = sub.add_parser("train", help="train a DIFF model or its baseline (resumable; torchrun for many GPUs)",
                       description="Train with a preset and/or a YAML/JSON config file plus KEY=VALUE overrides "
                                   "(precedence: preset < file < --set < flags). --resume continues the run in "
                                   "--out with its saved train_config.json. Under torchrun every process runs "
                                   "this command. See docs/training.md.")
    p.add_argument("--config", help="YAML or JSON training config file")
    p.add_argument("--preset", help="training preset (default: the file's 'preset' key, else 'finetune' with "
                                    "--init-from, else 'tiny'); see --list-presets")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, dotted for nested ones (e.g. --set lr=3e-4 "
                        "--set model_overrides.dim=128); repeatable")
    p.add_argument("--out", help="output folder (out_dir)")
    p.add_argument("--data", metavar="PATH",
                   help="training text: a text file, a folder of them or a JSONL file (data_source; "
                        "default: the bundled corpus); a part of it is held out for validation (val_fraction)")
    p.add_argument("--tokenizer", metavar="PATH|byte",
                   help="'byte', or a tokenizer.json / folder from `difftx tokenizer train` (default: the "
                        "--init-from checkpoint's tokenizer where it has one, else byte)")
    p.add_argument("--no-progress", action="store_true",
                   help="hide the progress bars, for logs (this command only); the start line, validation losses "
                        "and the done line still print (--set progress=false hides those too)")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its latest checkpoint, with its saved train_config.json "
                        "(flags may change only execution settings and raise steps)")
    p.add_argument("--allow-new-data", action="store_true",
                   help="with --resume: continue although the training text changed since the checkpoint (refused "
                        "otherwise); recorded in the run's checkpoints (this command only)")
    p.add_argument("--init-from", metavar="CHECKPOINT",
                   help="checkpoint (or run) folder whose weights and architecture start this run (fine-tuning); "
                        "without --preset or --config it takes the finetune preset (low lr, short warm-up); "
                        "the run records the checkpoint's model config as its model")
    p.add_argument("--attention", metavar="KIND",
                   help="attention kind of the model: a built-in one (diff, diff_v2, standard, gated, temperature, "
                        "converted, dex) or one registered by --kinds (same n_heads; --baseline gives the "
                        "parameter-matched one)")
    p.add_argument("--baseline", action="store_true",
                   help="train the parameter-matched baseline of the configured DIFF model")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    p.add_argument("--list-presets", action="store_true", help="list training presets and exit")
    p.set_defaults(func=run)
    strict_unknown_flags(p)


def saved_run_config(out_dir):
    """The TrainConfig a run folder was trained with (``OUT/train_config.json``, else its latest
    checkpoint's copy), its paths found where they are now (the run folder may have moved; see
    ``difftx.training.config.resolve_saved_paths``); ``(None, None, {}, {})`` for a folder that
    holds no run yet. Returns the config, the file read, the path fields found nowhere (why) and
    the run's record of its paths."""
    from ..training import checkpointing as ckpt  # lazy: torch; --help stays fast
    from ..training.config import (  # lazy: torch; --help stays fast
        SAVED_PATHS, TrainConfig, read_config_file, resolve_saved_paths,
    )

    out = Path(out_dir)
    path = out / ckpt.TRAIN_CONFIG_NAME
    latest = ckpt.latest_checkpoint(out) if ckpt.checkpoints_dir(out).is_dir() else None  # a bad pointer: named
    if not path.is_file():
        if latest is None or not (latest / ckpt.TRAIN_CONFIG_NAME).is_file():
            return None, None, {}, {}
        path = latest / ckpt.TRAIN_CONFIG_NAME
    try:
        data = read_config_file(path)
        records = data.get(SAVED_PATHS) if isinstance(data.get(SAVED_PATHS), dict) else {}
        data, missing = resolve_saved_paths(data, out, str(path))
        return TrainConfig.from_dict(data), path, missing, records
    except ValueError as e:
        raise ValueError(f"{path}: cannot read the run's saved config ({e})") from e


def build_config(args: argparse.Namespace, notes: list | None = None):
    """The TrainConfig the command line describes. With ``--resume`` and a run already in the
    output folder: that run's saved config, changed only by what the flags say, and only where a
    resume allows it (``ValueError`` naming the fields otherwise)."""
    from ..config import baseline_config  # lazy: torch; --help stays fast
    from ..training.config import check_resume_changes, load_train_config  # lazy: torch; --help stays fast

    saved, saved_path, missing, records = None, None, {}, {}
    if args.out is not None and not str(args.out).strip():
        raise ValueError("--out: an empty path; give a folder for the run (or leave --out out for the default)")
    if getattr(args, "allow_new_data", False) and not getattr(args, "resume", False):
        raise ValueError("--allow-new-data: only with --resume (it lets a resume continue on changed training text)")
    if getattr(args, "resume", False):
        out_dir = args.out or load_train_config(args.config, None, args.preset, init_from=args.init_from).out_dir
        saved, saved_path, missing, records = saved_run_config(out_dir)
        if (Path(out_dir) / "compare.json").is_file():
            raise ValueError(f"--out {out_dir}: a `difftx compare` folder, not a training run; re-run the compare "
                             "command to continue it")
        if saved is None and not (args.preset or args.config):  # `--resume` alone, with nothing to resume
            raise ValueError(f"--resume: {out_dir} holds no training run (no train_config.json or checkpoints/) to "
                             "continue; give the command that starts it (--preset / --config ...), which --resume "
                             "then continues when re-run, or leave --resume out")
    rebuilt = saved is None or args.preset or args.config
    if rebuilt:
        # a new run; or a resume whose command names its preset / file (a preemptible job re-running
        # the command that started the run): built as a new run, then checked against the saved config
        cfg = load_train_config(args.config, args.overrides, args.preset, notes=notes, init_from=args.init_from)
    else:  # `--resume` alone: the saved config, with what the flags below change
        base = saved.replace(allow_new_data=False) if saved.allow_new_data else saved  # one command's permission
        cfg = base.with_overrides(args.overrides) if args.overrides else base
    changes = {}
    if args.out:
        changes["out_dir"] = args.out
    if args.init_from:
        changes["init_from"] = args.init_from
    if getattr(args, "data", None):
        changes["data_source"] = args.data
    if getattr(args, "tokenizer", None):
        changes["tokenizer"] = args.tokenizer
    if getattr(args, "allow_new_data", False):
        changes["allow_new_data"] = True
    if args.attention or args.baseline:
        overrides = dict(cfg.model_overrides)
        if args.attention:
            overrides["attention"] = args.attention
        if args.baseline:
            model = cfg.replace(model_overrides=overrides).model_config()
            base = baseline_config(model)
            overrides.update(attention=base.attention, n_heads=base.n_heads, n_kv_heads=base.n_kv_heads,
                             lambda_init=None, use_subln=True)
            # only where used: older runs' overrides stay as they were
            for name in ("gate", "head_norm", "subtract", "out_scale"):
                if name in overrides or getattr(model, name) != getattr(base, name):
                    overrides[name] = getattr(base, name)
        changes["model_overrides"] = overrides
    cfg = cfg.replace(**changes) if changes else cfg
    # a fine-tuning run's model is its checkpoint's (after the flags above, which keep what they did before it was
    # recorded); a command re-run with --resume names its preset's model, and the run's record stands
    if saved is None and cfg.init_from is not None:
        cfg = with_source_model(cfg)
        check_init_from_flags(cfg, args)
    elif saved is not None and rebuilt and saved.init_from is not None and cfg.init_from is not None:
        cfg = cfg.replace(model=saved.model)  # another init_from is refused below
    if saved is not None:
        cfg = check_resume_changes(saved, cfg, str(saved_path), missing=missing, records=records)
    return cfg


def with_source_model(cfg):
    """``cfg`` with its ``init_from`` checkpoint's ModelConfig mapping as ``model``: the architecture the run
    trains, which the trainer records too (so ``--print-config`` shows it). Unchanged when that checkpoint
    cannot be read: the trainer then names the problem, as it did before."""
    from ..checkpoint import CheckpointError, load_config  # lazy: torch; --help stays fast
    from ..training import checkpointing as ckpt  # lazy: torch; --help stays fast

    try:
        model = load_config(ckpt.resolve_checkpoint(cfg.init_from)).to_dict()
    except (CheckpointError, OSError):
        return cfg
    return cfg if model == cfg.model else cfg.replace(model=model)


def check_init_from_flags(cfg, args: argparse.Namespace) -> None:
    """``--init-from`` starts from a checkpoint's weights, so the flags may not change the model's parameters
    (``--attention``, ``--baseline``, ``--set model_overrides.dim=...``): refused naming the flag, not the weights.
    Overrides that keep every parameter's name and shape (a backend, say) pass; so does an unreadable checkpoint,
    which the trainer names."""
    import torch  # lazy: torch; --help stays fast

    from ..checkpoint import CheckpointError, load_config  # lazy: torch; --help stays fast
    from ..model import Transformer  # lazy: torch; --help stays fast
    from ..training import checkpointing as ckpt  # lazy: torch; --help stays fast

    if not cfg.model_overrides:
        return
    try:
        source = load_config(ckpt.resolve_checkpoint(cfg.init_from))
    except (CheckpointError, OSError):
        return
    with torch.device("meta"):
        theirs = {k: tuple(v.shape) for k, v in Transformer(source).state_dict().items()}
        ours = {k: tuple(v.shape) for k, v in Transformer(cfg.model_config()).state_dict().items()}
    if ours == theirs:
        return
    flags = (["--baseline"] if getattr(args, "baseline", False) else
             [f"--attention {args.attention}"] if getattr(args, "attention", None) else [])
    changed = [f"model_overrides.{k}={v!r}" for k, v in cfg.model_overrides.items()
               if k in source.to_dict() and source.to_dict()[k] != v]
    said = ", ".join(flags or [f"--set {c}" for c in changed] or ["the model overrides"])
    raise ValueError(f"--init-from {cfg.init_from}: {said} would change the model's parameters "
                     f"({sorted(set(ours) ^ set(theirs))[:4] or 'their shapes'}), but a fine-tune starts from the "
                     f"checkpoint's weights, which fit its own architecture ({source.attention}, dim {source.dim}, "
                     f"{source.n_heads} heads): leave {'that flag' if flags else 'those overrides'} out, or train "
                     f"from scratch (convert a model to another kind with `difftx convert`)")


def run(args: argparse.Namespace) -> int:
    from ..training import TRAIN_PRESETS, train  # lazy: torch; --help stays fast
    from ..training.config import FINETUNE_PRESET  # lazy: torch; --help stays fast

    if args.list_presets:
        for name, c in TRAIN_PRESETS.items():
            model = "init-from" if name == FINETUNE_PRESET else c.model  # the checkpoint's architecture
            print(f"{name:10s} model={model:9s} batch={c.batch_size}x{c.seq_len} accum={c.grad_accum} "
                  f"steps={c.steps} lr={c.lr:g} device={c.device} dtype={c.dtype}")
        return 0
    main_rank = int(os.environ.get("RANK", "0")) == 0
    notes: list[str] = []
    cfg = build_config(args, notes)
    check_not_input(cfg.out_dir, "--out", {"--data": cfg.data_source, "--tokenizer": cfg.tokenizer,
                                           "--init-from": cfg.init_from})
    for note in notes if main_rank else ():
        print(f"difftx train: note: {note}", file=sys.stderr)
    if args.print_config:
        print(cfg.to_json())
        return 0
    if main_rank and cfg.tensorboard and tensorboard_asked(args) and importlib.util.find_spec("tensorboard") is None:
        from ..training.metrics import TENSORBOARD_MISSING  # lazy: torch; --help stays fast

        print(TENSORBOARD_MISSING, file=sys.stderr)  # only when asked for: by default it is used if installed
    from ..data.store import PROGRESS_BARS  # lazy: numpy; --help stays fast

    # --no-progress: the training bar drawn into nothing, the tokenizing bar off; the lines still print
    hidden = PROGRESS_BARS.set(False) if args.no_progress else None
    sink = open(os.devnull, "w") if args.no_progress else None
    try:  # errors: the CLI's boundary (a bad checkpoint exits 2, divergence 1)
        result = train(cfg, resume=args.resume, progress_bar={"file": sink} if sink is not None else None)
    except OSError as e:
        raise with_last_checkpoint(e, cfg.out_dir) from e
    finally:
        if hidden is not None:
            PROGRESS_BARS.reset(hidden)
            sink.close()
    if main_rank:
        print(done_line(result))
    return 0


def tensorboard_asked(args: argparse.Namespace) -> bool:
    """Whether this command asks for TensorBoard itself (``--set tensorboard=...`` or the config file's
    ``tensorboard``), rather than taking the default (TensorBoard when it is installed)."""
    from ..overrides import split_override
    from ..training.config import read_config_file  # lazy: torch; --help stays fast

    if any(split_override(o)[0].strip() == "tensorboard" for o in args.overrides):
        return True
    return bool(args.config) and "tensorboard" in read_config_file(args.config)


WRITE_ERRNOS = ("ENOSPC", "EDQUOT", "EFBIG", "EROFS", "EIO")  # a write that failed for want of room or a disk


def with_last_checkpoint(e: OSError, out_dir) -> OSError:
    """A failed write during training (metrics.jsonl, train_config.json, ...), with the run's last
    good checkpoint named, as a checkpoint's own write failure names it: what ``--resume``
    continues from once there is room again. Other errors, and those that name it, unchanged."""
    from ..checkpoint import CheckpointError  # lazy: torch; --help stays fast
    from ..training import checkpointing as ckpt  # lazy: torch; --help stays fast

    codes = {getattr(errno, n) for n in WRITE_ERRNOS if hasattr(errno, n)}
    text = e.strerror or str(e)
    if e.errno not in codes or "checkpoint" in text:
        return e
    try:
        latest = ckpt.latest_checkpoint(out_dir)
    except (CheckpointError, OSError):
        latest = None
    good = (f"the last good checkpoint is {latest} (--resume continues from it)" if latest is not None
            else "no checkpoint was written yet")
    return OSError(e.errno, f"{text}; {good}", e.filename)


def done_line(result) -> str:
    """The closing line of ``difftx train``: the run's summary (the whole run, after a resume too)."""
    from ..training.summary import summarize_run  # lazy: torch; --help stays fast

    loss = "n/a" if result.final_loss is None else f"{result.final_loss:.4f}"
    s = summarize_run(result.out_dir)
    parts = [f"done: step {result.step}/{s.steps_total}, train loss {loss}"]
    if s.final_val is not None:
        parts.append(f"val loss {s.final_val[1]:.4f} (best {s.best_val[1]:.4f} at step {s.best_val[0]})")
    if s.val_tokens:
        parts.append(f"validation {s.val_tokens:,} tokens per pass")
    rate = f" ({s.tokens_per_s:,.0f} tokens/s over the run's {s.train_time_s:.1f}s of training)" \
        if s.tokens_per_s else ""
    parts.append(f"{result.tokens_seen:,} tokens seen{rate}")
    if s.final_lambda:
        from ..training.summary import lambda_text  # lazy: torch; --help stays fast

        parts.append(f"λ per layer {lambda_text(s.final_lambda)}")
    parts.append(f"checkpoint {result.last_checkpoint}")
    return ", ".join(parts)
