"""Reads the kernel log's records without waiting: those /dev/kmsg holds now, one line each (an overwritten
record is reported), and, for a followed text log, the wake-up when its file is written (inotify)."""

from __future__ import annotations

import errno
import os
import select
from collections.abc import Callable, Iterator
from pathlib import Path

#: inotify's event for a write to the watched file (<sys/inotify.h>).
_IN_MODIFY = 0x00000002


class RecordReader:
    """Reads whatever records the device holds now, one line each, without waiting; an overwritten record
    (EPIPE) is reported and skipped. /dev/kmsg gives one record per read; a pipe standing in for it may give
    several, or part of one, which waits for the rest."""

    def __init__(self, fd: int, on_lost: Callable[[], None]) -> None:
        self.fd = fd
        self.on_lost = on_lost
        self._partial = ""

    def available(self) -> Iterator[str]:
        while True:
            try:
                data = os.read(self.fd, 16384)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno != errno.EPIPE:
                    raise
                self.on_lost()
                continue
            if not data:
                return
            lines = (self._partial + data.decode("utf-8", errors="replace")).split("\n")
            self._partial = lines.pop()
            # Lines starting with a space are the record's dictionary (SUBSYSTEM=..., DEVICE=...).
            yield from (line for line in lines if line and not line.startswith(" "))


class FileWrites:
    """An inotify watch on one file's writes: the follower of a text log waits here and wakes on the write
    itself, instead of reading on a timer (which left a storm's last lines waiting up to the timer's period)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._poller = select.poll()
        self._poller.register(fd, select.POLLIN)

    def wait(self, seconds: float) -> bool:
        """True as soon as the file was written since the last call, False when `seconds` passed without a write."""
        if not self._poller.poll(seconds * 1000):
            return False
        while True:  # the events themselves say nothing the next read does not: drained, never parsed
            try:
                if not os.read(self.fd, 4096):
                    break
            except BlockingIOError:
                break
        return True

    def close(self) -> None:
        os.close(self.fd)


def watch_writes(path: Path) -> FileWrites | None:
    """A watch on the writes to `path`, or None where inotify is not to be had (another OS, no watches left):
    the follower then reads on its timer."""
    import ctypes  # noqa: PLC0415 - only a followed text log needs it, never /dev/kmsg

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        init, add = libc.inotify_init1, libc.inotify_add_watch
    except (OSError, AttributeError):
        return None
    fd = int(init(os.O_NONBLOCK | os.O_CLOEXEC))
    if fd < 0:
        return None
    if int(add(fd, os.fsencode(path), _IN_MODIFY)) < 0:
        os.close(fd)
        return None
    return FileWrites(fd)
