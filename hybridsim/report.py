"""Rich tables for runs, checks, timings, presets and fidelity reports.

Every table fits an 80-column terminal without breaking a name (check, trace, preset, kernel,
bug, phase): name columns never wrap, and the free-text columns (first failure, differences)
wrap at spaces and absorb the narrowing (``tests/test_report_width.py``).
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .fidelity import FidelityReport
from .model import ModelGeometry
from .runner import RunResult


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)  # pragma: no cover


def _compact(x: float, decimals: int) -> str:
    """``x`` with thousands separators, its decimals dropped from 1,000 up (narrow table columns)."""
    return f"{x:,.{decimals if abs(x) < 1000 else 0}f}"


def summary_table(res: RunResult) -> Table:
    st = res.stats
    t = Table(title=f"run summary — {res.scenario_name}", show_header=False, title_justify="left")
    t.add_column("what", style="bold", no_wrap=True)
    t.add_column("value", justify="right", overflow="fold")
    rows = [
        ("steps", f"{st.steps:,}"),
        ("requests (finished)", f"{st.requests:,} ({st.finished:,})"),
        ("prompt tokens", f"{st.prompt_tokens:,}"),
        ("output tokens", f"{st.output_tokens:,}"),
        ("scheduled tokens (prefill / decode)", f"{st.scheduled_tokens:,} ({st.prefill_tokens:,} / {st.decode_tokens:,})"),
        ("preemptions (scheduler / forced)", f"{st.preemptions:,} / {st.forced_preemptions:,}"),
        ("prefix hit tokens (rate)", f"{st.prefix_hit_tokens:,} ({100 * st.hit_rate:.1f}% of prompt tokens)"),
        *([("prefix hits with whole-block units", _whole_block_hits(st, res.whole_block_hit_tokens))]
          if res.whole_block_hit_tokens is not None else []),
        ("drafts scheduled / accepted", f"{st.drafts_scheduled:,} / {st.drafts_accepted:,}"
                                        + (f" ({100 * st.acceptance_rate:.1f}%)" if st.drafts_scheduled else "")),
        *([("admissions padded with placeholder drafts", f"{st.padded_rows:,}")] if st.padded_rows else []),
        ("peak blocks in use", f"{st.peak_blocks_in_use:,}"),
        ("cached blocks evicted", f"{st.evictions:,}"),
    ]
    rate = f"{res.wall_s:.3f} s ({st.steps / res.wall_s:,.0f} steps/s)" if res.wall_s else "-"
    if res.executed:  # the loop also executed and checked every step: say so, and give planning alone
        plan_s = res.schedule_s + res.update_s
        rows.append(("wall time (plan + execute + check)", rate))
        rows.append(("of which planning (schedule + update)", f"{plan_s:.3f} s"))
        if res.memory is not None:
            peak = res.memory.get("peak_bytes")
            rows.append(("device memory: planned / peak", f"{res.memory['total_bytes'] / 2**30:,.2f} GiB / "
                         + (f"{peak / 2**30:,.2f} GiB" if peak is not None else "-")))
    else:
        rows.append(("planning wall time", rate))
    if res.trace_path is not None:
        rows.append(("trace written", str(res.trace_path)))
    if res.planner:
        rows.insert(0, ("plan", res.planner))
    for k, v in rows:
        t.add_row(k, v)
    return t


def _whole_block_hits(st, whole: int) -> str:
    """The same workload planned with the unit equal to the block (``units.py``), beside this run."""
    rate = 100 * whole / st.prefix_queries if st.prefix_queries else 0.0
    return f"{whole:,} ({rate:.1f}%; the same workload planned with unit = block)"


def checks_table(res: RunResult) -> Table:
    t = Table(title="checks", title_justify="left")
    _checks_rows(t, res.checks)
    _divergence_caption(t, res.checks)
    return t


def _divergence_caption(t: Table, checks) -> None:
    if checks.divergence:
        first = sorted(checks.divergence.items(), key=lambda kv: kv[1])[:6]
        more = len(checks.divergence) - len(first)
        t.caption = "first divergence: " + ", ".join(f"{r} at step {s}" for r, s in first) + \
            (f" (+{more} more requests)" if more > 0 else "")


def _checks_rows(t: Table, checks) -> None:
    t.add_column("check", no_wrap=True)
    for col in ("count", "failures", "worst error"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("first failure", overflow="fold")  # (wraps at spaces; folds only a word wider than it)
    for tally in checks.tallies.values():
        ff = tally.first_failure
        first = "-" if ff is None else (f"step {ff.step}" + (f", {ff.request}" if ff.request else "")
                                        + (f", {ff.layer}" if ff.layer else "")
                                        + (f", pos {ff.position}" if ff.position is not None else "")
                                        + f": {ff.message}")
        style = "red" if tally.failures else "green"
        worst = f"{tally.max_rel_err:.1e}" if tally.max_rel_err else ("0 (exact)" if tally.count else "-")
        t.add_row(tally.name, f"{tally.count:,}", f"[{style}]{tally.failures:,}[/{style}]", worst, first)


def golden_table(rows, updated: bool) -> Table:
    """One row per trace; what differed (or changed, with ``updated``) is listed under the table, one
    line per difference and trace, so that neither the names nor the differences are squeezed."""
    t = Table(title="golden traces" + (" (expected files rewritten)" if updated else ""), title_justify="left",
              caption_justify="left", caption_style="none")
    t.add_column("trace", no_wrap=True)
    for col in ("steps", "comparisons"):
        t.add_column(col, justify="right", no_wrap=True)
    t.add_column("result", no_wrap=True)
    lines = []
    for r in rows:
        style = {"pass": "green", "unchanged": "green", "updated": "yellow"}.get(r.result, "red")
        t.add_row(r.trace, f"{r.steps:,}", f"{r.comparisons:,}", f"[{style}]{r.result}[/{style}]")
        shown = r.differences[:8]
        lines += [f"[bold]{escape(r.trace)}[/]: {escape(d)}" for d in shown]
        if len(r.differences) > len(shown):
            lines.append(f"[bold]{escape(r.trace)}[/]: (+{len(r.differences) - len(shown)} more)")
    if lines:
        t.caption = ("changed" if updated else "what differed") + ":\n" + "\n".join(lines)
    return t


def replay_table(res) -> Table:
    t = Table(title=f"replay — {res.path} ({res.steps} steps, {res.requests} requests, {res.wall_s:.2f} s)",
              title_justify="left")
    _checks_rows(t, res.checks)
    _divergence_caption(t, res.checks)
    return t


def timings_table(res: RunResult) -> Table:
    """Host time of each phase; on a GPU, beside it, each executor phase's device time a step and its share of
    the phases' device total (``device/clock.py``), the oracle phases' share in the caption."""
    dev = {d["phase"]: d["total_s"] for d in res.device_timings} if res.device_timings is not None else None
    t = Table(title="host timings" if dev is None else "timings: host, and on the device", title_justify="left")
    cols = ("phase", "total", "per step") + (("device / step", "share") if dev is not None else ())
    for col in cols:
        t.add_column(col, justify="left" if col == "phase" else "right", no_wrap=True)
    steps = max(res.stats.steps, 1)
    rows = [("schedule", res.schedule_s, None), ("update", res.update_s, None)]
    rows += [(f"execute: {d['phase']}", d["total_s"], d["phase"]) for d in res.timings]
    rows.append(("whole loop", res.wall_s, None))
    dev_total = sum(dev.values()) if dev else 0.0
    for name, total, phase in rows:
        cells = [name, f"{total * 1e3:,.1f} ms", f"{total / steps * 1e6:,.1f} µs"]
        if dev is not None:
            d = dev.get(phase) if phase is not None else (dev_total if name == "whole loop" else None)
            cells += ["" if d is None else f"{d / steps * 1e6:,.1f} µs",
                      "" if d is None or not dev_total else f"{100 * d / dev_total:.1f}%"]
        t.add_row(*cells)
    notes = []
    if dev is not None:
        share, checking = res.oracle_device_share, res.checking_device_share
        notes.append("device: CUDA events on the run's stream where each phase starts and ends (a phase's time "
                     "includes the device waiting for its launches); the whole loop's: the phases' sum"
                     + (f"; the oracles ({', '.join(p for p in dev if p in res.oracle_phases)}) "
                        f"{100 * share:.1f}% of it" if share is not None else "")
                     + (f", checking in all ({', '.join(p for p in dev if p in res.check_phases)}) "
                        f"{100 * checking:.1f}%, the system's own work the rest" if checking is not None else "")
                     + (f" (the oracles {res.oracle_per_system_work:.2f}× it)"
                        if res.oracle_per_system_work is not None else ""))
    if res.kernel_builds:
        notes.append(builds_caption(res.kernel_builds, res.kernel_compiles))
    if notes:
        t.caption = "; ".join(notes)
    return t


def builds_caption(builds: dict[str, int], compiles: int | None = None) -> str:
    """What the whole loop's time includes besides the run's work: kernels Triton built inside it
    (``device/builds.py``), and how many of its cache's entries it compiled rather than loaded."""
    n = sum(builds.values())
    names = ", ".join(f"{k} ({v})" if v > 1 else k for k, v in builds.items())
    how = ("Triton compiles a kernel the first time a launch needs it, or loads it from its cache on a later run"
           if compiles is None else
           f"{compiles:,} new entries compiled into Triton's cache (variants and their launchers), the rest loaded "
           f"from it" if compiles else "every one loaded from Triton's cache, none compiled")
    return f"the whole loop includes building {n:,} kernel variant{'s' * (n != 1)} ({how}): {names}"


def _pct_of_floor(r: dict) -> str:
    """The % of a kernel's floor; above 100 is printed as it is and flagged: the floor is wrong."""
    pct = r["pct_floor"]
    return f"{pct:.1f}%!" if pct > 100 else f"{pct:.1f}%"


_BOUND = {"bandwidth": "memory", "compute": "compute", "bandwidth+compute": "both", "": ""}


def _short_source(src: str) -> str:
    """'vLLM 0.33.0' for an engine binding, 'hybridsim' for our own op (the run's notes give each in full)."""
    return src.split(":")[0] if src.startswith("vLLM") else ("hybridsim" if src else "")


def kernel_timings_table(kt: dict) -> Table:
    """Per-kernel GPU time from CUDA events around each provider call (launch gaps included),
    against each kernel's floor from the device's measured read, copy and matmul rates."""
    ws = kt.get("write_side_TBps")
    t = Table(title=f"kernel timings — {kt['device']}; measured: read {kt['read_ceiling_TBps']:.2f}, "
                    f"copy {kt['copy_ceiling_TBps']:.2f}, write side "
                    f"{'unbounded' if ws is None else f'{ws:.2f}'} TB/s; bf16 {kt['matmul_TFLOPs']:.0f} TFLOP/s",
              title_justify="left",
              caption="time = GPU time of each call's kernels (CUDA events; the host finishes launching "
                      "while the GPU spins before the start event); not timed = calls left out: after a "
                      "kernel's first 8 calls only every 16th is timed, and a call whose launch outlasted the spin "
                      "(e.g. a first call that compiles) is dropped; bytes = read + written by the timed calls; "
                      "floor = the least time the timed calls could take, per call the larger of bytes "
                      "read / read rate + bytes written / write side (derived from copy and read) and "
                      "FLOPs / matmul rate; bound = which one set it (memory: bandwidth, compute, both: some calls "
                      "each); % = floor / time; ! = above 100%, so the floor is wrong")
    t.add_column("kernel", no_wrap=True)
    # (headers of short words and compact numbers: at 80 columns these wrap, the kernel names stay whole)
    # (GB/s is in the JSON: at 80 columns a figure of this table would be cut with it)
    for col in ("calls (not timed)", "total ms", "median / p90 µs", "bytes", "bound", "% of floor"):
        t.add_column(col, justify="right")
    runs = kt.get("runs", {})  # op -> whose code ran it (the provider's, or the engine's with --kernels vllm)
    mixed = any(src.startswith("vLLM") for src in runs.values())  # a column only where ops ran different code
    if mixed:
        t.add_column("runs")
    for r in kt["kernels"]:
        t.add_row(r["kernel"], f"{r['calls']:,} ({r['untimed']:,})", _compact(r["total_s"] * 1e3, 2),
                  f"{_compact(r['median_us'], 1)} / {_compact(r['p90_us'], 1)}", _human_bytes(r["bytes"]),
                  _BOUND[r["bound"]], _pct_of_floor(r), *([_short_source(runs.get(r["kernel"], ""))] if mixed else []))
    return t


def presets_table(rows: list[tuple[ModelGeometry, str]], num_spec: int = 0) -> Table:
    t = Table(title="model presets", title_justify="left",
              caption="layers M/A/MLA = Mamba / attention / MLA layers; "
                      "state = conv window + SSM state of every recurrent layer for one request; "
                      "KV = attention/MLA cache per token over all layers")
    t.add_column("preset", no_wrap=True)
    for col in ("layers M/A/MLA", "state per request", "state per layer", "KV per token"):
        t.add_column(col, justify="right")
    for geo, _ in rows:
        layers = "/".join(str(getattr(geo, k).layers) if getattr(geo, k) else "0" for k in ("mamba", "attention", "mla"))
        per_layer = _human_bytes(geo.mamba.state_bytes(num_spec)) if geo.mamba else "-"
        t.add_row(geo.name, layers, _human_bytes(geo.mamba_bytes_per_request(num_spec)) if geo.mamba else "-",
                  per_layer, _human_bytes(geo.attention_bytes_per_token()))
    return t


def fidelity_table(rep: FidelityReport) -> Table:
    t = Table(title=f"fidelity — {rep.recording}", title_justify="left")
    t.add_column("step", justify="right", no_wrap=True)
    t.add_column("differs in", no_wrap=True)
    for col in ("recorded (vLLM)", "ours"):
        t.add_column(col, overflow="fold")
    for d in rep.diffs[:20]:
        t.add_row(str(d.step), d.what, d.recorded, d.ours)
    for d in sorted(rep.block_diffs, key=lambda d: (d.what, d.step))[:20]:
        t.add_row(str(d.step), d.what, d.recorded, d.ours)
    if not rep.diffs and not rep.block_diffs:
        t.add_row("-", "no differences", "", "")
    by_group = ", ".join(f"group {g} {n}" for g, n in enumerate(rep.block_ids_equal_by_group))
    t.caption = (f"identical steps: {rep.identical_steps}/{max(rep.steps_recorded, rep.steps_ours)} "
                 f"({rep.identical_steps_pct:.2f}%); free-block counts equal on {rep.free_blocks_equal} steps; "
                 f"block ids equal on {rep.block_ids_equal} steps ({by_group})"
                 + (f"; block copies equal on {rep.block_copies_equal} steps" if rep.block_copies_equal is not None
                    else ""))
    return t


def print_tables(console: Console, *tables: Table) -> None:
    for t in tables:
        console.print(t)
