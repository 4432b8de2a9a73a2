"""The course tools' one error: a fault the user can fix, one line "error: <what is wrong>; <what to do>", exit
status 1 and no traceback (SystemExit's own handling). The course's own class, so that making a copy and grading
one read nothing of infra/ (the driver's package, free to change shape)."""


class CourseError(SystemExit):
    def __init__(self, message):
        super().__init__(message if message.startswith("error: ") else f"error: {message}")
