"""Machine-readable exports (CSV through pandas) and the step-timeline plot (matplotlib)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from .checks import Checks
from .errors import EnvironmentProblem
from .output_files import make_folder, open_output


def steps_frame(records) -> pd.DataFrame:
    return pd.DataFrame([r.__dict__ for r in records])


def checks_frame(checks: Checks) -> pd.DataFrame:
    rows = []
    for t in checks.tallies.values():
        ff = t.first_failure
        rows.append({"check": t.name, "count": t.count, "failures": t.failures, "max_abs_err": t.max_abs_err,
                     "max_rel_err": t.max_rel_err, "first_failure_step": ff.step if ff else None,
                     "first_failure_request": ff.request if ff else None,
                     "first_failure": ff.message if ff else None})
    return pd.DataFrame(rows, columns=["check", "count", "failures", "max_abs_err", "max_rel_err",
                                       "first_failure_step", "first_failure_request", "first_failure"])


def write_csv(folder: Path, records, checks: Checks, flag: str = "--csv") -> list[Path]:
    """steps.csv and checks.csv, each written safely (output_files: a link followed, a pipe streamed)."""
    make_folder(folder, flag)
    out = [folder / "steps.csv", folder / "checks.csv"]
    for path, frame in zip(out, (steps_frame(records), checks_frame(checks))):
        with open_output(path, flag) as f:
            frame.to_csv(f, index=False)
    return out


def plot_timeline(records, path: Path, title: str, flag: str = "--plot") -> None:
    """Four stacked panels sharing the step axis: tokens (prefill vs decode), requests
    (running vs waiting), blocks in use, and state copies with step time."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is a dependency
        raise EnvironmentProblem(f"--plot needs matplotlib ({e})") from None
    df = steps_frame(records)
    fig, ax = plt.subplots(4, 1, figsize=(11, 9), sharex=True, constrained_layout=True)
    x = df["step"]
    ax[0].bar(x, df["prefill_tokens"], width=1.0, color="#4C72B0", label="prefill tokens")
    ax[0].bar(x, df["decode_tokens"], width=1.0, bottom=df["prefill_tokens"], color="#DD8452", label="decode tokens")
    ax[0].set_ylabel("tokens / step")
    ax[0].legend(loc="upper right", frameon=False, ncol=2)
    ax[1].plot(x, df["running"], color="#55A868", label="running")
    ax[1].plot(x, df["waiting"], color="#C44E52", label="waiting")
    pre = df[df["preempted"] > 0]
    if len(pre):
        ax[1].scatter(pre["step"], pre["running"], marker="v", color="black", s=18, zorder=3, label="preemption")
    ax[1].set_ylabel("requests")
    ax[1].legend(loc="upper right", frameon=False, ncol=3)
    ax[2].fill_between(x, df["blocks_in_use"], step="mid", color="#8172B3", alpha=0.6)
    ax[2].set_ylabel("blocks in use")
    copies = df["state_copies"]
    none = not copies.any()  # (a plan-only run executes no copies)
    ax[3].bar(x, copies, width=1.0, color="#937860", label="state copies (none)" if none else "state copies")
    ax[3].set_ylabel("state copies")
    ax[3].set_ylim(0, 1 if none else None)  # counts: never below zero, even when all are zero
    ax[3].set_xlabel("step")
    t2 = ax[3].twinx()
    t2.plot(x, df["step_ms"], color="#222222", linewidth=0.8, label="step time")
    t2.set_ylim(bottom=0)
    t2.set_ylabel("step time (ms)")
    h1, l1 = ax[3].get_legend_handles_labels()
    h2, l2 = t2.get_legend_handles_labels()
    ax[3].legend(h1 + h2, l1 + l2, loc="upper right", frameon=False, ncol=2)
    for a in ax:
        a.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    kind = Path(path).suffix.lstrip(".").lower()  # (the format the name asks for; PNG for "-" or no suffix)
    kind = kind if kind in fig.canvas.get_supported_filetypes() else "png"
    try:
        with open_output(path, flag, binary=True) as f:
            fig.savefig(f, dpi=110, format=kind)
    finally:
        plt.close(fig)
