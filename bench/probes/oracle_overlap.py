"""What the attention oracle costs a run's wall clock when it runs beside the system on a stream of its own.

    python3 bench/probes/oracle_overlap.py scenarios/deepseek_v3_mooncake.yaml --variants base,side,none [--runs 2]

Variants (each timed over ``--runs`` runs after one untimed warm-up run of the first variant):
* ``base``: the product as it is.
* ``side``: the MLA and GQA attention checks on a second CUDA stream: the oracle's expected outputs queued
  there without waiting for anything the system does (they come from token ids alone), then the stream
  waits for the system's step and compares; the main stream never waits for the oracle.
* ``none``: the attention checks skipped and the Mamba oracle's scan too (the state copies still made):
  the system alone, so a variant's loop minus this one is what its oracle costs the wall clock.
Not product code: the variants are measurements.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import hybridsim.engine.attn_exec as ae  # noqa: E402
import hybridsim.engine.mamba_exec as me  # noqa: E402
import hybridsim.engine.mla_exec as mle  # noqa: E402
from hybridsim.config import load_scenario  # noqa: E402
from hybridsim.runner import plan_scenario  # noqa: E402

ORIGINAL = {"mla": mle.MLAExecution.check, "attn": ae.AttentionExecution.check, "mamba": me.MambaExecution.after}
_SIDE: dict = {}


def _side(dev) -> torch.cuda.Stream:
    if dev not in _SIDE:
        _SIDE[dev] = torch.cuda.Stream(dev)
    return _SIDE[dev]


def _hold(tensors, stream) -> None:
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(stream)


def check_beside(phase: str, held):
    """A layer kind's ``check`` with its oracle on the second stream: ``expected`` queued there at once,
    then the stream waits for the system's step and ``compare`` runs there too. ``held(fwd)``: the
    system's tensors the comparison reads (kept from the main stream's allocator until it has)."""
    def check(self, plan, reqs, fwd, committed):
        with self.clock.phase(phase):  # (its device time: the main stream's, not the side stream's work)
            main, side = torch.cuda.current_stream(self.device), _side(self.device)
            ready = torch.cuda.Event()
            ready.record(main)
            _hold(held(fwd), side)
            with torch.cuda.stream(side):
                expected = self.expected(plan, reqs, committed)
                side.wait_event(ready)
                self.compare(plan, fwd, committed, expected)
    return check


mla_check_side = check_beside("mla_oracle", lambda fwd: [t for layer in fwd.outs for t in layer]
                              + [t for *_, d, p in fwd.paths for t in (d, p)])
attn_check_side = check_beside("attn_oracle", lambda fwd: [*fwd.outs, fwd.hit_bad])


def mamba_after_copies_only(self, plan, outcome, reqs, committed, fwd):
    """``after`` without the oracle: the post-step state copies only."""
    self.apply_copies(self.post_copies(plan, outcome, reqs, fwd), plan.step)


def set_variant(name: str) -> None:
    mle.MLAExecution.check = ORIGINAL["mla"]
    ae.AttentionExecution.check = ORIGINAL["attn"]
    me.MambaExecution.after = ORIGINAL["mamba"]
    if name == "side":
        mle.MLAExecution.check = mla_check_side
        ae.AttentionExecution.check = attn_check_side
    elif name == "none":
        mle.MLAExecution.check = lambda *a, **k: None
        ae.AttentionExecution.check = lambda *a, **k: None
        me.MambaExecution.after = mamba_after_copies_only
    elif name != "base":
        raise SystemExit(f"unknown variant {name!r}")


def once(path: str, max_steps):
    gc.collect()
    torch.cuda.empty_cache()
    loaded = load_scenario(path)
    if max_steps:
        s = loaded.scenario
        loaded.scenario = s.model_copy(update={"execution": s.execution.model_copy(update={"max_steps": max_steps})})
    res = plan_scenario(loaded, kernels="triton", device="cuda")
    torch.cuda.synchronize()
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("scenario")
    ap.add_argument("--variants", default="base,side,none")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=None)
    a = ap.parse_args()
    variants = a.variants.split(",")
    set_variant(variants[0])
    once(a.scenario, a.max_steps)  # (warm-up: kernels built, caches allocated once)
    for k in range(a.runs):
        for v in variants:
            set_variant(v)
            r = once(a.scenario, a.max_steps)
            fails = sum(t.failures for t in r.checks.tallies.values())
            counts = {n: t.count for n, t in r.checks.tallies.items() if n.endswith(".output")}
            print(f"{v:5s} run {k + 1}: {r.stats.steps} steps, whole loop {r.wall_s:.3f} s = "
                  f"{1e3 * r.wall_s / r.stats.steps:.1f} ms/step; failures {fails}; {counts}; "
                  + ", ".join(f"{t['phase']} {1e3 * t['total_s'] / r.stats.steps:.1f}" for t in r.timings)
                  + " ms/step", flush=True)


if __name__ == "__main__":
    main()
