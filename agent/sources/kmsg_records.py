"""Reads the records /dev/kmsg holds now, one line each, without waiting; an overwritten record is reported."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator


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
