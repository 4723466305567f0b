"""Error types that the CLI turns into one clear message and an exit code.

Library code raises these; only the CLI decides how they are printed. Every bad
input (scenario, trace, flag) is an ``InputError`` (exit 2); a missing device or
package is an ``EnvironmentProblem`` (exit 3).
"""

from __future__ import annotations


class InputError(Exception):
    """Bad user input. ``where`` names the file and line or key path."""

    exit_code = 2

    def __init__(self, message: str, where: str | None = None):
        super().__init__(message)
        self.message = message
        self.where = where

    def __str__(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message


def not_json(e, where: str) -> InputError:
    """A JSON decoding error as an InputError; some decoder messages end in "at"
    ("Unterminated string starting at"), so the column follows them once."""
    what = e.msg[:-3] if e.msg.endswith(" at") else e.msg
    return InputError(f"not valid JSON ({what} at column {e.colno})", where)


def read_text(path) -> str:
    """A whole input file as text; a file that cannot be read, or is not UTF-8 text (a binary
    file), is one InputError naming it."""
    try:
        return path.read_text()
    except UnicodeDecodeError as e:
        raise not_text(e, str(path)) from None
    except OSError as e:
        raise InputError(f"cannot read: {e.strerror}", str(path)) from None


def not_text(e: UnicodeDecodeError, where: str, after: str = "") -> InputError:
    return InputError(f"not a UTF-8 text file ({e.reason}){after}", where)


class EnvironmentProblem(Exception):
    """The machine cannot do what was asked (e.g. ``--device cuda`` without a GPU)."""

    exit_code = 3
