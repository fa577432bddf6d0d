"""User-facing errors: raised anywhere, printed by the CLI as one line, never as a traceback."""


class UserError(Exception):
    """Bad input from a user (flag, file, line). The message is complete and printed as is."""


class TraceError(UserError):
    """A bad trace line: the message names the file and the 1-based line number."""

    def __init__(self, path: str, line: int, reason: str) -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path = path
        self.line = line
        self.reason = reason
