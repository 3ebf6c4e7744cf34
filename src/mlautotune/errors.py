"""User-facing errors: one paragraph that names the problem and the fix, never a traceback."""


class UserError(Exception):
    """A mistake in the user's input. The CLI prints the message and exits with status 2."""

    exit_code = 2

    def __init__(self, problem: str, fix: str = ""):
        self.problem = problem.strip()
        self.fix = fix.strip()
        super().__init__(self.message)

    @property
    def message(self) -> str:
        return f"{self.problem} {self.fix}".strip()
