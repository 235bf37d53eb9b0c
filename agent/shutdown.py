"""The stop event of a long-running command: set by SIGTERM, SIGINT or, when given, after a duration."""

from __future__ import annotations

import signal
import threading


def stop_event(duration: float | None = None) -> threading.Event:
    """An event SIGTERM and SIGINT set (installed now, on the main thread), and a timer after `duration` seconds."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if duration is not None:
        timer = threading.Timer(duration, stop.set)
        timer.daemon = True
        timer.start()
    return stop
