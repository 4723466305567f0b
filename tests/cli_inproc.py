"""The ``hybridsim`` command run inside the test process, for tests about what a command says and
writes rather than about the process: typer's CliRunner gives the same exit code, standard output
and standard error as ``python -m hybridsim`` would, without a fresh interpreter importing torch
again for every call (one to three seconds each on the CI machine).

Tests about the process itself (a reader that closes the pipe, ``/dev/stdout`` piped, signals,
worker processes, plugins found on another import path) keep spawning one (``test_cli.hs``).
"""

from __future__ import annotations

import os
import signal
import traceback
from dataclasses import dataclass
from pathlib import Path

from typer.testing import CliRunner

from .conftest import REPO


@dataclass
class Ran:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would have returned."""

    returncode: int
    stdout: str
    stderr: str


def hsi(*args, cwd: Path = REPO, env: dict | None = None) -> Ran:
    """``hybridsim ARGS`` run in ``cwd`` (with ``env`` added to the environment) inside this process.
    An exception the command lets out becomes what the interpreter would print, a traceback on
    standard error with exit 1, so that "exit 2, no traceback" assertions mean what they mean for a
    subprocess. What a command changes of the process (environment, working folder, the SIGINT and
    SIGTERM handlers a sweep installs) is put back, as a process's end would."""
    from hybridsim.cli import app

    # (the console's width as a subprocess with piped output gets it: COLUMNS, else 80)
    runner = CliRunner(env={"COLUMNS": os.environ.get("COLUMNS", "80"), **(env or {})})
    here, environ = os.getcwd(), dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    os.chdir(cwd)
    try:
        r = runner.invoke(app, [str(a) for a in args], prog_name="hybridsim")
    finally:
        os.chdir(here)
        for k in set(os.environ) - set(environ):
            del os.environ[k]
        os.environ.update(environ)
        for s, h in handlers.items():
            signal.signal(s, h)
    err = r.stderr
    code = r.exit_code
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        err += "".join(traceback.format_exception(type(r.exception), r.exception, r.exception.__traceback__))
        code = 1
    return Ran(code, r.stdout, err)
