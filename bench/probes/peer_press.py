"""A memory-pressure workload compared step by step with vLLM 0.33 (resumed block-multiple prefills).

    .venv/bin/python bench/probes/peer_press.py write /tmp/press.json
    .peer-venv/bin/python bench/peer_vllm.py /tmp/press.json --repeat 1 --steps /tmp/press.steps.json
    .venv/bin/python bench/probes/peer_press.py compare /tmp/press.json /tmp/press.steps.json

60 requests, 160 blocks, budget 256, 16 seats; half the prompts are block multiples and many
share 320- or 480-token prefixes (some prompts are a prefix of a shared one). It found two
differences about resumed requests (docs/fidelity.md, points 1 and 3): 2026-11-23, 317 of 334
steps identical before, 334 of 334 after.
The model's outputs are the ones written in the file (random tokens), on both sides.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peer_compare import compare, steps_from_export  # noqa: E402

BLOCKS, BUDGET, SEATS, MAX_LEN = 160, 256, 16, 4096


def make_workload() -> dict:
    rnd = random.Random(11)

    def tokens(n: int) -> list[int]:
        return [rnd.randrange(100, 30000) for _ in range(n)]

    shared = [tokens(320), tokens(480)]
    reqs = []
    for i in range(60):
        length = rnd.choice([16 * rnd.randrange(8, 40), rnd.randrange(100, 640)])
        base = rnd.choice(shared + [[]])
        prompt = (base + tokens(length))[:max(length, 20)] if base else tokens(length)
        reqs.append({"id": f"r{i}", "arrival_step": i // 3, "prompt": prompt, "max_tokens": rnd.randrange(5, 60),
                     "outputs": tokens(80)})
    return {"workload": "press", "steady_steps": 0, "block_size": 16, "num_blocks": BLOCKS,
            "mamba_cache_mode": "align", "max_num_batched_tokens": BUDGET, "max_num_seqs": SEATS,
            "max_model_len": MAX_LEN, "num_speculative_tokens": 0, "accepted": {},
            "requests": reqs}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "write":
        Path(sys.argv[2]).write_text(json.dumps(make_workload()))
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        w = json.loads(Path(sys.argv[2]).read_text())
        compare("press", steps_from_export(w), json.loads(Path(sys.argv[3]).read_text()), 3)
    else:
        raise SystemExit(__doc__.split("\n\n")[1])


if __name__ == "__main__":
    main()
