"""The one error type the CLI turns into a one-line message and exit code 2."""


class HarnessError(Exception):
    """Bad input or environment: the message names the problem and the fix."""
