"""Step traces recorded from the real vLLM scheduler: reading, converting, re-simulating.

Format (data/vllm-recorded/README.md): line 1 the engine config, line 2
the requests with prompt token ids, then one line per step, last a summary.
``load_recording`` turns one into a scenario + workload + the recorded model
outputs (sampled tokens and drafts), which is all ``fidelity`` needs to re-run
our scheduler on the same inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from .config import Scenario
from .errors import InputError
from .safe_load import MAX_LINE_CHARS, read_json_lines
from .outputs import RecordedContinuation, RecordedDrafts
from .sched.groups import scenario_layout
from .workload.base import Workload, WorkloadRequest

_DT = {"torch.bfloat16": "bfloat16", "torch.float16": "float16", "torch.float32": "float32",
       "torch.float64": "float64"}
_DT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8}


@dataclass
class Recording:
    path: Path
    config: dict
    requests: list[dict]
    steps: list[dict]
    summary: dict | None
    scenario: Scenario
    workload: Workload
    output_streams: dict[str, list[int]]
    drafts: dict[tuple[str, int], list[int]]
    step_lines: list[int] = field(default_factory=list)  # the file line of each step

    def continuation(self) -> RecordedContinuation:
        return RecordedContinuation(self.output_streams, self.workload.vocab_size)

    def drafter(self) -> RecordedDrafts | None:
        return RecordedDrafts(self.drafts) if self.config.get("num_spec_tokens") else None


# (an MLA group is read as attention of the same bytes per token, as ``_geometry_from_groups`` reads it)
_KINDS = {"MambaSpec": "mamba", "FullAttentionSpec": "attention", "MLAAttentionSpec": "attention"}


def _draft_count(g: dict) -> int:
    """The drafter's layers in a recorded group: ``num_draft_layers`` when the recording lists
    it (bench/peer_vllm.py since issue 39), else every layer of an ``is_eagle_group`` (the
    drafter-only groups of earlier recordings)."""
    return g.get("num_draft_layers", g["num_layers"] if g.get("is_eagle_group") is True else 0)


def recorded_layout(cfg: dict, where: str) -> list[tuple[str, int, int]]:
    """The recording's KV-cache groups as (kind, target layers, drafter layers), or one
    InputError naming what of the layout this tool cannot model."""
    out = []
    sbs = cfg["scheduler_block_size"]
    for i, g in enumerate(cfg["kv_cache_groups"]):
        w = f"config: kv_cache_groups[{i}]"
        kind = _KINDS.get(g["spec"])
        if kind is None:
            raise InputError(f"config: unsupported KV cache group spec {g['spec']!r}", where)
        n, d = g["num_layers"], _draft_count(g)
        if type(d) is not int or not 0 <= d <= n:
            raise InputError(f"{w}: 'num_draft_layers' should be a whole number from 0 to num_layers ({n})", where)
        if d and g.get("is_eagle_group") is not True:
            raise InputError(f"{w}: holds {d} drafter layers but is not flagged is_eagle_group", where)
        if g.get("is_eagle_group") is True and not d:
            raise InputError(f"{w}: flagged is_eagle_group but holds no drafter layer (num_draft_layers 0)", where)
        if kind == "mamba" and d:
            raise InputError(f"{w}: a drafter with Mamba layers is not modelled (its Mamba state would need a "
                             "drafter of its own)", where)
        if kind != "mamba" and g["block_size"] != sbs:
            raise InputError(f"{w}: block size {g['block_size']} differs from scheduler_block_size {sbs} (the engine "
                             "resized this group's block to unify page sizes); this tool models every attention "
                             "group at the scheduler's block size", where)
        out.append((kind, n - d, d))
    return out


def _drafter(cfg: dict, where: str) -> dict[str, Any]:
    """The ``spec_decode`` keys of a config whose KV-cache groups include the drafter's
    (``is_eagle_group``): MTP when its layers share a group with the target's or that group is
    built like the target's attention (same spec and page size, as the engine builds an MTP
    layer), EAGLE otherwise; unless the recording names the method (``spec_method``)."""
    groups = cfg["kv_cache_groups"]
    eagle = [g for g in groups if g.get("is_eagle_group") is True]
    if not eagle:
        return {}
    if not cfg.get("num_spec_tokens"):
        raise InputError("config: a KV cache group has is_eagle_group but num_spec_tokens is 0", where)
    method = cfg.get("spec_method")
    if method not in ("mtp", "eagle"):
        d = eagle[0]
        target = [g for g in groups if g.get("is_eagle_group") is not True and g["spec"] == d["spec"]]
        mixed = any(_draft_count(g) < g["num_layers"] for g in eagle)
        method = "mtp" if mixed or any(g.get("page_size_bytes") == d.get("page_size_bytes") for g in target) \
            else "eagle"
    return {"method": method, "num_draft_layers": sum(_draft_count(g) for g in eagle)}


def _geometry_from_groups(groups: list[dict], num_spec: int, where: str) -> dict[str, Any]:
    model: dict[str, Any] = {}
    for g in groups:
        target = g["num_layers"] - _draft_count(g)
        if not target:
            continue  # the drafter's layers: spec_decode says what they are (``_drafter``)
        if g["spec"] == "MambaSpec":
            (conv_rows, conv_dim), temporal = g["shapes"][0], g["shapes"][1]
            heads, head_dim, d_state = temporal
            kernel = conv_rows - num_spec + 1
            n_groups = (conv_dim - heads * head_dim) // (2 * d_state)
            prev = model.get("mamba")
            model["mamba"] = dict(layers=(prev["layers"] if prev else 0) + target, heads=heads,
                                  head_dim=head_dim, d_state=d_state, n_groups=max(n_groups, 1),
                                  conv_kernel=kernel, chunk_size=g["block_size"],
                                  state_dtype=_DT[g["dtypes"][1]], conv_dtype=_DT[g["dtypes"][0]])
        elif g["spec"] in ("FullAttentionSpec", "MLAAttentionSpec"):
            per_token = g["page_size_bytes"] // g["block_size"]
            # K and V in bf16: kv_heads * head_dim = per_token / 4; split as 8 heads
            kvhd = per_token // 4
            prev = model.get("attention")
            model["attention"] = dict(layers=(prev["layers"] if prev else 0) + target, heads=8,
                                      kv_heads=8, head_dim=max(kvhd // 8, 1), dtype="bfloat16")
        else:
            raise InputError(f"config: unsupported KV cache group spec {g['spec']!r}", where)
    return model


def _need(d, key: str, typ, where: str, what: str = ""):
    """``d[key]`` when ``d`` is an object holding a ``typ`` there; else one InputError naming the key."""
    if not isinstance(d, dict):
        raise InputError(f"{what or 'this line'} should be a JSON object", where)
    if key not in d:
        raise InputError(f"{what + ': ' if what else ''}missing key {key!r}", where)
    v = d[key]
    if typ is int and (type(v) is not int) or typ is not int and not isinstance(v, typ):
        name = {int: "an integer", str: "a string", list: "a list", dict: "an object", bool: "true or false"}[typ]
        raise InputError(f"{what + ': ' if what else ''}key {key!r} should be {name}, got {json.dumps(v)[:40]}",
                         where)
    return v


def _int_lists(v, key: str, where: str, what: str) -> None:
    if not (isinstance(v, list) and all(isinstance(g, list) and all(type(b) is int for b in g) for g in v)):
        raise InputError(f"{what}: key {key!r} should be a list of block-id lists (one per KV cache group)", where)


def _check_config(cfg: dict, where: str) -> None:
    groups = _need(cfg, "kv_cache_groups", list, where, "config")
    if not groups:
        raise InputError("config: 'kv_cache_groups' is empty", where)
    for i, g in enumerate(groups):
        w = f"config: kv_cache_groups[{i}]"
        spec = _need(g, "spec", str, where, w)
        if "is_eagle_group" in g:
            _need(g, "is_eagle_group", bool, where, w)
        for key in ("block_size", "num_layers"):
            if _need(g, key, int, where, w) < 1:
                raise InputError(f"{w}: {key!r} should be at least 1", where)
        if spec == "MambaSpec":
            shapes, dtypes = _need(g, "shapes", list, where, w), _need(g, "dtypes", list, where, w)
            if not (len(shapes) == 2 and [len(x) if isinstance(x, list) else -1 for x in shapes] == [2, 3]
                    and all(type(v) is int for x in shapes for v in x)):
                raise InputError(f"{w}: 'shapes' should be [[conv rows, conv dim], [heads, head dim, state dim]]",
                                 where)
            if not (len(dtypes) == 2 and all(d in _DT for d in dtypes)):
                raise InputError(f"{w}: 'dtypes' should be two of {', '.join(_DT)}", where)
        elif spec in ("FullAttentionSpec", "MLAAttentionSpec"):
            _need(g, "page_size_bytes", int, where, w)
    if _need(cfg, "scheduler_block_size", int, where, "config") < 1:
        raise InputError("config: 'scheduler_block_size' should be at least 1", where)
    unit = cfg.get("hash_block_size")
    if unit is not None and (type(unit) is not int or unit < 1 or cfg["scheduler_block_size"] % unit):
        raise InputError(f"config: hash_block_size {json.dumps(unit)[:40]} should be a whole number that divides "
                         f"scheduler_block_size {cfg['scheduler_block_size']}", where)
    for key, typ in (("num_blocks", int), ("enable_prefix_caching", bool),
                     ("mamba_cache_mode", str), ("max_num_batched_tokens", int), ("max_num_seqs", int),
                     ("max_model_len", int), ("enable_chunked_prefill", bool), ("long_prefill_token_threshold", int),
                     ("policy", str)):
        _need(cfg, key, typ, where, "config")
    if cfg.get("num_spec_tokens") is not None:
        _need(cfg, "num_spec_tokens", int, where, "config")


def _check_requests(reqs, where: str) -> None:
    if not isinstance(reqs, list) or not reqs:
        raise InputError("requests: key 'requests' should be a non-empty list", where)
    seen: set[str] = set()
    for i, r in enumerate(reqs):
        w = f"requests[{i}]"
        rid = _need(r, "id", str, where, w)
        if rid in seen:
            raise InputError(f"{w}: request id {rid!r} appears twice", where)
        seen.add(rid)
        if _need(r, "arrival_step", int, where, w) < 0:
            raise InputError(f"{w}: 'arrival_step' should not be negative", where)
        if _need(r, "max_tokens", int, where, w) < 1:
            raise InputError(f"{w}: 'max_tokens' should be at least 1", where)
        prompt = _need(r, "prompt_token_ids", list, where, w)
        if not prompt or not all(type(t) is int and t >= 0 for t in prompt):
            raise InputError(f"{w}: 'prompt_token_ids' should be a non-empty list of token ids", where)


def _check_step(d: dict, where: str) -> None:
    """The keys of a step line that conversion and ``fidelity`` read, with their types."""
    _need(d, "step", int, where, "step")
    sched = _need(d, "num_scheduled_tokens", dict, where, "step")
    for key in ("scheduled_new_reqs", "scheduled_cached_reqs", "preempted_req_ids", "finished_req_ids"):
        _need(d, key, list, where, "step")
    _need(d, "num_free_blocks", int, where, "step")
    for kind, blocks_key in (("scheduled_new_reqs", "block_ids"), ("scheduled_cached_reqs", "new_block_ids")):
        for i, r in enumerate(d[kind]):
            w = f"{kind}[{i}]"
            rid = _need(r, "id", str, where, w)
            _need(r, "num_computed_tokens", int, where, w)
            if blocks_key not in r:
                raise InputError(f"{w}: missing key {blocks_key!r}", where)
            if r[blocks_key] is not None or kind == "scheduled_new_reqs":
                _int_lists(r[blocks_key], blocks_key, where, w)
            if type(sched.get(rid)) is not int:
                raise InputError(f"{w}: request {rid} has no token count in 'num_scheduled_tokens'", where)
    for key in ("scheduled_spec_decode_tokens", "sampled_token_ids", "drafts_proposed"):
        v = d.get(key)
        if v is not None and not (isinstance(v, dict) and all(isinstance(t, list) and all(type(x) is int for x in t)
                                                            for t in v.values())):
            raise InputError(f"step: key {key!r} should map request ids to token-id lists", where)
    if "block_copies" in d:
        from .trace import parse_block_copies
        parse_block_copies(d["block_copies"], "block_copies", where)
    proposed = {rid for rid, t in (d.get("drafts_proposed") or {}).items() if t}
    if proposed:
        after = d.get("after")
        if not isinstance(after, dict):
            raise InputError("step: drafts were proposed but key 'after' (per-request state) is missing", where)
        for rid in proposed:
            if after.get(rid) is not None:
                _need(after[rid], "num_tokens", int, where, f"after[{rid!r}]")


def is_vllm_recording(path: str | Path) -> bool:
    """Whether the first non-blank line of ``path`` is a vLLM recording's config line. Anything
    unreadable or not JSON answers False (the trace reader then names what is wrong)."""
    try:
        with Path(path).open("rb") as f:
            while raw := f.readline(MAX_LINE_CHARS + 1):  # (bounded: a hostile line is never held whole)
                if raw.strip():
                    d = json.loads(raw) if len(raw) <= MAX_LINE_CHARS else None
                    return isinstance(d, dict) and d.get("type") == "config" and "format" not in d
    except (OSError, ValueError, RecursionError):  # (a folder, no such file, not JSON, not UTF-8, too deep)
        pass
    return False


def load_recording(path: str | Path) -> Recording:
    p = Path(path)
    if not p.exists():
        raise InputError("no such file", str(p))
    if p.is_dir():
        raise InputError("is a folder, not a vLLM recording", str(p))
    parsed = list(read_json_lines(p))  # (hostile lines refused: safe_load)
    if (len(parsed) < 2 or not all(isinstance(d, dict) for _, d in parsed)
            or parsed[0][1].get("type") != "config" or parsed[1][1].get("type") != "requests"):
        bad = next((i for i, d in parsed if not isinstance(d, dict)), None)
        if bad is not None:
            raise InputError("each line of a vLLM recording is a JSON object", f"{p}:{bad}")
        if parsed and isinstance(parsed[0][1], dict) and parsed[0][1].get("format") == "hybridsim-trace":
            raise InputError("a hybridsim step trace, not a vLLM recording: replay or validate it as it is",
                             f"{p}:1")
        raise InputError("not a vLLM recording: line 1 must be the config and line 2 the requests",
                         f"{p}:1")
    (cfg_line, cfg), (req_line, req_d) = parsed[0], parsed[1]
    _check_config(cfg, f"{p}:{cfg_line}")
    reqs = req_d.get("requests")
    _check_requests(reqs, f"{p}:{req_line}")
    step_lines = [(i, d) for i, d in parsed[2:] if d.get("type") == "step"]
    for i, d in step_lines:
        _check_step(d, f"{p}:{i}")
    if not step_lines:
        raise InputError("the recording has no step lines after its config and requests", str(p))
    steps = [d for _, d in step_lines]
    summary = next((d for _, d in parsed if d.get("type") == "summary"), None)
    S = int(cfg.get("num_spec_tokens") or 0)
    layout = recorded_layout(cfg, f"{p}:{cfg_line}")
    try:
        raw = {
            "name": f"vllm-{cfg.get('workload', p.stem)}",
            "seed": 0,
            "model": _geometry_from_groups(cfg["kv_cache_groups"], S, f"{p}:{cfg_line}"),
            "cache": {"block_size": cfg["scheduler_block_size"], "num_blocks": cfg["num_blocks"],
                      "enable_prefix_caching": cfg["enable_prefix_caching"],
                      "mamba_cache_mode": cfg["mamba_cache_mode"],
                      # (below the block size: partial-block prefix hits, vLLM's prefix_match_unit)
                      **({"prefix_match_unit": cfg["hash_block_size"]}
                         if cfg.get("hash_block_size", cfg["scheduler_block_size"]) != cfg["scheduler_block_size"]
                         else {})},
            "scheduler": {"max_num_batched_tokens": cfg["max_num_batched_tokens"],
                          "max_num_seqs": cfg["max_num_seqs"], "max_model_len": cfg["max_model_len"],
                          "enable_chunked_prefill": cfg["enable_chunked_prefill"],
                          "long_prefill_token_threshold": cfg["long_prefill_token_threshold"],
                          "policy": cfg["policy"]},
            "spec_decode": {"num_speculative_tokens": S, "acceptance": {"kind": "none"},
                            **_drafter(cfg, f"{p}:{cfg_line}")},
            "workload": {"kind": "trace", "format": "vllm-recorded", "path": str(p)},
            "execution": {"max_steps": max(len(steps) * 4, 1000), "check": "full"},
        }
        scenario = Scenario.model_validate(raw)
        if [(g.kind, len(g.layers), len(g.draft_layers)) for g in scenario_layout(scenario)] != layout:
            # (the recorded groups are not what the engine's rules form from the default layer
            # order: the scenario carries them as recorded)
            raw["model"]["kv_cache_groups"] = [dict(kind=k, layers=n, draft_layers=d) for k, n, d in layout]
            scenario = Scenario.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise InputError(f"the engine config does not make a scenario this tool can run: "
                         f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}", f"{p}:{cfg_line}") from None
    vocab = 1 + max(max(r["prompt_token_ids"]) for r in reqs)
    wreqs = [WorkloadRequest(r["id"], int(r["arrival_step"]), tuple(r["prompt_token_ids"]), int(r["max_tokens"]))
             for r in reqs]
    streams: dict[str, list[int]] = {r["id"]: [] for r in reqs}
    drafts: dict[tuple[str, int], list[int]] = {}
    for s in steps:
        for rid, toks in (s.get("sampled_token_ids") or {}).items():
            streams.setdefault(rid, []).extend(toks)
        for rid, d in (s.get("drafts_proposed") or {}).items():
            after = s["after"].get(rid)
            if after is not None and d:
                drafts[(rid, after["num_tokens"])] = list(d)
    vocab = max(vocab, 1 + max((max(v) for v in streams.values() if v), default=0))
    workload = Workload(wreqs, max(vocab, 16), f"vllm-recorded:{p.name}")
    return Recording(p, cfg, reqs, steps, summary, scenario, workload, streams, drafts,
                     [i for i, _ in step_lines])
