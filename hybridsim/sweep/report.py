"""The end-of-sweep tables (Rich), each within 80 columns: cell labels fold, counts never wrap."""

from __future__ import annotations

import pandas as pd
from rich.markup import escape
from rich.table import Table

_STYLE = {"pass": "green", "FAIL": "red"}


def outcome_table(df: pd.DataFrame, title: str) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("outcome", no_wrap=True)
    t.add_column("cells", justify="right", no_wrap=True)
    t.add_column("exit code", justify="right", no_wrap=True)
    t.add_column("checks run", justify="right", no_wrap=True)
    t.add_column("failed", justify="right", no_wrap=True)
    for outcome, g in df.groupby("outcome", sort=False):
        style = _STYLE.get(outcome, "yellow")
        t.add_row(f"[{style}]{escape(str(outcome))}[/{style}]", f"{len(g):,}", str(int(g["exit_code"].max())),
                  f"{int(pd.to_numeric(g['checks_run'], errors='coerce').fillna(0).sum()):,}",
                  f"{int(pd.to_numeric(g['checks_failed'], errors='coerce').fillna(0).sum()):,}")
    return t


def slowest_table(df: pd.DataFrame, n: int = 5) -> Table:
    t = Table(title=f"slowest cells (of {len(df)})", title_justify="left")
    t.add_column("cell", overflow="fold")
    for col in ("wall s", "steps", "plan s"):
        t.add_column(col, justify="right", no_wrap=True)
    wall = pd.to_numeric(df["wall_s"], errors="coerce").fillna(0.0)
    for i in wall.sort_values(ascending=False).index[:n]:
        r = df.loc[i]
        t.add_row(escape(str(r["cell"])), f"{wall[i]:.2f}", str(r["steps"]), str(r["plan_s"]))
    return t


def failing_table(df: pd.DataFrame, n: int = 20) -> Table | None:
    bad = df[df["exit_code"].astype(int) != 0]
    if bad.empty:
        return None
    t = Table(title=f"failing cells ({len(bad)})", title_justify="left")
    t.add_column("cell", overflow="fold", ratio=1)
    t.add_column("exit", justify="right", no_wrap=True)
    t.add_column("first divergence / error", overflow="fold", ratio=1)
    for _, r in bad.head(n).iterrows():
        what = r["first_divergence"] or r["error"] or r["outcome"]
        if r["trace"]:
            what = f"{what} (trace: {r['trace']})"
        t.add_row(escape(str(r["cell"])), str(r["exit_code"]), escape(str(what)))
    if len(bad) > n:
        t.caption = f"(+{len(bad) - n} more in results.csv)"
    return t
