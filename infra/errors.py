"""The project's one exception: a fault of the user's input, said in one line. The one guard that turns
any exception at a boundary (a file, a folder, a model) into such a line is infra/run.py's guard()."""


class RunError(SystemExit):
    """A fault the user can fix (a flag, a file, a folder, a model): raised with one line
    "error: <what is wrong>; <what to do>", it ends the run with exit status 1 and no
    traceback (SystemExit's own handling, also when align.main is called from Python).
    Every other exception is a bug and keeps its traceback."""

    def __init__(self, message):
        super().__init__(message if message.startswith("error: ") else f"error: {message}")


def first_line(e):
    """The first line of an exception's message (transformers' messages run to paragraphs)."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
