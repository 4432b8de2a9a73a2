"""The run's log in its folder: everything the run prints (stdout and stderr) also goes to <out>/log.txt.

    with run_log(out, quiet=args.quiet):    # around the run; config.json in out starts the file
        ...
        with shown():                        # printed even under --quiet (the results table, [done])
            print(table)

The file is opened once <out>/config.json exists (infra/run.begin writes it): until then the lines wait in
memory, so a run refused before it takes --out leaves nothing there (a folder holding only a log would be a
folder of someone else's files to the next run). Appended: a --resume continues the same log. --quiet keeps
the console to the results and the error line; the log still gets every line. The console streams are
line-flushed, so a redirected stdout is never minutes behind.
"""
import contextlib
import io
import sys
from pathlib import Path

from infra import loader

_LOUD = [0]


class Tee(io.TextIOBase):
    """A console stream that also writes into the run's log.txt (see the module docstring)."""

    def __init__(self, console, out, quiet, buffer):
        self.console, self.out, self.quiet, self.buffer_ = console, Path(out), quiet, buffer

    def write(self, s):
        if not self.quiet or _LOUD[0]:
            self.console.write(s)
            if "\n" in s:
                self.console.flush()
        self.buffer_.write(s)
        return len(s)

    def flush(self):
        self.console.flush()
        self.buffer_.flush()

    def isatty(self):
        return self.console.isatty()

    @property
    def encoding(self):
        return getattr(self.console, "encoding", "utf-8")


class LogFile:
    """log.txt, opened when config.json appears; lines before that kept in memory."""

    def __init__(self, out):
        self.out, self.file, self.pending = Path(out), None, io.StringIO()

    def write(self, s):
        if self.file is None and (self.out / "config.json").is_file():
            self.file = open(self.out / "log.txt", "a", encoding="utf-8")
            self.file.write(self.pending.getvalue())
        (self.file or self.pending).write(s)

    def flush(self):
        if self.file is not None:
            self.file.flush()

    def close(self):
        self.write("")
        if self.file is not None:
            self.file.close()


@contextlib.contextmanager
def run_log(out, quiet=False):
    log = LogFile(out)
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = Tee(streams[0], out, quiet, log), Tee(streams[1], out, quiet, log)
    was_quiet, loader.QUIET = loader.QUIET, quiet
    try:
        yield log
    finally:
        sys.stdout, sys.stderr = streams
        loader.QUIET = was_quiet
        log.close()


@contextlib.contextmanager
def shown():
    """What is printed inside reaches the console even under --quiet."""
    _LOUD[0] += 1
    try:
        yield
    finally:
        _LOUD[0] -= 1
