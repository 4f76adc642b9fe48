"""``python -m difftx``: the command line. A Ctrl-C that comes while the CLI's modules are still
being imported, before its own handler is in place, is remembered here; the command then ends
with one line and exit code 130, as after any other Ctrl-C."""

import sys

try:
    import _signal as _sig  # the C module: importing it runs no Python code, so the handler is in place at once
except ImportError:  # pragma: no cover - an interpreter without it
    import signal as _sig


def _remember(signum, frame) -> None:
    _remember.hits += 1


_remember.hits = 0
if _sig.getsignal(_sig.SIGINT) is _sig.default_int_handler:
    _sig.signal(_sig.SIGINT, _remember)

from .cli import main  # noqa: E402 - after the handler, so that its imports are covered

sys.exit(main())
