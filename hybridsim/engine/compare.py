"""Attention outputs against the oracle's: the tolerance per cache dtype and the tally of a
step's comparisons, one for every attention kind (GQA, MLA)."""

from __future__ import annotations

from ..checks import CheckTally, Failure
from ..sched.plan import StepPlan

TOLERANCE = {"float32": 1e-5, "float64": 1e-9, "bfloat16": 2e-2, "float16": 5e-3}


def error_pairs(triples: list[float]) -> list[tuple[float, float]]:
    """``rel_errors`` results read back flat (abs, rel, non-finite, ...) as (abs, rel) pairs, a
    non-finite output (NaN or inf where the reference has none) counting as inf."""
    inf = float("inf")
    return [(a, rel) if not bad else (inf, inf) for a, rel, bad in zip(triples[0::3], triples[1::3], triples[2::3])]


def tally_outputs(tally: CheckTally, plan: StepPlan, rows: list[int], committed: list[int],
                  errs: list[tuple[float, float]], layers: int, tol: float, layer_name: str) -> None:
    """One comparison per (row, layer), row-major in ``errs``; a passing one counts the row's
    committed tokens."""
    for j, i in enumerate(rows):
        s = plan.scheduled[i]
        for layer in range(layers):
            a, rel = errs[j * layers + layer]
            tally.max_abs_err = max(tally.max_abs_err, a)
            tally.max_rel_err = max(tally.max_rel_err, rel)
            if rel <= tol:
                tally.passed(committed[i])
            else:
                tally.failed(Failure(plan.step, s.req_id, f"attention output off by rel {rel:.2e} "
                                                          f"(tolerance {tol:g})", layer=f"{layer_name}{layer}",
                                     position=s.num_computed_tokens, max_abs_err=a, max_rel_err=rel))
