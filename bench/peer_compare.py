"""Step-by-step comparison of our plans with vLLM 0.33's on a bench workload.

    .venv/bin/python bench/bench_planner.py mooncake2000 --export /tmp/m.json
    .peer-venv/bin/python bench/peer_vllm.py /tmp/m.json --repeat 1 --steps /tmp/m.steps.json
    .venv/bin/python bench/peer_compare.py /tmp/m.json /tmp/m.steps.json

Compares, step by step, which requests are scheduled with how many tokens after how many
computed ones, the prefix hit of every admission, the preempted requests, the free blocks after
the step and the block ids it hands out (what ``hybridsim fidelity`` compares on the recordings,
on workloads too large to record; a peer log written before block ids were logged is compared
without them).
Our final step, which only reports the last finished requests, has no counterpart in the
driver's loop and is not compared.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench_planner import MODEL, PEER_WORKLOADS, Simulation, build_workload, parse_scenario

from hybridsim.workload.base import Workload, WorkloadRequest


def steps_of(sim) -> list[dict]:
    """Every step of a simulation, in the shape peer_vllm.py --steps writes (free blocks after
    the step's update)."""
    return [{"step": plan.step,
             "sched": {s.req_id: [s.num_computed_tokens, s.num_scheduled_tokens] for s in plan.scheduled},
             "hits": {s.req_id: s.prefix_hit_tokens for s in plan.scheduled if s.is_new},
             "preempted": sorted(plan.preempted), "free": sim.kv.pool.num_free,
             "blocks": {s.req_id: [list(g) for g in s.new_block_ids] for s in plan.scheduled
                        if s.new_block_ids is not None}}
            for plan, _ in sim]


def our_steps(name: str) -> list[dict]:
    make, _ = PEER_WORKLOADS[name]
    loaded = parse_scenario(make(), "bench")
    return steps_of(Simulation(loaded.scenario, build_workload(loaded)))


class GivenOutputs:
    """The outputs written in an export, as the model's continuation (both sides commit them)."""

    def __init__(self, outputs: dict[str, list[int]]):
        self.outputs = outputs

    def stream(self, req, n: int) -> list[int]:
        return list(self.outputs[req.req_id][:n])


def model_text(w: dict) -> str:
    """The scenario's model and cache keys for an export (the recordings' geometry)."""
    caching = "true" if w.get("enable_prefix_caching", True) else "false"
    text = MODEL
    k = w.get("mamba_groups", 1)
    pattern = w.get("layer_pattern")
    if pattern:  # (a layer pattern: the engine forms the groups from it, both sides alike)
        text = text.replace("mamba: {layers: 1,", f"layer_pattern: {pattern}\n  mamba: {{layers: {pattern.count('M')},")
        text = text.replace("attention: {layers: 1,", f"attention: {{layers: {pattern.count('A')},")
    elif k > 1:  # (Nemotron-H-8B: 24 Mamba layers beside 4 attention layers make 6 Mamba groups of 4)
        text = text.replace("mamba: {layers: 1,", f"mamba: {{layers: {4 * k},").replace(
            "attention: {layers: 1,", "attention: {layers: 4,")
    bs = w.get("block_size", 16)
    if bs != 16:
        text = text.replace("block_size: 16", f"block_size: {bs}")
    unit = w.get("prefix_match_unit")
    if unit and unit != bs and w["mamba_cache_mode"] == "align" and w.get("enable_prefix_caching", True):
        # (partial-block prefix hits; vLLM ignores the unit with prefix caching off or Mamba mode none)
        text = text.replace("num_blocks: 262144", f"prefix_match_unit: {unit}, num_blocks: 262144")
    return (text.replace("num_blocks: 262144", f"num_blocks: {w['num_blocks']}")
            .replace("enable_prefix_caching: true", f"enable_prefix_caching: {caching}")
            .replace("mamba_cache_mode: align", f"mamba_cache_mode: {w['mamba_cache_mode']}"))


def scenario_from_export(w: dict):
    """The scenario (validated) of an export that holds everything itself (config, prompts,
    outputs): its config, with a synthetic workload standing in for its requests (validation
    sees their prompts, not their outputs). Drafts, when the export has them, are accepted by
    the Bernoulli model its ``acceptance_rate`` and ``seed`` name (the export's ``accepted`` is
    what that model decided, for the peer's drafts)."""
    S = w["num_speculative_tokens"]
    if S and "acceptance_rate" not in w:
        raise ValueError("an export with drafts and no acceptance_rate: use its named workload (our_steps)")
    acc = f"{{kind: bernoulli, rate: {w['acceptance_rate']}}}" if S else "{kind: none}"
    longest = max(len(r["prompt"]) for r in w["requests"])
    thr = w.get("long_prefill_token_threshold", 0)
    method = w.get("spec_method", "ngram")
    drafter = "" if method == "ngram" else f", method: {method}, num_draft_layers: {w.get('num_draft_layers', 1)}"
    text = f"""name: {w['workload']}
seed: {w.get('seed', 0)}
{model_text(w)}
scheduler: {{max_num_batched_tokens: {w['max_num_batched_tokens']}, max_num_seqs: {w['max_num_seqs']},
             max_model_len: {w['max_model_len']}, long_prefill_token_threshold: {thr}}}
spec_decode: {{num_speculative_tokens: {S}, acceptance: {acc}{drafter}}}
workload:
  kind: synthetic
  num_requests: {len(w["requests"])}
  prompt_len: {{dist: uniform, min: 1, max: {longest}}}
  output_len: {{dist: fixed, value: 1}}
execution: {{max_steps: 100000, check: off}}
"""
    return parse_scenario(text, w["workload"]).scenario


def simulation_from_export(w: dict) -> Simulation:
    """Our simulation of an export (``scenario_from_export``) with no scenario file behind it
    (bench/peer_fuzz.py, bench/probes/peer_press.py): its requests, committing its outputs."""
    scenario = scenario_from_export(w)
    wl = Workload([WorkloadRequest(r["id"], r["arrival_step"], tuple(r["prompt"]), r["max_tokens"])
                   for r in w["requests"]], 32000, w["workload"])
    outputs = {r["id"]: r["outputs"] for r in w["requests"]}
    return Simulation(scenario, wl, continuation=GivenOutputs(outputs))


def steps_from_export(w: dict) -> list[dict]:
    """Our plans for an export that holds everything itself (``simulation_from_export``)."""
    return steps_of(simulation_from_export(w))


def compare(name: str, ours: list[dict], peer: dict, show: int) -> bool:
    """Print the first ``show`` differing steps and the share of identical ones."""
    theirs = peer["steps"]
    if peer.get("cut_at"):  # (the peer's run stopped at --max-steps: compare that many)
        ours = ours[:len(theirs)]
    if len(ours) == len(theirs) + 1 and not ours[-1]["sched"]:
        ours = ours[:-1]  # (our report-only last step)
    if theirs:  # what the peer's log has (logs written before block ids were recorded lack them)
        keys = set(theirs[0])
        ours = [{k: v for k, v in a.items() if k in keys} for a in ours]
    same = 0
    shown = 0
    for a, b in zip(ours, theirs):
        if a == b:
            same += 1
        elif shown < show:
            shown += 1
            diff = {k: (a.get(k), b.get(k)) for k in ("sched", "hits", "preempted", "free", "blocks")
                    if a.get(k) != b.get(k)}
            for k, (x, y) in diff.items():
                if isinstance(x, dict):
                    keys = sorted(set(x) | set(y), key=lambda r: (len(r), r))
                    diff[k] = {r: (x.get(r), y.get(r)) for r in keys if x.get(r) != y.get(r)}
            print(f"step {a['step']}: (ours, vLLM) {diff}")
    n = max(len(ours), len(theirs))
    print(f"{name}: {same:,} of {n:,} steps identical ({100 * same / n:.2f}%); steps: ours {len(ours):,}, "
          f"vLLM {peer['vllm']} {len(theirs):,}")
    return same == n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", type=Path, help="the file bench_planner.py --export wrote")
    ap.add_argument("peer_steps", type=Path, help="the file peer_vllm.py --steps wrote")
    ap.add_argument("--show", type=int, default=8, help="differing steps to print")
    args = ap.parse_args()
    name = json.loads(args.workload.read_text())["workload"]
    ok = compare(name, our_steps(name), json.loads(args.peer_steps.read_text()), args.show)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
