"""What ``hybridsim kernels`` and ``hybridsim kernels check`` print: the providers and whose code each
op runs, and a provider's ops against the reference (``kernels/provider_check.py``)."""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext

from rich.console import Console
from rich.table import Table

from .errors import EnvironmentProblem, InputError


def _load(name: str):
    from .kernel_registry import get_kernels, providers

    if name not in providers():
        raise InputError(f"no kernel provider {name!r}; `hybridsim kernels` lists them "
                         f"({', '.join(providers())})", "PROVIDER")
    try:
        return get_kernels(name)
    except ImportError as e:
        raise EnvironmentProblem(f"kernel provider {name}: {e}") from None


def providers_table() -> Table:
    """One row per (provider, op): which code runs it here. A provider that cannot load here says why."""
    from .kernel_registry import OPS, op_sources, providers

    t = Table(title="kernel providers", caption="plugins register in the entry-point group hybridsim.kernels; "
                                                "`hybridsim kernels check NAME` holds one to the reference")
    t.add_column("provider")
    t.add_column("from")
    t.add_column("op")
    t.add_column("runs")
    for name, p in providers().items():
        try:
            import os

            if name in ("triton", "vllm"):
                import torch

                if not torch.cuda.is_available():
                    os.environ.setdefault("TRITON_INTERPRET", "1")
            k = p.load()()
        except ImportError as e:
            t.add_row(name, p.origin, "-", f"[yellow]not available here: {e}[/]")
            continue
        for i, (op, src) in enumerate(op_sources(k).items()):
            t.add_row(name if i == 0 else "", p.origin if i == 0 else "", op, src)
        t.add_section()
    return t


def check_provider(name: str, device: str, only: tuple[str, ...], quick: bool, seed: int, out: Console) -> int:
    import torch

    from .execute import resolve_device
    from .kernel_registry import OPS, op_sources
    from .kernels.provider_check import Checker

    bad = [op for op in only if op not in OPS]
    if bad:
        raise InputError(f"no op {bad[0]!r}; the ops: {', '.join(OPS)}", "--op")
    dev = torch.device(resolve_device(device))
    if dev.type != "cuda":
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
    k = _load(name)
    k.poison = True  # outputs NaN-filled before each launch: an element never written fails
    if dev.type != "cuda" and not quick:  # (Triton providers' kernels under the interpreter: minutes)
        out.print(f"checking {name} on the CPU: a few minutes where its kernels run under Triton's interpreter "
                  "(--quick: smaller batches, seconds)", highlight=False)
    status = out.status("") if out.is_terminal else None
    progress = None
    if status is not None:
        def progress(op: str, cases: int, last: str) -> None:
            status.update(f"{op}: {cases} case{'s' if cases > 1 else ''} checked (last: {last})")
    checker = Checker(k, dev, quick, seed, on_case=progress)
    t0 = time.perf_counter()
    t = Table(title=f"kernels check {name} on {torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}"
                    + (" (Triton interpreter: small sizes)" if dev.type != "cuda" else ""))
    for col in ("op", "runs", "cases", "worst", "verdict"):
        t.add_column(col, justify="right" if col in ("cases", "worst") else "left")
    if dev.type == "cuda":
        t.add_column("median time (after a warm-up call)", justify="right")
    failed = 0
    with status if status is not None else nullcontext():
        results = list(checker.run(only))
    t.caption = (f"exact ops: worst = elements that differ; others: worst relative error (inf: NaN/inf positions "
                 f"differ); {time.perf_counter() - t0:,.1f} s in all")
    for r in results:
        failed += r.failed
        worst = f"{int(r.worst):,}" if r.exact and r.worst != float("inf") else f"{r.worst:.2e}"
        verdict = "[green]pass[/]" if r.verdict == "pass" else f"[red]fail[/]: {r.first_failure}"
        row = [r.op, op_sources(k).get(r.op, ""),  # (after the op ran: a binding may have fallen back)
               str(r.cases), worst, verdict]
        if dev.type == "cuda":
            row.append(f"{statistics.median(r.seconds) * 1e6:,.1f} µs" if r.seconds else "-")
        t.add_row(*row)
    out.print(t)
    if getattr(k, "stand_in", None):
        out.print(f"note: {k.stand_in}", highlight=False)
    return 1 if failed else 0
