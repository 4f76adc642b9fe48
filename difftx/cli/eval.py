"""``difftx eval TASK CHECKPOINT``: one registered evaluation task on a trained checkpoint. Each
task is a sub-command whose flags are generated from its settings (``difftx.tasks``)."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

from ..io import atomic_write, dumps_strict
from ..tasks import TASKS, get_task, settings_from_dict
from ..tasks.base import format_setting
from .args import check_not_input, check_not_owned, output_file


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _shown(field) -> str:
    return "none" if field.default in ((), None) else format_setting(field, field.default)


def _with_default(field) -> str:
    """The setting's help, with its default unless the help already says what the default is."""
    text = field.metadata.get("help", "")
    return text if "default" in text else f"{text} (default {_shown(field)})"


def register(sub) -> None:
    p = sub.add_parser("eval", help=f"run one evaluation ({', '.join(TASKS)}) on a checkpoint",
                       description="Evaluate a checkpoint (a checkpoint folder, or a run folder whose latest "
                                   "checkpoint is used) with one task; `difftx eval TASK --help` lists its settings. "
                                   "Models from `difftx compare` are scored on their synthetic tasks and held-out "
                                   "Shakespeare bytes; text models from `difftx train` on their own held-out split "
                                   "(or --data FILE) and the natural-language needle form. `difftx compare` runs the "
                                   "same code on its models.")
    tasks = p.add_subparsers(dest="task", metavar="TASK", required=True)
    for name, task in TASKS.items():
        t = tasks.add_parser(name, help=task.help, description=(task.description or task.help).rstrip(".") + ".")
        t.add_argument("checkpoint", help="checkpoint or run folder")
        t.add_argument("--tokenizer", help="tokenizer of a text model (default: the one saved with it, else byte)")
        t.add_argument("--data", help="held-out text for a text model, or for a compare model trained on your text: "
                                      "every token of this file is scored (default: the run's own validation split; "
                                      "a compare model's own held-out text)")
        t.add_argument("--device", default="cpu", help="cpu | cuda | auto (default cpu)")
        t.add_argument("--json", dest="json_out", type=output_file,
                       help="also write the full result, with the machine it was computed on, to this JSON file "
                            "(checked before the evaluation; a file of a run, checkpoint or tokenizer is refused "
                            "without --overwrite)")
        t.add_argument("--overwrite", action="store_true", help="let --json replace a file of a run or checkpoint")
        t.add_argument("--no-progress", action="store_true", help="hide progress bars")
        group = t.add_argument_group(f"{name} settings (compare: --set tasks.{name}.SETTING=VALUE)")
        for f in dataclasses.fields(task.Settings):
            group.add_argument(_flag(f.name), dest=f"set_{f.name}", metavar=f.name.upper(),
                               help=_with_default(f))
        t.set_defaults(func=run)


def settings_from_args(name: str, args: argparse.Namespace):
    """The task's settings: its defaults with the flags given (parsed as the settings define)."""
    task = get_task(name)
    given = {f.name: getattr(args, f"set_{f.name}") for f in dataclasses.fields(task.Settings)
             if getattr(args, f"set_{f.name}", None) is not None}
    try:
        return settings_from_dict(task.Settings, given, name)
    except ValueError as e:
        field = re.match(rf"{task.Settings.__name__}\.(\w+)", str(e))  # the setting the error names, when it names one
        if field is not None and field.group(1) in given:
            raise ValueError(f"{e} (flag {_flag(field.group(1))})") from None
        raise ValueError(f"{e} (flags: {', '.join(_flag(k) for k in given) or 'none'})") from None


def run(args: argparse.Namespace) -> int:
    from ..provenance import machine  # lazy: --help stays fast
    from ..tasks.runner import evaluate_checkpoint  # lazy: --help stays fast

    check_not_owned(args.json_out, "--json", args.overwrite)
    check_not_input(args.json_out, "--json", {"the checkpoint": args.checkpoint, "--tokenizer": args.tokenizer,
                                               "--data": args.data, "--examples": getattr(args, "set_examples", None)})
    settings = settings_from_args(args.task, args)
    # a missing or corrupt checkpoint is a CheckpointError: the boundary (difftx.cli.main) makes it exit code 2
    res = evaluate_checkpoint(args.task, args.checkpoint, settings=settings, tokenizer=args.tokenizer,
                              data=args.data, device=args.device, progress=not args.no_progress)
    print(f"{res['checkpoint']} ({res['kind']}, {res['attention']}, {res['parameters']:,} parameters)")
    get_task(args.task).print(res)
    if args.json_out:
        text = dumps_strict({**res, "machine": machine(args.device)}, indent=1)
        atomic_write(Path(args.json_out), lambda p: Path(p).write_text(text + "\n"))
    return 0
