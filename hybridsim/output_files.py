"""Files the user names for results (``--json``, ``--record``, ``--plot``, ``--csv``, ``--out``,
``--junit``): written so that nothing they point at is damaged.

What a path is decides how it is written:

- a regular file, or nothing yet: through a temporary file beside it (``NAME.partial``), flushed to
  disk and renamed onto it, so an interrupted or failed write leaves the earlier file whole;
- a symlink: followed; its target is written as above (the link stays a link);
- anything else that is not a folder (a named pipe, a character device such as ``/dev/full`` or a
  terminal): opened and written directly, streamed, never renamed over;
- ``-``, or a path that is this process's standard output (``/dev/stdout`` when it is a pipe or
  a file): standard output itself.

Exit codes: a path that cannot be written when the command starts (its folder is missing or cannot
be made, it is a folder, it lies under a file, its folder refuses new files) is bad input, exit 2,
found before any work; a write that fails afterwards (a full disk, an I/O error, a device that
refuses data) is an environment problem, exit 3, naming the file.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterable, Iterator, Optional

from .errors import EnvironmentProblem, InputError

STDOUT = "-"
_FILE, _STREAM, _STDOUT = "file", "stream", "stdout"


def _same_as_stdout(st: os.stat_result) -> bool:
    """Is this (a pipe or a regular file) what standard output already writes to? Character
    devices (a terminal, /dev/null) are written directly either way."""
    if stat.S_ISCHR(st.st_mode):
        return False
    try:
        out = os.fstat(sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # (no real descriptor: an embedding host)
        return False
    return (out.st_dev, out.st_ino) == (st.st_dev, st.st_ino)


def _no_folder(folder: Path, flag: str) -> InputError:
    if folder.exists():
        return InputError(f"{folder} is not a folder", flag)
    return InputError(f"folder {folder} does not exist", flag)


def resolve(path: str | Path, flag: str) -> tuple[str, Path]:
    """How ``path`` is written (file, stream, stdout) and where: a symlink's final target for
    files. Bad paths are an InputError naming the flag."""
    if str(path) == STDOUT:
        return _STDOUT, Path(STDOUT)
    p = Path(path)
    try:
        st: Optional[os.stat_result] = os.stat(p)
    except FileNotFoundError:
        st = None
    except NotADirectoryError:
        raise InputError(f"cannot write {p}: a part of the path is a file, not a folder", flag) from None
    except OSError as e:
        raise InputError(f"cannot write {p}: {e.strerror}", flag) from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise InputError(f"{p} is a folder", flag)
        if _same_as_stdout(st):
            return _STDOUT, p
        if not stat.S_ISREG(st.st_mode):
            return _STREAM, p
    target = Path(os.path.realpath(p))  # (a symlink, dangling too: its target)
    if not target.parent.is_dir():
        raise _no_folder(target.parent if p.is_symlink() else (p.parent if str(p.parent) else Path(".")), flag)
    return _FILE, target


def _partial(target: Path) -> Path:
    return target.with_name(target.name + ".partial")


def _create(tmp: Path) -> int:
    """A fresh temporary file (a stale one from an interrupted run replaced; never followed
    if it is a link)."""
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)


def check_writable(path: Optional[str | Path], flag: str) -> None:
    """Before any work: refuse (exit 2) a path that cannot be written. A regular file's folder
    is tried for real (a temporary file made and removed: permissions, read-only mounts and
    root's privileges all answer as they will); pipes and devices are not opened (a pipe would
    wait for its reader)."""
    if path is None:
        return
    kind, target = resolve(path, flag)
    if kind == _STREAM and not os.access(target, os.W_OK):
        raise InputError(f"cannot write {path}: permission denied", flag)
    if kind != _FILE:
        return
    tmp = _partial(target)
    try:
        os.close(_create(tmp))
        tmp.unlink()
    except OSError as e:
        raise InputError(f"cannot write into folder {target.parent}: {e.strerror}", flag) from None


def make_folder(folder: Path, flag: str) -> None:
    """A folder for several outputs (``--csv``, ``sweep --out``): made with its parents, or one
    message (exit 2) naming what stands in the way."""
    if str(folder) == STDOUT:
        raise InputError("takes a folder (it writes several files), so it cannot be standard output (-)", flag)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise InputError(f"{folder} exists and is not a folder", flag) from None
    except OSError as e:
        raise InputError(f"cannot make folder {folder}: {e.strerror}", flag) from None
    if not folder.is_dir():
        raise InputError(f"{folder} exists and is not a folder", flag)


def check_folder(folder: Optional[Path], flag: str) -> None:
    """Before any work: refuse (exit 2) a folder for outputs that cannot be made or written into,
    without making it yet (a run refused later for another reason leaves nothing behind). The
    nearest folder that exists is tried for real (a temporary folder made and removed)."""
    if folder is None:
        return
    if str(folder) == STDOUT:
        raise InputError("takes a folder (it writes several files), so it cannot be standard output (-)", flag)
    probe = Path(os.path.abspath(folder))
    while not probe.exists() and probe.parent != probe:
        if probe.is_symlink():  # (a dangling link: its target's folder is the one to make)
            raise InputError(f"{folder} is a link to nothing", flag)
        probe = probe.parent
    if not probe.is_dir():
        raise InputError(f"{probe} exists and is not a folder" if probe == Path(os.path.abspath(folder))
                         else f"cannot make folder {folder}: {probe} is a file", flag)
    trial = probe / f".hybridsim-probe-{os.getpid()}"
    try:
        trial.mkdir()
        trial.rmdir()
    except OSError as e:
        what = "write into folder" if probe == Path(os.path.abspath(folder)) else "make folder"
        raise InputError(f"cannot {what} {folder}: {e.strerror}", flag) from None


class Output:
    """One output being written (see the module docstring): ``open``, ``write`` any number of
    times, then ``commit`` (or ``abort``: the earlier file stays as it was)."""

    def __init__(self, path: str | Path, flag: str, binary: bool = False):
        self.name = str(path)
        self.flag = flag
        self.binary = binary
        self.kind, self.target = resolve(path, flag)
        self.tmp: Optional[Path] = None
        self.f: Optional[IO] = None

    def open(self) -> IO:
        if self.kind == _STDOUT:
            sys.stdout.flush()
            self.f = sys.stdout.buffer if self.binary else sys.stdout
            return self.f
        try:
            if self.kind == _STREAM:
                fd = os.open(self.target, os.O_WRONLY | os.O_CLOEXEC)
            else:
                self.tmp = _partial(self.target)
                fd = _create(self.tmp)
                self._keep_mode(fd)
        except OSError as e:
            raise InputError(f"cannot write {self.name}: {e.strerror}", self.flag) from None
        self.f = os.fdopen(fd, "wb") if self.binary else os.fdopen(fd, "w", encoding="utf-8")
        return self.f

    def _keep_mode(self, fd: int) -> None:
        """A file written again keeps its permissions."""
        try:
            os.fchmod(fd, stat.S_IMODE(os.stat(self.target).st_mode))
        except OSError:
            pass

    def write(self, data) -> None:
        assert self.f is not None
        try:
            self.f.write(data)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise self.failed(e) from None

    def commit(self) -> None:
        f = self.f
        if f is None:
            return
        try:
            f.flush()
            if self.kind == _FILE:
                os.fsync(f.fileno())
            if self.kind != _STDOUT:
                self.f = None
                f.close()
            if self.tmp is not None:
                os.replace(self.tmp, self.target)
                self.tmp = None
        except BrokenPipeError:
            raise
        except OSError as e:
            raise self.failed(e) from None

    def abort(self) -> None:
        f, self.f = self.f, None
        if f is not None and self.kind != _STDOUT:
            try:
                f.close()
            except OSError:
                pass
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None

    def failed(self, e: OSError) -> EnvironmentProblem:
        """A write that failed: the temporary file removed, one message naming the file (exit 3)."""
        self.abort()
        why = e.strerror or str(e)
        if e.errno == errno.ENOSPC:
            why = "no space left on the device"
        kept = ""
        if self.kind == _FILE:
            kept = "; the file there is unchanged" if self.target.exists() else "; nothing was left there"
        return EnvironmentProblem(f"cannot write {self.name} ({self.flag}): {why}{kept}")


@contextmanager
def open_output(path: str | Path, flag: str, binary: bool = False) -> Iterator[IO]:
    """``with open_output(p, "--json") as f: f.write(...)``: committed when the block ends; an
    exception inside it leaves the earlier file untouched (an OSError from writing becomes
    exit 3 naming the file)."""
    out = Output(path, flag, binary)
    f = out.open()
    try:
        yield f
    except BrokenPipeError:
        out.abort()
        raise
    except OSError as e:
        raise out.failed(e) from None
    except BaseException:
        out.abort()
        raise
    out.commit()


def write_output(path: str | Path, flag: str, data: str | bytes) -> None:
    """A whole output at once."""
    with open_output(path, flag, binary=isinstance(data, bytes)) as f:
        f.write(data)


def to_stdout(path: Optional[str | Path]) -> bool:
    """Does this output go to standard output (so tables must not)?"""
    if path is None:
        return False
    if str(path) == STDOUT:
        return True
    try:
        st = os.stat(path)
    except OSError:
        return False
    return not stat.S_ISDIR(st.st_mode) and _same_as_stdout(st)


def _file_key(path: Optional[str | Path]) -> Optional[tuple]:
    """What identifies the regular file ``path`` writes or reads: its device and inode when it exists
    (hard links and symlinks to it alike), else its resolved path; None where two names for it may
    share it harmlessly (standard output, a device, a pipe) or for no path."""
    if path is None or str(path) == STDOUT:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return ("path", os.path.realpath(path))
    if not stat.S_ISREG(st.st_mode):
        return None
    return ("inode", st.st_dev, st.st_ino)


def check_distinct(outputs: Iterable[tuple[Optional[Path], str]],
                   reads: Iterable[tuple[Optional[Path], str]] = ()) -> None:
    """Refuse, before any work, two outputs that are one file (one would overwrite the other: ``--record``
    and ``--json`` onto one path lost the trace) or an output that is a file the command reads (``run
    s.yaml --json s.yaml`` replaced the scenario with its results)."""
    read: dict[tuple, str] = {}  # file -> what it is to the command
    for path, what in reads:
        key = _file_key(path)
        if key is not None:
            read.setdefault(key, what)
    written: dict[tuple, str] = {}  # file -> the flag that writes it
    for path, flag in outputs:
        key = _file_key(path)
        if key is None:
            continue
        if key in read:
            raise InputError(f"{path} is {read[key]}, which this command reads: writing it would destroy it", flag)
        if key in written:
            raise InputError(f"{path} is {written[key]}'s file too: one would overwrite the other", flag)
        written[key] = flag
