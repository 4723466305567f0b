"""results.csv: one row per cell, appended as cells finish, never rewritten behind the user's back.

Rows are appended one whole line per write and flushed, so an interrupted sweep leaves every
finished cell's row; ``--resume`` reads them back (dropping a torn last line) and skips those
cells. An existing results.csv is only ever appended to, and only under ``--resume``.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any, Optional

import pandas as pd

from ..errors import EnvironmentProblem, InputError
from ..output_files import open_output, write_output

MEASURED = ["outcome", "exit_code", "steps", "requests", "finished", "checks_run", "checks_failed",
            "failed_checks", "first_divergence", "preemptions", "prefix_hit_tokens", "peak_blocks",
            "plan_s", "wall_s", "kernel_medians_us", "attempts", "error", "trace"]


_TEXT = {"cell", "outcome", "failed_checks", "first_divergence", "kernel_medians_us", "error", "trace"}


def columns(keys: list[str]) -> list[str]:
    """``cell``, the swept keys (dotted, as in the sweep file), ``seed``, then what was measured."""
    return ["cell", *keys, "seed", *MEASURED]


class ResultsFile:
    """Appends rows to DIR/results.csv; ``done`` holds the cells already in it (with ``resume``)."""

    def __init__(self, out_dir: Path, keys: list[str], resume: bool):
        self.path = out_dir / "results.csv"
        self.columns = columns(keys)
        self.done: dict[str, dict] = {}
        if self.path.exists():
            if not resume:
                raise InputError(f"{self.path} exists: pass --resume to skip its cells and add the rest, or "
                                 "choose another --out (nothing was written)", "--out")
            self._read_existing()
        elif out_dir.exists() and not out_dir.is_dir():
            raise InputError(f"{out_dir} exists and is not a folder", "--out")

    def _read_existing(self) -> None:
        text = self.path.read_text()
        if text and not text.endswith("\n"):  # a row torn by an interrupted write: drop it
            text = text[: text.rfind("\n") + 1]
            write_output(self.path, "--out", text)
        if not text.strip():
            self.path.unlink()
            return
        try:
            df = pd.read_csv(io.StringIO(text), dtype=str, keep_default_na=False)
        except (pd.errors.ParserError, ValueError) as e:
            raise InputError(f"cannot read it to resume ({str(e).splitlines()[0]}); nothing was written",
                             str(self.path)) from None
        if list(df.columns) != self.columns:
            raise InputError("its columns are another sweep's (other swept keys): --resume continues the same "
                             "sweep; choose another --out for this one (nothing was written)", str(self.path))
        self.done = {r["cell"]: r for r in df.to_dict("records")}

    def check_cells(self, labels: list[str]) -> None:
        """Resuming a sweep whose cells changed would mix two sweeps' rows in one file."""
        stray = [c for c in self.done if c not in set(labels)]
        if stray:
            raise InputError(f"it holds cell {stray[0]}, which this sweep does not have"
                             + (f" (and {len(stray) - 1} more)" if len(stray) > 1 else "")
                             + ": choose another --out (nothing was written)", str(self.path))

    def append(self, row: dict[str, Any]) -> None:
        """One row, one write; the header first if the file is new."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists()
        line = pd.DataFrame([row], columns=self.columns).to_csv(index=False, header=new, lineterminator="\n")
        try:
            with open(self.path, "a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # (a full disk: the rows before this one are whole)
            raise EnvironmentProblem(f"cannot write {self.path} (--out): {e.strerror}; its earlier rows are "
                                     "intact") from None

    def frame(self) -> pd.DataFrame:
        """Every row so far: numbers as numbers (missing: NaN), texts as texts (missing: empty)."""
        if not self.path.exists():
            return pd.DataFrame(columns=self.columns)
        df = pd.read_csv(self.path)
        for c in df.columns:
            if _is_text(df[c]) or df[c].isna().all() and c in _TEXT:
                df[c] = df[c].astype(object).where(df[c].notna(), "").astype(str)
        return df


def _is_text(col: pd.Series) -> bool:
    """Texts as pandas reads them: object columns (pandas 2) or its string dtype (pandas 3's default)."""
    return col.dtype == object or isinstance(col.dtype, pd.StringDtype)


PARQUET_SKIPPED = ("results.parquet not written: pandas needs pyarrow for parquet "
                   "(pip install 'hybridsim[parquet]'); results.csv has every row")


def write_parquet(df: pd.DataFrame, out_dir: Path) -> Optional[str]:
    """DIR/results.parquet: the rows of results.csv (``df``, as ``ResultsFile.frame`` reads them), written
    whole each time (a temporary file renamed over it). Without a parquet engine, returns a note instead,
    and removes a results.parquet left by an earlier run (under --resume it would hold fewer rows than
    results.csv)."""
    path = out_dir / "results.parquet"
    try:
        with open_output(path, "--out", binary=True) as f:
            df.astype({c: str for c in df.columns if _is_text(df[c])}).to_parquet(f, index=False)
    except ImportError:
        if path.exists():
            path.unlink()
            return PARQUET_SKIPPED + " (the earlier results.parquet, now out of date, was removed)"
        return PARQUET_SKIPPED
    return None
