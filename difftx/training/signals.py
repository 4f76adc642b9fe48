"""Signals around the training loop: SIGTERM / SIGUSR1 end a run after its step with a checkpoint
(:class:`_StopSignal`); a Ctrl-C waits while a step's checkpoints are written (:func:`_held_sigint`)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def _held_sigint() -> Iterator[None]:
    """A Ctrl-C (SIGINT) inside the block is held and raised as ``KeyboardInterrupt`` at its end
    (main thread only, where SIGINT is not ignored; elsewhere the block runs as is)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    held: list = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if held:
        raise KeyboardInterrupt


# what the line of a run stopped by a signal tells to do next (difftx compare: run its command again)
STOP_HINT = ["continue with --resume"]


@contextlib.contextmanager
def stop_hint(text: str) -> Iterator[None]:
    """Within the block, the line of a run stopped by a signal ends with ``text``."""
    old, STOP_HINT[0] = STOP_HINT[0], text
    try:
        yield
    finally:
        STOP_HINT[0] = old


class _StopSignal:
    """SIGTERM / SIGUSR1 (what schedulers send before preempting a job) ask the loop to finish
    the current step, write a checkpoint and return. Installed only in the main thread."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        self.requested, self.name, self._old = False, None, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.requested, self.name = True, signal.Signals(signum).name

    def restore(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}
