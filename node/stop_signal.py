"""SIGTERM / Ctrl-C while a node starts: remembered, and acted on at the next safe point.

Raising ``KeyboardInterrupt`` from the signal handler (Python's default for SIGINT) unwinds
wherever the main thread happens to be. Once, on a node that was PID 1, SIGTERM landed in
logging's after-fork hook while hivemind forked a helper: the exception was swallowed there
("Exception ignored in _releaseLock"), logging's module lock stayed held, the compute thread
blocked on it, and the node never stopped. So the first signal only sets a flag; the start-up
path calls :meth:`check` between its phases, and ``StageRuntime.serve`` stops at once if the
flag is set by the time the event loop owns the signals. A second signal aborts where it
stands, for a user who will not wait.
"""

from __future__ import annotations

import os
import signal

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopRequest:
    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        for sig in _SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        # os.write, not print: a handler that prints can re-enter a buffered write in progress
        os.write(2, b"stop requested: the node stops at the next safe point (signal again to abort now)\n")

    def check(self) -> None:
        """Unwind the start-up (through its cleanup) if a stop was requested."""
        if self.requested:
            raise KeyboardInterrupt


def default_signals_in_child() -> None:
    """In a forked helper: SIGTERM kills again (multiprocessing stops helpers with it at exit)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
