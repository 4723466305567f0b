"""The KV-cache groups vLLM 0.33 forms for layer patterns and drafters, as JSON (peer side).

    .peer-venv/bin/python bench/peer_layouts.py CASES.json

CASES.json: a list of {"layer_pattern": "MMAMMA", "spec_method": "mtp" | "eagle" | "ngram",
"num_draft_layers": N, "num_speculative_tokens": S}. Prints, per case, the groups of the
scheduler bench/peer_vllm.py builds for it (the engine's ``get_global_kv_cache_groups``): each
group's kind, its layers as (M | A | D, index among the layers of that letter) and its
``is_eagle_group`` flag; tests/test_peer.py sets them beside sched/groups.py's ``form_layout``.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peer_vllm import make_scheduler  # noqa: E402


def layer_ids(pattern: str, names: list[str]) -> list[list]:
    """Each layer name as [letter, index among the pattern's layers of that letter] (D: drafter)."""
    out = []
    for name in names:
        m = re.match(r"draft\.layers\.(\d+)\.", name)
        if m:
            out.append(["D", int(m.group(1))])
            continue
        i = int(re.match(r"model\.layers\.(\d+)\.", name).group(1))
        out.append([pattern[i], pattern[:i].count(pattern[i])])
    return out


def groups_of(case: dict) -> list[dict]:
    S = case.get("num_speculative_tokens", 0)
    w = {"block_size": 16, "num_speculative_tokens": S, "max_num_batched_tokens": 256, "max_num_seqs": 8,
         "max_model_len": 1024, "mamba_cache_mode": "align", "num_blocks": 1000,
         "layer_pattern": case["layer_pattern"], "spec_method": case.get("spec_method", "ngram"),
         "num_draft_layers": case.get("num_draft_layers", 1)}
    sched = make_scheduler(w)
    return [{"spec": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
             "layers": layer_ids(case["layer_pattern"], list(g.layer_names)), "is_eagle_group": bool(g.is_eagle_group)}
            for g in sched.kv_cache_config.kv_cache_groups]


def main() -> None:
    cases = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps([groups_of(c) for c in cases]))


if __name__ == "__main__":
    main()
