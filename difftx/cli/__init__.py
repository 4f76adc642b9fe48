"""The ``difftx`` command. Each subcommand lives in its own module of this package and is a thin
wrapper over one library function.

A subcommand module defines ``register(subparsers)``, which adds its parser and sets
``func`` (called with the parsed arguments) as a default. Modules are listed in
``SUBCOMMANDS``; one that cannot be imported (a missing optional dependency) is reported
when used, not when ``difftx --help`` runs.

Every subcommand runs inside one error boundary (:func:`main`), with one exit-code convention:

* ``0``: success;
* ``1``: a runtime failure while working: disk full or another I/O error, out of memory, the
  training loss diverged, or an unexpected error (a bug: the one-line message says to run again
  with ``DIFFTX_DEBUG=1`` for the traceback);
* ``2``: a usage or input error, found before anything is changed: a bad flag or value, a
  missing, corrupt or incompatible file or checkpoint, an output that would overwrite something,
  a run folder in use by another run, an unavailable device or optional dependency;
* ``130``: interrupted (Ctrl-C), at any moment, start-up included;
* ``141``: standard output was closed early (``difftx ... | head``).

Errors are one line on stderr, ``difftx COMMAND: error: ...``, naming the file or flag;
``DIFFTX_DEBUG=1`` also prints the traceback of any error.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import re
import signal
import sys
import threading
import warnings
from typing import Optional, Sequence

from .. import __version__

# module name -> one-line help (kept here so --help works without importing heavy modules)
SUBCOMMANDS: dict[str, str] = {
    "demo": "short DIFF-vs-baseline demo on built-in data",
    "info": "show a model config, its parameter counts and its matched baseline",
    "train": "train a DIFF model or its baseline (resumable; torchrun for many GPUs)",
    "runs": "training runs side by side (params, tokens/s, best and final validation loss); --plot curves; --pool: "
            "one metric pooled across compare folders",
    "generate": "sample text from a checkpoint with the KV cache",
    "tokenizer": "train a BPE tokenizer locally on text files",
    "bench": "benchmark DIFF attention against the parameter-matched baseline",
    "export": "export a model folder to Hugging Face transformers (DiffLlama / Llama / Qwen2 / difftx's code)",
    "import": "import a local Hugging Face DiffLlama / Llama / Mistral / Qwen2 folder as a difftx model",
    "convert": "make a standard / Llama / Mistral / Qwen2 model differential, with the same function at conversion",
    "compare": "train DIFF and its matched baseline over paired seeds, evaluate both, write a report",
    "scale": "the comparison at several model sizes; DIFF's parameter efficiency (paper Fig. 3a)",
    "map": "the regime map: a compare per cell (init, depth, width, task), trained where missing; map.md/png/json",
    "eval": "run one evaluation task on a checkpoint",  # its parser lists the tasks of difftx.tasks.TASKS
}

# subcommand -> module name, where they differ (``import`` is a Python keyword)
MODULE_NAMES: dict[str, str] = {"import": "import_"}


EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_PIPE = 0, 1, 2, 130, 141


class Parser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (and the same exit code 2)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="difftx", description="Differential Transformer toolkit: models, training, evaluation, interop.")
    parser.add_argument("--version", action="version", version=f"difftx {__version__}")
    parser.add_argument("--kinds", metavar="FILES", default=None,
                        help="Python files or modules (comma-separated) that register your attention kinds "
                             "(difftx.register_attention) or compare training tasks (register_training_task), "
                             "imported before the command, and by its workers; the same as the DIFFTX_KINDS "
                             "environment variable")
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


def _kinds_option(argv: Optional[Sequence[str]]) -> Optional[str]:
    """The value of the top-level ``--kinds`` option (before the command), if given."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--kinds", default=None)
    pre.add_argument("command", nargs="?")
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    return known.kinds


def _use_kinds(spec: str) -> None:
    """``--kinds``: kept in the environment (worker processes import the kinds from there), then imported."""
    from ..attention.registry import KINDS_ENV, load_kinds  # lazy: torch; --help stays fast

    os.environ[KINDS_ENV] = ",".join(p for p in (os.environ.get(KINDS_ENV, ""), spec) if p)
    load_kinds(spec)


def _unavailable(name: str, error: Exception) -> int:
    print(f"difftx {name}: unavailable because an optional dependency is missing: {error}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    interrupt = _InterruptWatch()
    prog, code = "difftx", EXIT_INTERRUPTED
    try:
        if not interrupt.seen:  # else a Ctrl-C came while the CLI was imported (see difftx/__main__.py)
            prog, code = _run(argv, interrupt)
    except KeyboardInterrupt:  # one that came between the handler and the boundary inside _run
        _debug_traceback()
    code = interrupt.finish(code, prog)
    distributed = sys.modules.get("difftx.training.distributed")  # loaded by any command that trains
    if distributed is not None and distributed.under_torchrun():
        distributed.exit_worker(code)  # a torchrun worker skips interpreter shutdown (see exit_worker)
    return code


def _run(argv: Optional[Sequence[str]], interrupt: "_InterruptWatch") -> tuple[str, int]:
    """The command's name and exit code: the error boundary around parsing and running it."""
    prog = "difftx"
    with warnings.catch_warnings():
        warnings.showwarning = lambda message, category, *a, **k: print(
            f"{prog}: warning: {message}", file=sys.stderr)
        try:
            kinds = _kinds_option(argv)
            if kinds:  # before the parser is built: its choices list the kinds
                _use_kinds(kinds)
            parser = build_parser()
            args = parser.parse_args(argv)
            if not getattr(args, "func", None):
                parser.print_help()
                return prog, EXIT_OK
            prog = f"difftx {args.command}"
            code = int(args.func(args) or 0)
            sys.stdout.flush()  # a closed pipe is reported here, not at interpreter shutdown
        except KeyboardInterrupt:
            _debug_traceback()
            code = EXIT_INTERRUPTED
        except Exception as e:  # noqa: BLE001 - the boundary: every error becomes one line and an exit code
            if interrupt.seen:  # a Ctrl-C that surfaced as another error (e.g. a half-done import)
                _debug_traceback()
                code = EXIT_INTERRUPTED
            else:
                code = report_error(prog, e)
                interrupt.said = code == EXIT_INTERRUPTED  # the error's line said it
    return prog, code


class _InterruptWatch:
    """Ctrl-C, whenever it comes, ends the command with one line and exit code 130.

    Python turns SIGINT into ``KeyboardInterrupt`` at the next bytecode, but C code (an
    extension's import, for one) may swallow it or turn it into another error; the handler
    installed here remembers that the signal came, so the boundary reports it either way. While
    torch, numpy or triton is being imported the interrupt waits until that import is done: an
    exception raised inside their native start-up can abort the process (seen with torch 2.13)."""

    NATIVE = ("torch", "numpy", "triton")

    def __init__(self) -> None:
        self.seen, self.said, self._old = False, False, None
        current = signal.getsignal(signal.SIGINT)
        early = getattr(current, "hits", None)  # `python -m difftx`'s handler while the CLI was imported
        if threading.current_thread() is threading.main_thread() and \
                (current is signal.default_int_handler or early is not None):
            signal.signal(signal.SIGINT, self._handle)
            self._old = signal.default_int_handler if early is not None else current
            self.seen = bool(early)  # a Ctrl-C that came while the CLI's modules were imported
            self._old_unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisable

    def _handle(self, signum, frame) -> None:
        self.seen = True
        self._raise_when_safe()

    def _raise_when_safe(self, *_) -> None:
        if hasattr(signal, "setitimer") and self._native_import_running():
            signal.signal(signal.SIGALRM, self._raise_when_safe)  # look again in 20 ms
            signal.setitimer(signal.ITIMER_REAL, 0.02)
            return
        raise KeyboardInterrupt

    def _unraisable(self, unraisable) -> None:
        """The interrupt raised inside a callback whose errors Python ignores (importlib's module-lock
        weakref callback, for one) is not lost and prints no "Exception ignored" traceback: it is
        raised again 20 ms later, in code that can stop."""
        if self.seen and issubclass(unraisable.exc_type, KeyboardInterrupt):
            if hasattr(signal, "setitimer"):
                signal.signal(signal.SIGALRM, self._raise_when_safe)
                signal.setitimer(signal.ITIMER_REAL, 0.02)
            return
        self._old_unraisable(unraisable)

    @classmethod
    def _native_import_running(cls) -> bool:
        for name, module in list(sys.modules.items()):
            if name.partition(".")[0] in cls.NATIVE and getattr(getattr(module, "__spec__", None),
                                                                 "_initializing", False):
                return True
        return False

    def finish(self, code: int, prog: str) -> int:
        if hasattr(signal, "setitimer") and signal.getsignal(signal.SIGALRM) == self._raise_when_safe:
            # a look-again timer still armed (the interrupt surfaced as another error first) would fire during
            # interpreter shutdown, after Python has put SIGALRM back to its default, and kill the process
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, signal.SIG_DFL)
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            sys.unraisablehook = self._old_unraisable
            self._old = None
        if code == EXIT_INTERRUPTED or self.seen:
            if not self.said:
                print(f"{prog}: interrupted", file=sys.stderr)
            # CPython remembers a KeyboardInterrupt that escaped any exec() of a string (dataclasses
            # use one per generated method, so an import interrupted there sets it) and then kills
            # the process with SIGINT at exit, whatever exit code we return. A completed exec
            # clears that memory.
            exec("")  # noqa: S102
            return EXIT_INTERRUPTED
        return code


def _debug_traceback() -> None:
    if os.environ.get("DIFFTX_DEBUG", "") not in ("", "0"):
        import traceback  # lazy: only under DIFFTX_DEBUG

        traceback.print_exc()


def _is(e: BaseException, module: str, name: str) -> bool:
    """``isinstance(e, module.name)`` without importing ``module`` (an error of a module that was
    never imported cannot be one of its classes)."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and isinstance(e, cls)


def classify_error(e: BaseException) -> tuple[int, str]:
    """The exit code and message of an error that reached the boundary (see the module doc)."""
    if isinstance(e, OSError) and e.errno == errno.EPIPE:
        return EXIT_PIPE, ""
    if isinstance(e, (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)):
        hint = {PermissionError: "choose a location you can access"}.get(type(e), "check the path")
        return EXIT_USAGE, f"{_os_message(e)} ({hint})"
    if isinstance(e, OSError):
        hint = {errno.ENOSPC: "free some disk space or write elsewhere, then run again",
                errno.EDQUOT: "free some disk space or write elsewhere, then run again",
                errno.EROFS: "write to another location",
                errno.EFBIG: "a file-size limit (ulimit -f) stopped the write: raise it or write less, then run again"
                }.get(e.errno, "check the disk and the path, then run again")
        return EXIT_FAILURE, f"{_os_message(e)} ({hint})"
    text = re.sub(r"\s*\n\s*", " ", str(e).strip())  # one line
    if _is(e, "difftx.compare.workers", "WorkerLost"):  # says itself what to do (it names memory as one cause)
        return EXIT_FAILURE, text
    if isinstance(e, MemoryError) or _is(e, "torch", "OutOfMemoryError") or _is(e, "torch.cuda", "OutOfMemoryError") \
            or isinstance(e, RuntimeError) and ("can't allocate memory" in text or "out of memory" in text):
        return EXIT_FAILURE, f"out of memory: {text[:300] or type(e).__name__} (ask for less: a smaller batch, " \
                             f"length or number of tokens)"
    if _is(e, "difftx.training.trainer", "TrainingDivergedError"):
        return EXIT_FAILURE, text
    if _is(e, "difftx.compare.train", "TrainingInterrupted"):  # a signal stopped it after a checkpoint
        return EXIT_INTERRUPTED, text
    if isinstance(e, ValueError) or _is(e, "difftx.checkpoint", "CheckpointError"):
        return EXIT_USAGE, _with_recovery_hint(text)
    if isinstance(e, ModuleNotFoundError):
        return EXIT_USAGE, f"{text} (an optional dependency is missing; see the README's Optional extras)"
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return EXIT_FAILURE, (f"unexpected error: {type(e).__name__}{': ' + text if text else ''} "
                          f"(run with DIFFTX_DEBUG=1 for the traceback)")


def _with_recovery_hint(text: str) -> str:
    """``text``, and when it names a damaged checkpoint of a run (or its ``latest`` pointer), the
    older intact checkpoint and how to resume from it (``checkpointing.recovery_hint``)."""
    if "checkpoints" not in text:
        return text
    try:
        from ..training.checkpointing import recovery_hint  # lazy: torch; --help stays fast

        hint = recovery_hint(text)
    except Exception:  # noqa: BLE001 - a hint must never hide the error itself
        hint = None
    return f"{text}; {hint}" if hint else text


def _os_message(e: OSError) -> str:
    if e.filename is None:
        return str(e)
    where = f"{e.filename} -> {e.filename2}" if e.filename2 is not None else str(e.filename)
    return f"{where}: {e.strerror or type(e).__name__}"


def report_error(prog: str, e: BaseException) -> int:
    """Print one line for ``e`` (and its traceback under ``DIFFTX_DEBUG=1``); return the exit code."""
    _debug_traceback()
    code, message = classify_error(e)
    if code == EXIT_PIPE:  # nobody reads stdout any more: leave quietly
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return code
    print(f"{prog}: {'' if code == EXIT_INTERRUPTED else 'error: '}{message}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
