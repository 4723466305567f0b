"""Step traces recorded from the real vLLM scheduler: reading, converting, re-simulating.

Format (data/vllm-recorded/README.md): line 1 the engine config, line 2
the requests with prompt token ids, then one line per step, last a summary.
``load_recording`` turns one into a scenario + workload + the recorded model
outputs (sampled tokens and drafts), which is all ``fidelity`` needs to re-run
our scheduler on the same inputs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Scenario
from .errors import InputError, not_json, read_text
from .outputs import RecordedContinuation, RecordedDrafts
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

    def continuation(self) -> RecordedContinuation:
        return RecordedContinuation(self.output_streams, self.workload.vocab_size)

    def drafter(self) -> RecordedDrafts | None:
        return RecordedDrafts(self.drafts) if self.config.get("num_spec_tokens") else None


def _geometry_from_groups(groups: list[dict], num_spec: int) -> dict[str, Any]:
    model: dict[str, Any] = {}
    for g in groups:
        if g["spec"] == "MambaSpec":
            (conv_rows, conv_dim), temporal = g["shapes"][0], g["shapes"][1]
            heads, head_dim, d_state = temporal
            kernel = conv_rows - num_spec + 1
            n_groups = (conv_dim - heads * head_dim) // (2 * d_state)
            prev = model.get("mamba")
            model["mamba"] = dict(layers=(prev["layers"] if prev else 0) + g["num_layers"], heads=heads,
                                  head_dim=head_dim, d_state=d_state, n_groups=max(n_groups, 1),
                                  conv_kernel=kernel, chunk_size=g["block_size"],
                                  state_dtype=_DT[g["dtypes"][1]], conv_dtype=_DT[g["dtypes"][0]])
        elif g["spec"] in ("FullAttentionSpec", "MLAAttentionSpec"):
            per_token = g["page_size_bytes"] // g["block_size"]
            # K and V in bf16: kv_heads * head_dim = per_token / 4; split as 8 heads
            kvhd = per_token // 4
            prev = model.get("attention")
            model["attention"] = dict(layers=(prev["layers"] if prev else 0) + g["num_layers"], heads=8,
                                      kv_heads=8, head_dim=max(kvhd // 8, 1), dtype="bfloat16")
        else:
            raise InputError(f"unsupported KV cache group spec {g['spec']!r}")
    return model


def load_recording(path: str | Path) -> Recording:
    p = Path(path)
    if not p.exists():
        raise InputError("no such file", str(p))
    lines = read_text(p).splitlines()
    parsed = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            parsed.append((i, json.loads(line)))
        except json.JSONDecodeError as e:
            raise not_json(e, f"{p}:{i}") from None
    if len(parsed) < 2 or parsed[0][1].get("type") != "config" or parsed[1][1].get("type") != "requests":
        raise InputError("not a vLLM recording: line 1 must be the config and line 2 the requests",
                         f"{p}:1")
    cfg = parsed[0][1]
    reqs = parsed[1][1]["requests"]
    steps = [d for _, d in parsed[2:] if d.get("type") == "step"]
    summary = next((d for _, d in parsed if d.get("type") == "summary"), None)
    S = int(cfg.get("num_spec_tokens") or 0)
    scenario = Scenario.model_validate({
        "name": f"vllm-{cfg.get('workload', p.stem)}",
        "seed": 0,
        "model": _geometry_from_groups(cfg["kv_cache_groups"], S),
        "cache": {"block_size": cfg["scheduler_block_size"], "num_blocks": cfg["num_blocks"],
                  "enable_prefix_caching": cfg["enable_prefix_caching"],
                  "mamba_cache_mode": cfg["mamba_cache_mode"]},
        "scheduler": {"max_num_batched_tokens": cfg["max_num_batched_tokens"],
                      "max_num_seqs": cfg["max_num_seqs"], "max_model_len": cfg["max_model_len"],
                      "enable_chunked_prefill": cfg["enable_chunked_prefill"],
                      "long_prefill_token_threshold": cfg["long_prefill_token_threshold"],
                      "policy": cfg["policy"]},
        "spec_decode": {"num_speculative_tokens": S, "acceptance": {"kind": "none"}},
        "workload": {"kind": "trace", "format": "vllm-recorded", "path": str(p)},
        "execution": {"max_steps": max(len(steps) * 4, 1000), "check": "full"},
    })
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
    return Recording(p, cfg, reqs, steps, summary, scenario, workload, streams, drafts)
