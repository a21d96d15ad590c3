"""The one exception a line's parsing raises: a problem with one of its fields.

Contract: ``field`` names the field as the user wrote it (``body.stop``,
``messages[2].content``), or None when the line as a whole is at fault; the
JSONL reader turns each into an error record for that line and goes on.
"""

from __future__ import annotations


class LineFault(Exception):
    """A problem with one field of one line (``field`` is None for the line)."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
