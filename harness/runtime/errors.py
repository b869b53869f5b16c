"""The one error type the CLI turns into a one-line message and exit code 2."""


class HarnessError(Exception):
    """Bad input or environment: the message names the problem and the fix."""


def first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message as one line for a HarnessError (its first line; the type's name when it has none)."""
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:limit]
