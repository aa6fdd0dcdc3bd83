"""The gateway's access-log handler: plain lines, buffered (``loraplex gateway``'s access log).

``gateway.request_path`` hands a ``BufferedLines`` its line as it is (``add_line``), without the
``LogRecord`` a logger would build for it, which costs more than the rest of the line."""

from __future__ import annotations

import logging
from typing import TextIO


class BufferedLines(logging.Handler):
    """Writes log messages as plain lines, many per ``write`` (flushed when full and by the app
    every second)."""

    def __init__(self, stream: TextIO, capacity: int = 256) -> None:
        super().__init__()
        self.stream = stream
        self.capacity = capacity
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.add_line(record.getMessage())

    def add_line(self, line: str) -> None:
        """Take one line as it is (the gateway's access log calls this directly, without a record)."""
        self.lines.append(line)
        if len(self.lines) >= self.capacity:
            self.flush()

    def flush(self) -> None:
        if self.lines:
            lines, self.lines = self.lines, []
            try:
                self.stream.write("\n".join(lines) + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        self.flush()
        super().close()
