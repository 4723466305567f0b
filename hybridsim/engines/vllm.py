"""vLLM's own V1 scheduler and KV cache manager, driven live in process (``run --scheduler vllm``).

What is driven: ``vllm.v1.core.sched.scheduler.Scheduler`` with its real KV cache manager, as the
engine core drives it (add the step's arrivals, ``schedule``, ``update_from_output``, drafts
through ``update_draft_token_ids``), and a fake model that commits each request's true
continuation. The KV cache groups are the scenario's (``sched.groups.plan_groups``: the same
groups, in the same order, as the executor's), so vLLM's block ids index our caches directly.
The model and structured-output configs are stand-ins holding only what the scheduler reads (no
weights or tokenizer exist here); vLLM's structured-output manager returns at once for requests
without structured output, as the stand-in does.

Each step's ``SchedulerOutput`` is written as a line of a recording (data/vllm-recorded/README.md's
format, ``recording_step``) and turned into a StepPlan by the converter that reads recordings
(``convert.recorded_step``): vLLM's plans reach the executor in the form ours do.

Drafts are ours: hybridsim's drafter proposes them (``outputs.ModelDrafts``), right as often as
the scenario's acceptance model says, round by round, from the request's tokens as vLLM holds them.

``bench/peer_vllm.py`` times and logs this driver on exported bench workloads (``run_once``:
``make_scheduler`` takes an export's keys, with the recordings' geometry when no groups are given).
"""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

from ..config import Scenario
from ..sched.groups import GroupSpec
from ..sched.plan import PLACEHOLDER_DRAFT


class StandIn(SimpleNamespace):
    """A config stand-in: the attributes given; any other one the scheduler reads is None
    (and recorded, to be shown with the results)."""

    read_missing: set = set()

    def __getattr__(self, key):
        if key.startswith("__"):
            raise AttributeError(key)
        StandIn.read_missing.add(key)
        return None


# ----------------------------------------------------------------------------- building the scheduler


def _torch_dtype(name: str):
    import torch
    return getattr(torch, name)


def scenario_shape(s: Scenario, groups: list[GroupSpec]) -> dict:
    """The scheduler's configuration for a scenario, in the keys ``make_scheduler`` reads (those of
    a bench export, plus ``kv_groups``: the scenario's own groups with their specs' shapes)."""
    geo = s.geometry()
    specs = []
    for g in groups:
        if g.is_mamba:
            m = geo.mamba
            conv_dim = m.heads * m.head_dim + 2 * m.n_groups * m.d_state
            specs.append({"kind": "mamba", "block_size": g.block_size, "layers": len(g.layers),
                          "shapes": ((m.conv_kernel - 1, conv_dim), (m.heads, m.head_dim, m.d_state)),
                          "dtypes": (m.conv_dtype, m.state_dtype)})
        elif g.draft and not g.layers:  # a group of the drafter's layers only
            specs.append({"kind": "draft", "block_size": g.block_size, "layers": g.num_layers})
        elif g.kind == "mla":  # (one latent vector a token; vLLM's KV manager keeps MLA as full attention)
            a = geo.mla
            specs.append({"kind": "attention", "block_size": g.block_size, "layers": len(g.layers),
                          "num_kv_heads": 1, "head_size": a.kv_lora_rank + a.qk_rope_head_dim, "dtype": a.dtype})
        else:
            a = geo.attention
            specs.append({"kind": "attention", "block_size": g.block_size, "layers": len(g.layers),
                          "num_kv_heads": a.kv_heads, "head_size": a.head_dim, "dtype": a.dtype,
                          # (a mixed group: the target's attention layers and the drafter's MTP layers)
                          "draft_layers": len(g.draft_layers)})
    sd = s.spec_decode
    return {"workload": s.name, "block_size": s.cache.block_size, "prefix_match_unit": s.cache.prefix_match_unit,
            "num_blocks": s.cache.num_blocks, "enable_prefix_caching": s.cache.enable_prefix_caching,
            "mamba_cache_mode": s.cache.resolved_mode() if geo.mamba is not None else "none",
            "max_num_batched_tokens": s.scheduler.max_num_batched_tokens, "max_num_seqs": s.scheduler.max_num_seqs,
            "max_model_len": s.scheduler.max_model_len,
            "long_prefill_token_threshold": s.scheduler.long_prefill_token_threshold,
            "enable_chunked_prefill": s.scheduler.enable_chunked_prefill, "policy": s.scheduler.policy,
            "num_speculative_tokens": sd.num_speculative_tokens, "spec_method": sd.method,
            "num_draft_layers": sd.draft_layers or 1, "kv_groups": specs}


def _recordings_groups(w: dict) -> list[dict]:
    """The recordings' NemotronH-style geometry (data/vllm-recorded/*.jsonl: the config line) for an
    export that names no groups: ``mamba_groups`` Mamba groups (six of four layers: Nemotron-H-8B),
    one attention group, and the drafter's group (MTP / EAGLE)."""
    mode = w["mamba_cache_mode"]
    bs = w["block_size"]
    # (mode none: one block holds a request's whole state, so its block is max_model_len tokens long)
    mamba = {"kind": "mamba", "block_size": w["max_model_len"] if mode == "none" else bs, "layers": 1,
             "shapes": ((3, 288), (8, 32, 16)), "dtypes": ("bfloat16", "float32")}
    out = [dict(mamba) for _ in range(w.get("mamba_groups", 1))]
    out.append({"kind": "attention", "block_size": bs, "layers": 1, "num_kv_heads": 8, "head_size": 128,
                "dtype": "bfloat16"})
    if w["num_speculative_tokens"] and w.get("spec_method", "ngram") in ("mtp", "eagle"):
        out.append({"kind": "draft", "block_size": bs, "layers": w.get("num_draft_layers", 1)})
    return out


def make_scheduler(w: dict):
    """vLLM's Scheduler with its KV cache manager for a configuration in a bench export's keys
    (``scenario_shape``). Prefix caching hashes with the engine's default, sha256."""
    from vllm.config import CacheConfig, DeviceConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    bs = w["block_size"]
    # prefix_match_unit: block hashes every ``unit`` tokens (below the block size: partial-block hits)
    unit = w.get("prefix_match_unit") or bs
    S = w["num_speculative_tokens"]
    sched = SchedulerConfig(max_num_batched_tokens=w["max_num_batched_tokens"], max_num_seqs=w["max_num_seqs"],
                            max_model_len=w["max_model_len"],
                            enable_chunked_prefill=w.get("enable_chunked_prefill", True), is_encoder_decoder=False,
                            long_prefill_token_threshold=w.get("long_prefill_token_threshold", 0),
                            policy=w.get("policy", "fcfs"))
    mode = w["mamba_cache_mode"]
    cache = CacheConfig(block_size=bs, enable_prefix_caching=w.get("enable_prefix_caching", True),
                        mamba_cache_mode=mode)
    cache.num_gpu_blocks = w["num_blocks"]
    cfg = VllmConfig(scheduler_config=sched, cache_config=cache, device_config=DeviceConfig(device="cpu"))
    object.__setattr__(cfg, "model_config", StandIn(
        uses_mrope=False, max_model_len=w["max_model_len"], runner_type="generate", is_diffusion=False,
        is_encoder_decoder=False, supports_multimodal_inputs=False, multimodal_config=None))
    method = w.get("spec_method", "ngram")
    draft_layers = w.get("num_draft_layers", 1)
    if S:  # the drafter: n-gram (no draft model, no lookahead slots), or MTP / EAGLE (a draft
        # model with KV-cache layers of its own: lookahead slots, lookahead block hashes)
        yes, no = (lambda: True), (lambda: False)  # noqa: E731
        eagle = method in ("mtp", "eagle")
        multi = method == "mtp" and min(draft_layers, S) > 1
        object.__setattr__(cfg, "speculative_config", StandIn(
            num_speculative_tokens=S, method=method, num_speculative_tokens_per_batch_size=None,
            use_eagle=yes if eagle else no, use_eagle_block_drop=yes if eagle else no,
            needs_eagle_block_drop=yes if eagle else no, use_dspark=no, use_dflash=no,
            uses_draft_model=no, use_multi_module_mtp=yes if multi else no,
            disable_eagle_block_drop=False, disable_lookahead_block_hashes=False,
            max_num_new_slots_for_drafting=0))
    # (align mode: one prefill-checkpoint block, as the recordings; the checkpoint alignment is the
    # Mamba2 mixer's, MambaMixer2.get_kv_cache_spec: 1, any position; with the unit equal to the
    # block size it changes nothing, a checkpoint lying on a block boundary anyway)
    ckpt = dict(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1) if mode == "align" else {}
    groups = []
    target = None  # the target's first attention spec (an MTP layer is built like it)
    sizes = []
    if w.get("layer_pattern"):  # the groups as the engine forms them from the model's layers
        groups = engine_groups(cfg, w, S, method, draft_layers, ckpt)
        sizes = [g.kv_cache_spec.block_size for g in groups]
    for i, g in enumerate([] if groups else (w.get("kv_groups") or _recordings_groups(w))):
        names = [f"model.layers.{i}.{j}" for j in range(g["layers"])]
        if g["kind"] == "mamba":
            spec = MambaSpec(block_size=g["block_size"], shapes=tuple(tuple(x) for x in g["shapes"]),
                             dtypes=tuple(_torch_dtype(d) for d in g["dtypes"]), mamba_cache_mode=mode,
                             num_speculative_blocks=S, **ckpt)
            groups.append(KVCacheGroupSpec(names, spec))
        elif g["kind"] == "attention":
            spec = FullAttentionSpec(block_size=g["block_size"], num_kv_heads=g["num_kv_heads"],
                                     head_size=g["head_size"], dtype=_torch_dtype(g["dtype"]))
            target = target or spec
            drafts = [f"draft.layers.{j}.attn" for j in range(g.get("draft_layers", 0))]
            groups.append(KVCacheGroupSpec(names + drafts, spec, is_eagle_group=bool(drafts)))
        else:  # the drafter's attention layers, flagged as the engine flags them. An MTP layer is
            # built like the target's attention (same spec: looked up jointly with it); an EAGLE
            # head is a model of its own (another spec: looked up on its own)
            spec = target if method == "mtp" and target is not None else FullAttentionSpec(
                block_size=g["block_size"], num_kv_heads=4, head_size=256, dtype=_torch_dtype("bfloat16"))
            groups.append(KVCacheGroupSpec([f"draft.layers.{j}.attn" for j in range(g["layers"])], spec,
                                           is_eagle_group=True))
        sizes.append(spec.block_size)
    kv = KVCacheConfig(num_blocks=w["num_blocks"], kv_cache_tensors=[], kv_cache_groups=groups,
                       hash_block_size=unit, cache_hit_alignment_tokens=unit,
                       # as the engine resolves it (0: Mamba keeps only the latest replay boundary)
                       prefix_cache_retention_interval=cache.prefix_cache_retention_interval)
    structured = SimpleNamespace(accept_tokens=lambda req, toks: True, validate_tokens=lambda req, toks: toks,
                                 grammar_bitmask=lambda *a, **k: None)
    # the scheduling granularity is the least common multiple of the groups' block sizes
    return Scheduler(cfg, kv, structured, block_size=math.lcm(*sizes), hash_block_size=unit)


def engine_groups(cfg, w: dict, S: int, method: str, draft_layers: int, ckpt: dict) -> list:
    """The KV-cache groups vLLM 0.33 forms (``get_global_kv_cache_groups``: grouping, page-size
    unification, ``is_eagle_group`` flags) for a layer pattern (M Mamba, A attention, model
    order; the recordings' geometry) and a drafter's layers (listed after the target's,
    ``is_draft``: an MTP layer built like the target's attention, an EAGLE head with a spec of its
    own), in the layer-outer cache layout of FlashAttention (NHD)."""
    from dataclasses import replace

    import torch
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    mode, bs = w["mamba_cache_mode"], w["block_size"]
    mamba = MambaSpec(block_size=w["max_model_len"] if mode == "none" else bs, shapes=((3, 288), (8, 32, 16)),
                      dtypes=(torch.bfloat16, torch.float32), mamba_cache_mode=mode, num_speculative_blocks=S,
                      **ckpt)
    attn = FullAttentionSpec(block_size=bs, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    specs = {}
    for i, letter in enumerate(w["layer_pattern"]):
        specs[f"model.layers.{i}.mixer" if letter == "M" else f"model.layers.{i}.self_attn.attn"] = \
            mamba if letter == "M" else attn
    if S and method in ("mtp", "eagle"):
        draft = attn if method == "mtp" else FullAttentionSpec(block_size=bs, num_kv_heads=4, head_size=256,
                                                               dtype=torch.bfloat16)
        for j in range(draft_layers):
            specs[f"draft.layers.{j}.attn"] = replace(draft, is_draft=True)
    cfg.scheduler_config.disable_hybrid_kv_cache_manager = False
    cfg.cache_config.kv_cache_layout = "NHD"
    return get_global_kv_cache_groups(cfg, [specs])


def request_hasher(w: dict, sched):
    """The engine's block hasher for this configuration (sha256, its default
    ``prefix_caching_hash_algo``; MTP / EAGLE: each block's hash also covers the tokens the
    drafter reads after it)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return get_request_block_hasher(w.get("prefix_match_unit") or w["block_size"], hash_fn,
                                    sched.num_hash_lookahead_tokens)


# ----------------------------------------------------------------------------- the recording format


def block_ids(out) -> dict:
    """Per request: the block ids the step hands out, per group (a new request: its whole rows;
    a running one: the new tails, when any), as ``hybridsim fidelity`` reads them off recordings."""
    blocks = {new.req_id: [list(g) for g in new.block_ids] for new in out.scheduled_new_reqs}
    cached = out.scheduled_cached_reqs
    for rid, new_ids in zip(cached.req_ids, cached.new_block_ids):
        if new_ids is not None:
            blocks[rid] = [list(g) for g in new_ids]
    return blocks


def recording_head(w: dict, sched) -> list[dict]:
    """The config and requests lines of a recording of this driver's scheduler."""
    import vllm
    groups = []
    for gid, g in enumerate(sched.kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        d = {"group_id": gid, "spec": type(spec).__name__, "block_size": spec.block_size,
             "num_layers": len(g.layer_names), "layer_names": list(g.layer_names),
             "page_size_bytes": spec.page_size_bytes, "is_eagle_group": bool(g.is_eagle_group),
             # (the drafter's layers among them: the driver names them draft.layers.N)
             "num_draft_layers": sum(name.startswith("draft.") for name in g.layer_names)}
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
           "hash_block_size": w.get("prefix_match_unit") or w["block_size"],
           "num_hash_lookahead_tokens": sched.num_hash_lookahead_tokens,
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


def in_schedule_order(line: dict, out) -> dict:
    """A step line with its rows as the engine scheduled them: running requests in the running
    queue's order, then admissions in the waiting queue's, a resumed request among the admissions
    (vLLM's V1 model runner gets resumed requests with the cached ones, flagged in
    ``resumed_req_ids``: whole rows, as a new request's)."""
    order = {rid: i for i, rid in enumerate(out.num_scheduled_tokens)}
    resumed = set(getattr(out.scheduled_cached_reqs, "resumed_req_ids", None) or ())
    cached, new = [], list(line["scheduled_new_reqs"])
    for r in line["scheduled_cached_reqs"]:
        if r["id"] in resumed:
            new.append({"id": r["id"], "num_computed_tokens": r["num_computed_tokens"],
                        "block_ids": r["new_block_ids"], "resumed": True})
        else:
            cached.append(r)
    line["scheduled_cached_reqs"] = sorted(cached, key=lambda r: order[r["id"]])
    line["scheduled_new_reqs"] = sorted(new, key=lambda r: order[r["id"]])
    return line


def model_outputs(sched, out, truth, on_verify=None) -> tuple[list[str], list[list[int]], dict[str, int]]:
    """The fake model's forward pass: for every row whose chunk reached its request's end, the
    true continuation's next tokens, drafts equal to it accepted, then the bonus token (what a
    model returns; the engine trims at max_tokens / max_model_len itself). Returns the rows' ids,
    their tokens ([] for a prefill chunk short of the end) and the drafts accepted per row with
    drafts. ``on_verify(rid)``: called for a verification round (real drafts, not padding)."""
    ids, sampled, accepted = [], [], {}
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        ids.append(rid)
        if req.num_computed_tokens < req.num_tokens:  # a prefill chunk: nothing sampled
            sampled.append([])
            continue
        t = truth(rid)
        o = req.num_output_tokens
        drafts = out.scheduled_spec_decode_tokens.get(rid, ())
        if drafts and drafts[0] != PLACEHOLDER_DRAFT and on_verify is not None:
            on_verify(rid)  # (-1: padding of a new request, no proposal behind it)
        k = 0
        while k < len(drafts) and drafts[k] == t[o + k]:
            k += 1
        if drafts:
            accepted[rid] = k
        sampled.append(t[o:o + k + 1])
    return ids, sampled, accepted


def runner_output(ids: list[str], sampled: list[list[int]]):
    from vllm.v1.outputs import ModelRunnerOutput
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: j for j, r in enumerate(ids)},
                             sampled_token_ids=sampled)


# ----------------------------------------------------------------------------- bench: exported workloads


def run_once(w: dict, steps_log: list | None = None, max_steps: int = 0, record: list | None = None) -> dict:
    """One run of an exported bench workload; returns seconds (whole run, or the steady window),
    steps and plan totals. Drafts follow the export's acceptance (``accepted``: how many drafts
    our acceptance model accepts in each of a request's verification rounds).
    ``steps_log``: filled with every step's plan, for bench/peer_compare.py (slows the run).
    ``record``: filled with the lines of a recording (data/vllm-recorded/README.md's format)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.outputs import DraftTokenIds
    from vllm.v1.request import Request

    truth = {r["id"]: r["outputs"] for r in w["requests"]}
    S = w["num_speculative_tokens"]
    ours = w["accepted"]  # our acceptance, round by round: the peer's drafts follow it
    rounds: dict[str, int] = {}
    steady = w["steady_steps"]

    def verified(rid: str) -> None:  # a verification round: the next proposal is for the next one
        rounds[rid] = rounds.get(rid, 0) + 1

    t0 = time.perf_counter()
    sched = make_scheduler(w)
    hasher = request_hasher(w, sched)
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
        ids, sampled, _ = model_outputs(sched, out, truth.__getitem__, verified)
        sched.update_from_output(out, runner_output(ids, sampled))
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
