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
    """The first line of an exception's message (transformers' messages run to paragraphs); a first line
    that ends with a colon ("Validation error for field 'hidden_size':") with the next line that says something."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    if not lines:
        return type(e).__name__
    return (f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0])[:300]
