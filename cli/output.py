"""Where the records go: ``-o OUTPUT`` (locked for the run) or standard output.

Contract: ``OutputFile.open(path)`` opens OUTPUT without emptying it and
takes an exclusive advisory lock (``flock``) on it, so a second run on the
same file (``--resume`` or not) is refused at once with ``OutputBusy``, which
names the process that holds the lock where the system says (``/proc/locks``).
The kernel drops the lock when its process ends, however it ends: a
``kill -9`` never leaves a stale lock behind. ``start(append)`` empties the
file unless the run appends (``--resume``); the command calls it once the
model has loaded, so a run that is refused or cannot load never destroys an
earlier output.

``write_line`` hands one whole line to the kernel, with no buffer in between.
When the kernel refuses (ENOSPC, EIO, EFBIG past a file-size limit, EBADF),
the file is cut back to its last whole line where it can be, and
``OutputFailed`` names the path and the error; every later write fails the
same way without writing, so no line is ever missing from the middle of the
output, only from its end, which ``--resume`` fills in. A stop
(``stop.py``) that comes while a line is written waits for it: a line is out
whole, and counted, or not at all.

A file the run created and never started writing (the model did not load)
is removed again on ``close``, so a failed run leaves no empty output behind.

``StandardOutput`` is standard output with the same failure: the shell owns
that file, so a line cut off there stays cut off (``--resume`` repairs it
once the output is a file: ``-o FILE``). A reader that went away is not a
failure of the output but ``BrokenPipeError``, left to the caller.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import IO, Protocol

from metrale.cli.stop import held


class OutputBusy(Exception):
    """Another process holds OUTPUT's lock; ``holder`` describes it, or is
    None where the system does not say."""

    def __init__(self, path: str, holder: str | None) -> None:
        who = f"another run ({holder})" if holder else "another process"
        super().__init__(
            f"{path} is being written by {who}; wait for it to end, or stop it "
            "and run again with --resume"
        )
        self.path, self.holder = path, holder


class OutputFailed(Exception):
    """A write to ``where`` failed with ``error``. ``whole``: the output ends
    with a whole line (cut back, or nothing of the line reached it)."""

    def __init__(self, where: str, error: OSError, whole: bool) -> None:
        reason = error.strerror or str(error)
        code = errno.errorcode.get(error.errno or 0, "")
        super().__init__(f"cannot write {where}: {reason}" + (f" ({code})" if code else ""))
        self.where, self.error, self.whole = where, error, whole


class LineSink(Protocol):
    """What the writer writes to: one whole JSONL line (newline included) a call."""

    def write_line(self, line: str) -> None: ...


class OutputFile:
    """``-o OUTPUT`` (module doc). Use ``open``; ``close`` drops the lock."""

    def __init__(self, path: str, fd: int, created: bool = False) -> None:
        self.path, self.fd, self.created = path, fd, created
        self.regular = stat.S_ISREG(os.fstat(fd).st_mode)
        self.size = 0  # bytes of whole lines; the file is cut back to this on failure
        self.started = False
        self.failure: OutputFailed | None = None

    @classmethod
    def open(cls, path: str) -> OutputFile:
        """Opens and locks ``path`` (creating it and its folder), leaving what
        it holds. ``OutputBusy`` when another process holds the lock;
        ``OSError`` when it cannot be opened."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC
        try:
            fd, created = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            fd, created = os.open(path, flags), False
        out = cls(path, fd, created)
        if out.regular:  # a device or a pipe (-o /dev/stdout) has no content to guard
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = lock_holder(fd)
                os.close(fd)
                raise OutputBusy(path, holder) from None
        return out

    def start(self, append: bool) -> None:
        """Empties the file unless ``append``; writes go to its end."""
        if self.regular and not append:
            os.ftruncate(self.fd, 0)
        self.size = os.fstat(self.fd).st_size if self.regular else 0
        self.started = True

    def write_line(self, line: str) -> None:
        if self.failure is not None:
            raise self.failure
        data = line.encode("utf-8")
        done = 0
        with held():
            try:
                while done < len(data):
                    done += os.write(self.fd, data[done:])  # a full disk may take part of it
            except OSError as exc:
                whole = done == 0 or self._cut_back()
                self.failure = OutputFailed(self.path, exc, whole)
                raise self.failure from exc
            self.size += len(data)

    def close(self) -> None:
        if self.created and not self.started:
            Path(self.path).unlink(missing_ok=True)  # still ours: the lock is held
        os.close(self.fd)

    def _cut_back(self) -> bool:
        """Cuts the file back to its whole lines; False where it cannot."""
        if not self.regular:
            return False
        try:
            os.ftruncate(self.fd, self.size)
        except OSError:
            return False
        return True


class StandardOutput:
    """Standard output (module doc): each line written and flushed."""

    where = "standard output"

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.failure: OutputFailed | None = None

    def write_line(self, line: str) -> None:
        if self.failure is not None:
            raise self.failure
        try:
            with held():
                self.stream.write(line)
                self.stream.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:
            self.failure = OutputFailed(self.where, exc, whole=False)
            raise self.failure from exc


def lock_holder(fd: int) -> str | None:
    """``pid 4242: metrale generate in.jsonl -o out.jsonl`` for the process
    holding a ``flock`` on ``fd``'s file, from ``/proc/locks`` (Linux); None
    where that cannot be read."""
    st = os.fstat(fd)
    try:
        table = Path("/proc/locks").read_text()
    except OSError:
        return None
    for row in table.splitlines():
        # "1: FLOCK  ADVISORY  WRITE 4242 fe:00:2482765 0 EOF"; a waiter's row has "->"
        fields = row.split()
        if len(fields) < 6 or fields[1] != "FLOCK":
            continue
        device = fields[5].split(":")
        if len(device) != 3:
            continue
        try:
            major, minor, inode = int(device[0], 16), int(device[1], 16), int(device[2])
            pid = int(fields[4])
        except ValueError:
            continue
        if (major, minor, inode) == (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino):
            return _process(pid)
    return None


def _process(pid: int) -> str:
    """``pid N: its command line``, the program named without its folder (a
    script run by its interpreter, as the ``metrale`` entry point is, by the
    script's name)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return f"pid {pid}"
    argv = [a for a in argv if a]
    if len(argv) > 1 and os.path.basename(argv[0]).startswith("python") and "/" in argv[1]:
        argv = argv[1:]
    if not argv:
        return f"pid {pid}"
    command = " ".join([os.path.basename(argv[0]), *argv[1:]])
    command = " ".join(command.split())  # one line, whatever the arguments hold
    if len(command) > 160:
        command = command[:157] + "..."
    return f"pid {pid}: {command}"
