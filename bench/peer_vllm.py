"""The peer side of issue 2's speed bar: vLLM 0.33's own V1 scheduler, driven offline.

Runs in an environment with vLLM 0.33 installed (see bench/peer_setup.sh; not the project's
venv), on a workload exported by the planner benchmark, so both sides plan the same requests:

    .venv/bin/python bench/bench_planner.py mooncake2000 --export /tmp/mooncake2000.json
    .peer-venv/bin/python bench/peer_vllm.py /tmp/mooncake2000.json --repeat 5

What is driven: ``vllm.v1.core.sched.scheduler.Scheduler`` with its real KV cache manager
(one Mamba2 group in align mode with one prefill-checkpoint block, one full-attention
group, block 16, prefix caching with the engine's default sha256 block hashes), the
engine core's loop (add the step's arrivals, ``schedule``, ``update_from_output``, drafts
through ``update_draft_token_ids``), and a fake model that commits the same true
continuation our simulated model does. Drafts (spec workloads) are right as often as
ours, round by round (the export carries how many drafts our acceptance model accepts in each
of a request's verification rounds). The model and structured-output configs are stand-ins holding only what
the scheduler reads (no model weights or tokenizer exist here); vLLM's own structured-output
manager returns at once for requests without structured output, as the stand-in does.

Timed like the planner benchmark: whole workloads (mooncake2000) from building the
scheduler and the requests (block hashing included) to the last step; steady workloads
over their 500 steps once every request decodes. Each line shows the calibration
(bench/calibration.py) so that it can be set beside hybridsim's figures of the same phase.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calibration import calibrate  # noqa: E402


class _Stand(SimpleNamespace):
    """A config stand-in: the attributes given; any other one the scheduler reads is None
    (and recorded, to be shown with the results)."""

    read_missing: set = set()

    def __getattr__(self, key):
        if key.startswith("__"):
            raise AttributeError(key)
        _Stand.read_missing.add(key)
        return None


def make_scheduler(w: dict):
    import torch
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    bs = w["block_size"]
    # prefix_match_unit: block hashes every ``unit`` tokens (below the block size: partial-block hits)
    unit = w.get("prefix_match_unit") or bs
    S = w["num_speculative_tokens"]
    sched = SchedulerConfig(max_num_batched_tokens=w["max_num_batched_tokens"], max_num_seqs=w["max_num_seqs"],
                            max_model_len=w["max_model_len"], enable_chunked_prefill=True, is_encoder_decoder=False,
                            long_prefill_token_threshold=w.get("long_prefill_token_threshold", 0))
    mode = w["mamba_cache_mode"]
    cache = CacheConfig(block_size=bs, enable_prefix_caching=w.get("enable_prefix_caching", True),
                        mamba_cache_mode=mode)
    cache.num_gpu_blocks = w["num_blocks"]
    cfg = VllmConfig(scheduler_config=sched, cache_config=cache, device_config=DeviceConfig(device="cpu"))
    object.__setattr__(cfg, "model_config", _Stand(
        uses_mrope=False, max_model_len=w["max_model_len"], runner_type="generate", is_diffusion=False,
        is_encoder_decoder=False, supports_multimodal_inputs=False, multimodal_config=None))
    method = w.get("spec_method", "ngram")
    draft_layers = w.get("num_draft_layers", 1)
    if S:  # the drafter: n-gram (no draft model, no lookahead slots), or MTP / EAGLE (a draft
        # model with KV-cache layers of its own: lookahead slots, lookahead block hashes)
        yes, no = (lambda: True), (lambda: False)  # noqa: E731
        eagle = method in ("mtp", "eagle")
        multi = method == "mtp" and min(draft_layers, S) > 1
        object.__setattr__(cfg, "speculative_config", _Stand(
            num_speculative_tokens=S, method=method, num_speculative_tokens_per_batch_size=None,
            use_eagle=yes if eagle else no, use_eagle_block_drop=yes if eagle else no,
            needs_eagle_block_drop=yes if eagle else no, use_dspark=no, use_dflash=no,
            uses_draft_model=no, use_multi_module_mtp=yes if multi else no,
            disable_eagle_block_drop=False, disable_lookahead_block_hashes=False,
            max_num_new_slots_for_drafting=0))
    # the recordings' NemotronH-style geometry (data/vllm-recorded/*.jsonl: the config line)
    # (align mode: one prefill-checkpoint block, as the recordings; mode none: one block holds a
    # request's whole state, so its block is max_model_len tokens long, as the engine sizes it)
    # (the alignment is the Mamba2 mixer's, MambaMixer2.get_kv_cache_spec: 1, any position; with the
    # unit equal to the block size it changes nothing, a checkpoint lying on a block boundary anyway)
    ckpt = dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1) if mode == "align" else {}
    mamba = MambaSpec(block_size=w["max_model_len"] if mode == "none" else bs, shapes=((3, 288), (8, 32, 16)),
                      dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode, num_speculative_blocks=S,
                      **ckpt)
    attn = FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    # several Mamba groups (the Nemotron-H-8B layout: 24 Mamba layers, 4 attention layers, so
    # six Mamba groups of four beside one attention group), then the target's attention group
    groups = [KVCacheGroupSpec([f"model.layers.{i}.mixer"], mamba) for i in range(w.get("mamba_groups", 1))]
    groups.append(KVCacheGroupSpec([f"model.layers.{len(groups)}.mixer.attn"], attn))
    if S and method in ("mtp", "eagle"):
        # the drafter's attention layers: a group of their own, flagged as the engine flags it.
        # An MTP layer is built like the target's attention (same spec: looked up jointly with
        # it); an EAGLE head is a model of its own (another spec: looked up on its own)
        draft = attn if method == "mtp" else FullAttentionSpec(block_size=bs, num_kv_heads=4, head_size=256,
                                                               dtype=torch.bfloat16)
        groups.append(KVCacheGroupSpec([f"draft.layers.{i}.attn" for i in range(draft_layers)], draft,
                                       is_eagle_group=True))
    kv = KVCacheConfig(num_blocks=w["num_blocks"], kv_cache_tensors=[],
                       kv_cache_groups=groups,
                       hash_block_size=unit, cache_hit_alignment_tokens=unit,
                       # as the engine resolves it (0: Mamba keeps only the latest replay boundary)
                       prefix_cache_retention_interval=cache.prefix_cache_retention_interval)
    structured = SimpleNamespace(accept_tokens=lambda req, toks: True, validate_tokens=lambda req, toks: toks,
                                 grammar_bitmask=lambda *a, **k: None)
    # the scheduling granularity is the least common multiple of the groups' block sizes
    return Scheduler(cfg, kv, structured, block_size=math.lcm(bs, mamba.block_size), hash_block_size=unit)


def block_ids(out) -> dict:
    """Per request: the block ids the step hands out, per group (a new request: its whole rows;
    a running one: the new tails, when any), as ``hybridsim fidelity`` reads them off recordings."""
    blocks = {new.req_id: [list(g) for g in new.block_ids] for new in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
        if new_ids is not None:
            blocks[rid] = [list(g) for g in new_ids]
    return blocks


def run_once(w: dict, steps_log: list | None = None, max_steps: int = 0, record: list | None = None) -> dict:
    """One run; returns seconds (whole run, or the steady window), steps and plan totals.
    ``steps_log``: filled with every step's plan, for bench/peer_compare.py (slows the run).
    ``record``: filled with the lines of a recording (data/vllm-recorded/README.md's format)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")  # the engine's default prefix_caching_hash_algo
    init_none_hash(hash_fn)
    truth = {r["id"]: r["outputs"] for r in w["requests"]}
    S = w["num_speculative_tokens"]
    ours = w["accepted"]  # our acceptance, round by round: the peer's drafts follow it
    rounds: dict[str, int] = {}
    steady = w["steady_steps"]

    t0 = time.perf_counter()
    sched = make_scheduler(w)
    # (MTP / EAGLE: each block's hash also covers the tokens the drafter reads after it)
    hasher = get_request_block_hasher(w.get("prefix_match_unit") or w["block_size"], hash_fn,
                                      sched.num_hash_lookahead_tokens)
    arrivals = [(r["arrival_step"], Request(r["id"], r["prompt"], SamplingParams(max_tokens=r["max_tokens"],
                                                                                   ignore_eos=True),
                                            None, arrival_time=0.0, block_hasher=hasher))
                for r in w["requests"]]
    n = len(arrivals)
    i = step = hit_tokens = idle = 0
    stalled = False
    window = None
    while i < n or sched.has_unfinished_requests():
        if max_steps and step >= max_steps:
            break  # (a workload the engine does not finish: compare its first steps)
        while i < n and arrivals[i][0] <= step:
            sched.add_request(arrivals[i][1])
            i += 1
        out = sched.schedule()
        for new in out.scheduled_new_reqs:
            hit_tokens += new.num_computed_tokens
        if record is not None:
            if not record:
                record.extend(recording_head(w, sched))
            record.append(recording_step(step, out))
        if steps_log is not None:
            steps_log.append({
                "step": step,
                "sched": {rid: [sched.requests[rid].num_computed_tokens - k, k]
                          for rid, k in out.num_scheduled_tokens.items()},
                "hits": {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs},
                "preempted": sorted(out.preempted_req_ids or ()),
                "blocks": block_ids(out)})
        ids, sampled = [], []
        for rid in out.num_scheduled_tokens:
            req = sched.requests[rid]
            ids.append(rid)
            if req.num_computed_tokens < req.num_tokens:  # a prefill chunk: nothing sampled
                sampled.append([])
                continue
            t = truth[rid]
            o = req.num_output_tokens
            drafts = out.scheduled_spec_decode_tokens.get(rid, ())
            if drafts and drafts[0] != -1:  # a verification round: the next proposal is for the next one
                rounds[rid] = rounds.get(rid, 0) + 1  # (-1: padding of a new request, no proposal behind it)
            k = 0  # drafts equal to the true continuation are accepted, then the bonus token
            while k < len(drafts) and drafts[k] == t[o + k]:
                k += 1
            sampled.append(t[o:o + k + 1])
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)},
                                                        sampled_token_ids=sampled))
        if steps_log is not None:
            steps_log[-1]["free"] = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        if record is not None:
            record[-1].update(sampled_token_ids={r: list(t) for r, t in zip(ids, sampled) if t},
                              num_free_blocks=sched.kv_cache_manager.block_pool.get_num_free_blocks(),
                              finished_req_ids=sorted(out.finished_req_ids))
        if S:
            d_ids, d_toks = [], []
            for rid, toks in zip(ids, sampled):
                req = sched.requests.get(rid)
                if not toks or req is None or req.is_finished():
                    continue
                t = truth[rid]
                o = req.num_output_tokens
                # (proposals a preemption discards are never verified: rounds count verifications)
                j = rounds.get(rid, 0)
                seq = ours.get(rid, ())
                k = seq[j] if j < len(seq) else 0
                drafts = [t[o + j] if j < k else t[o + j] + 1 for j in range(S)]
                d_ids.append(rid)
                d_toks.append(drafts)
            sched.update_draft_token_ids(DraftTokenIds(d_ids, d_toks))
            if record is not None:
                record[-1]["drafts_proposed"] = dict(zip(d_ids, d_toks))
                record[-1]["after"] = {r: {"num_tokens": sched.requests[r].num_tokens} for r in d_ids}
        step += 1
        # a pool too small for a request's next step can leave it waiting forever (the engine
        # spins): stop as hybridsim does, after 1,000 steps in a row that schedule nothing
        idle = idle + 1 if not out.num_scheduled_tokens else 0
        if idle > 1000 and i >= n:
            stalled = True
            break
        if steady:
            if window is None and i == n and len(sched.running) == n and all(
                    r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running):
                window = (time.perf_counter(), step)
            elif window is not None and step - window[1] == steady:
                dt = time.perf_counter() - window[0]
                return {"seconds": dt, "steps": steady, "steps_per_s": steady / dt}
    if record is not None and not stalled and not (max_steps and step >= max_steps):
        # the engine's last step schedules nothing and reports the last finished requests
        out = sched.schedule()
        record.append(recording_step(step, out))
        record[-1].update(sampled_token_ids={}, finished_req_ids=sorted(out.finished_req_ids),
                          num_free_blocks=sched.kv_cache_manager.block_pool.get_num_free_blocks())
    dt = time.perf_counter() - t0
    if steady:
        raise SystemExit(f"{w['workload']}: the run ended before {steady} steady steps")
    return {"seconds": dt, "steps": step, "steps_per_s": step / dt, "prefix_hit_tokens": hit_tokens,
            "stalled": stalled}


def recording_head(w: dict, sched) -> list[dict]:
    """The config and requests lines of a recording of this driver's scheduler."""
    import vllm
    groups = []
    for gid, g in enumerate(sched.kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        d = {"group_id": gid, "spec": type(spec).__name__, "block_size": spec.block_size,
             "num_layers": len(g.layer_names), "layer_names": list(g.layer_names),
             "page_size_bytes": spec.page_size_bytes, "is_eagle_group": bool(g.is_eagle_group)}
        if type(spec).__name__ == "MambaSpec":
            # (the engine's conv state holds kernel - 1 + num_spec rows; the stand-in spec leaves the
            # drafts out, so the recording adds them as the engine's config line has them)
            shapes = [list(x) for x in spec.shapes]
            shapes[0][0] += spec.num_speculative_blocks
            d.update(mamba_cache_mode=spec.mamba_cache_mode, num_speculative_blocks=spec.num_speculative_blocks,
                     shapes=shapes, dtypes=[str(x) for x in spec.dtypes])
        groups.append(d)
    cfg = {"type": "config", "workload": w["workload"], "vllm_version": vllm.__version__,
           "recorded_by": "bench/peer_vllm.py --record (CPU, vLLM's own Scheduler and KV cache manager)",
           "kv_cache_groups": groups, "num_blocks": w["num_blocks"], "scheduler_block_size": w["block_size"],
           "hash_block_size": w.get("prefix_match_unit") or w["block_size"], "num_hash_lookahead_tokens": sched.num_hash_lookahead_tokens,
           "num_lookahead_tokens": sched.num_lookahead_tokens,
           "mamba_cache_mode": w["mamba_cache_mode"], "enable_prefix_caching": w.get("enable_prefix_caching", True),
           "max_model_len": w["max_model_len"], "max_num_seqs": w["max_num_seqs"],
           "max_num_batched_tokens": w["max_num_batched_tokens"],
           "long_prefill_token_threshold": w.get("long_prefill_token_threshold", 0),
           "enable_chunked_prefill": True, "policy": "fcfs", "num_spec_tokens": w["num_speculative_tokens"],
           "spec_method": w.get("spec_method", "ngram") if w["num_speculative_tokens"] else None}
    reqs = {"type": "requests", "requests": [
        {"id": r["id"], "arrival_step": r["arrival_step"], "prompt_len": len(r["prompt"]),
         "max_tokens": r["max_tokens"], "prompt_token_ids": list(r["prompt"])} for r in w["requests"]]}
    return [cfg, reqs]


def recording_step(step: int, out) -> dict:
    """One step line of a recording: what ``schedule`` decided (the update adds the rest)."""
    cached = out.scheduled_cached_reqs
    return {"type": "step", "step": step,
            "scheduled_new_reqs": [{"id": r.req_id, "prompt_len": len(r.prompt_token_ids or ()),
                                    "num_computed_tokens": r.num_computed_tokens,
                                    "block_ids": [list(g) for g in r.block_ids]} for r in out.scheduled_new_reqs],
            "scheduled_cached_reqs": [
                {"id": rid, "num_computed_tokens": c,
                 "new_block_ids": None if b is None else [list(g) for g in b]}
                for rid, c, b in zip(cached.req_ids, cached.num_computed_tokens, cached.new_block_ids)],
            "num_scheduled_tokens": dict(out.num_scheduled_tokens),
            "scheduled_spec_decode_tokens": {r: list(t) for r, t in out.scheduled_spec_decode_tokens.items()},
            "preempted_req_ids": sorted(out.preempted_req_ids or ()),
            # the private copies of partly hit blocks the worker makes before the step's writes
            "block_copies": [[c.src_block_id, c.dst_block_id] for c in (out.kv_cache_block_copies or ())]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("workload", type=Path, nargs="+",
                    help="files written by bench_planner.py NAME --export PATH (or bench/peer_fuzz.py write)")
    ap.add_argument("--repeat", type=int, default=3, help="timed runs per workload (0: none, plans only)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--steps", type=Path, metavar="PATH",
                    help="also write every step's plan of one more (untimed) run, for bench/peer_compare.py")
    ap.add_argument("--steps-dir", type=Path, metavar="DIR",
                    help="as --steps, for each workload: DIR/<workload file's stem>.steps.json")
    ap.add_argument("--record", type=Path, metavar="PATH",
                    help="also write a recording (data/vllm-recorded/README.md's format) of one workload")
    ap.add_argument("--max-steps", type=int, default=0, metavar="N",
                    help="with --steps/--steps-dir: stop after N steps (for a workload the engine never finishes)")
    args = ap.parse_args()
    if len(args.workload) > 1 and (args.steps or args.json or args.record):
        ap.error("--steps, --record and --json take one workload (use --steps-dir for several)")
    if args.repeat < 0:
        ap.error("--repeat: 0 or more")
    if args.max_steps < 0:
        ap.error("--max-steps: 0 (no limit) or more")
    try:
        import vllm
    except ImportError:
        raise SystemExit("error: vllm is not installed in this Python (see bench/peer_setup.sh)")
    for path in args.workload:
        w = json.loads(path.read_text())
        if args.repeat:
            time_workload(w, args.repeat, args.json)
        if args.record:
            lines: list = []
            run_once(dict(w, steady_steps=0), None, args.max_steps, lines)
            lines.append({"type": "summary", "steps": len(lines) - 2})
            args.record.write_text("".join(json.dumps(x) + "\n" for x in lines))
            print(f"  {w['workload']}: {len(lines) - 3} steps recorded to {args.record}")
        steps = args.steps or (args.steps_dir / f"{path.stem}.steps.json" if args.steps_dir else None)
        if steps:
            log: list = []
            res = run_once(dict(w, steady_steps=0), log, args.max_steps)
            steps.write_text(json.dumps({"vllm": vllm.__version__, "workload": w["workload"], "steps": log,
                                         "stalled": res["stalled"]}))
            print(f"  {w['workload']}: {len(log)} steps written to {steps}"
                  + (" (stalled: nothing scheduled for 1,000 steps)" if res["stalled"] else ""))


def time_workload(w: dict, repeat: int, json_path: Path | None) -> None:
    import vllm
    cal = calibrate()
    runs = [run_once(w) for _ in range(repeat)]
    cal = min(cal, calibrate())
    key = "steps_per_s" if w["steady_steps"] else "seconds"
    med = statistics.median(r[key] for r in runs)
    shown = f"{med:,.1f} steps/s" if key == "steps_per_s" else f"{med:.3f} s ({runs[0]['steps']} steps)"
    extra = f"   prefix-hit tokens {runs[0]['prefix_hit_tokens']:,}" if "prefix_hit_tokens" in runs[0] else ""
    print(f"vLLM {vllm.__version__} {w['workload']:14s} {shown:>22s}   runs {[round(r[key], 3) for r in runs]}   "
          f"calibration {cal * 1e3:.0f} ms{extra}")
    if _Stand.read_missing:
        print(f"  (config attributes the scheduler read as None: {', '.join(sorted(_Stand.read_missing))})")
    if json_path:
        json_path.write_text(json.dumps({"vllm": vllm.__version__, "workload": w["workload"], key: med,
                                         "runs": [round(r[key], 4) for r in runs], "calibration_ms": round(cal * 1e3, 1),
                                         **{k: v for k, v in runs[0].items() if k not in (key,)}}, indent=2))


if __name__ == "__main__":
    main()
