"""Random small workloads planned by us and by vLLM 0.33's scheduler, compared step by step.

    .venv/bin/python bench/peer_fuzz.py write DIR [--count 40] [--seed 1]
    .peer-venv/bin/python bench/peer_vllm.py DIR/fuzz_*.json --repeat 0 --steps-dir DIR
    .venv/bin/python bench/peer_fuzz.py compare DIR

Where the named workloads (bench_planner.py --export) are large and regular, these are small
and awkward: pools a few blocks above one longest request (so preemption and resumption are
common), token budgets and seats from tight to loose, a long-prefill threshold or none,
prompts of every length from one token up, many of them whole multiples of the block size,
prefixes shared between prompts (a prompt may be a prefix or an exact copy of another), and
outputs that stop at max_model_len. Each file holds its config, prompts and the outputs both
sides commit (the Mamba2 + attention config of the recordings: align mode, block 16, prefix
caching). ``compare`` prints each workload's share of identical steps and the first
differing steps, and exits 1 if any step differs anywhere. ``write --at-minimum`` sizes each pool
at scenario validation's minimum for the workload instead (or one or two blocks above it).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from bench_planner import accepted_rounds
from peer_compare import compare, scenario_from_export, simulation_from_export, steps_from_export

from hybridsim.config import min_blocks_per_request, peak_tokens
from hybridsim.errors import InputError

BS = 16


def make_workload(name: str, rnd: random.Random, mode: str = "align", BS: int = BS) -> dict:
    max_len = rnd.choice([128, 256, 512, 1024])
    # one longest request: its attention blocks, and the Mamba group's (previous state,
    # prefill checkpoint, running state); then from no room to spare to a roomy pool
    floor = -(-max_len // BS) + 3 + 1
    num_blocks = floor + rnd.choice([0, 1, 2, 5, 10, 30, 100])
    budget = rnd.choice([32, 48, 64, 100, 128, 256, 512, 2048])
    seats = rnd.choice([1, 2, 3, 4, 8, 16, 32])
    thr = rnd.choice([0, 0, 0, 17, 40, 64, 200])
    vocab = rnd.choice([50, 30000])  # a small vocabulary repeats blocks inside a prompt

    def tokens(n: int) -> list[int]:
        return [rnd.randrange(1, vocab) for _ in range(n)]

    shared = [tokens(rnd.randrange(1, max_len // 2)) for _ in range(rnd.randrange(1, 4))]
    reqs: list[dict] = []
    per_step = rnd.choice([1, 2, 3, 6])
    for i in range(rnd.randrange(6, 50)):
        max_tokens = rnd.choice([1, 2, 5, 20, 60, max_len])
        kind = rnd.random()
        if kind < 0.35:
            length = BS * rnd.randrange(1, max_len // BS)  # a whole number of blocks
        elif kind < 0.45:
            length = rnd.randrange(1, BS)
        else:
            length = rnd.randrange(1, max_len)
        if reqs and rnd.random() < 0.15:  # the same prompt again (a full hit)
            prompt = list(rnd.choice(reqs)["prompt"])
        elif rnd.random() < 0.6:
            base = rnd.choice(shared)
            prompt = (base + tokens(max(length - len(base), 0)))[:max(length, 1)]
        else:
            prompt = tokens(length)
        prompt = prompt[:max_len - 1]
        reqs.append({"id": f"r{i}", "arrival_step": i // per_step, "prompt": prompt, "max_tokens": max_tokens,
                     "outputs": tokens(max_tokens + 8)})
    return {"workload": name, "steady_steps": 0, "block_size": BS, "num_blocks": num_blocks,
            "mamba_cache_mode": mode, "enable_prefix_caching": mode != "none", "max_num_batched_tokens": budget, "max_num_seqs": seats,
            "max_model_len": max_len, "long_prefill_token_threshold": thr, "num_speculative_tokens": 0,
            "accepted": {}, "requests": reqs}


# The drafter recordings kept in data/vllm-recorded/ (``named``): name -> (seed, drafter, drafts,
# draft layers, block size, Mamba groups, pool: "roomy" or blocks above validation's minimum)
NAMED = {
    "mtp1": (101, "mtp", 1, 1, 16, 1, "roomy"),
    "mtp3_pressure": (102, "mtp", 3, 1, 16, 1, 1),
    "eagle3": (103, "eagle", 3, 1, 16, 1, "roomy"),
    "eagle3_pressure": (104, "eagle", 3, 1, 16, 1, 0),
    "mtp3_block64": (105, "mtp", 3, 1, 64, 1, 2),
    "nemotron8b_mtp2": (106, "mtp", 2, 1, 16, 6, 1),
}


def named_workload(name: str) -> dict:
    """One of the ``NAMED`` drafter workloads: a random workload of its seed, cut to a dozen
    requests of at most 40 output tokens (recordings stay small), with shared prefixes,
    drafts accepted at rate 0.7, and its drafter, block size, layout and pool."""
    seed, method, S, layers, bs, mamba_groups, pool = NAMED[name]
    w = make_workload(name, random.Random(seed), "align", bs)
    w["requests"] = w["requests"][:12]
    for r in w["requests"]:
        r["max_tokens"] = min(r["max_tokens"], 40)
        r["outputs"] = r["outputs"][:r["max_tokens"] + 8]
    w.update(block_size=bs, num_speculative_tokens=S, acceptance_rate=0.7, seed=seed, spec_method=method,
             num_draft_layers=layers, long_prefill_token_threshold=0,
             max_num_batched_tokens=max(w["max_num_batched_tokens"], 2 * bs))
    if mamba_groups > 1:
        w["mamba_groups"] = mamba_groups
    w["num_blocks"] = 1 << 20  # (validation sees the minimum only once the pool holds it)
    least = pool_minimum(w)
    w["num_blocks"] = 4 * least if pool == "roomy" else least + 1 + pool
    w["accepted"] = accepted_rounds(simulation_from_export(w))
    return w


# The layout recordings kept in data/vllm-recorded/layouts/ (``named --layouts``): name -> (seed,
# layer pattern, drafter, drafts, draft layers, block size, prefix_match_unit, pool: blocks above
# validation's minimum); the engine forms the groups from the pattern and the drafter
NAMED_LAYOUTS = {
    # the layout: 2 Mamba groups of 3, one attention group of 2 target layers + the MTP layer
    "mixed_mtp_pressure": (201, "MMMAMMMA", "mtp", 2, 1, 16, 16, 2),
    "mixed_mtp_partial": (202, "MMMAMMMA", "mtp", 2, 1, 64, 16, 2),
    # buckets 9 Mamba, 6 attention (3 target + 3 MTP): groups of 6, Mamba split 5 + 4 (padding)
    "mtp3_qwen_like": (203, "MMMAMMMAMMMA", "mtp", 3, 3, 16, 16, 3),
    # attention listed first; EAGLE heads a bucket of their own: groups of 2
    "eagle2_attention_first": (204, "AAMMMMMM", "eagle", 2, 2, 16, 16, 2),
}


# requests kept of a layout workload (data/ stays lean: fewer where the layout has many groups)
LAYOUT_REQUESTS = {"eagle2_attention_first": 5}


def named_layout_workload(name: str) -> dict:
    """One of the ``NAMED_LAYOUTS`` workloads: a random workload of its seed cut as
    ``named_workload`` cuts one, with its layer pattern, drafter, block, unit and pool."""
    seed, pattern, method, S, layers, bs, unit, pool = NAMED_LAYOUTS[name]
    w = make_workload(name, random.Random(seed), "align", bs)
    w["requests"] = w["requests"][:LAYOUT_REQUESTS.get(name, 14)]
    for r in w["requests"]:
        r["max_tokens"] = min(r["max_tokens"], 40)
        r["outputs"] = r["outputs"][:r["max_tokens"] + 8]
    w.update(block_size=bs, layer_pattern=pattern, num_speculative_tokens=S, acceptance_rate=0.7, seed=seed,
             spec_method=method, num_draft_layers=layers, long_prefill_token_threshold=0,
             max_num_batched_tokens=max(w["max_num_batched_tokens"], 2 * bs))
    if unit != bs:
        w["prefix_match_unit"] = unit
    w["num_blocks"] = 1 << 20
    w["num_blocks"] = pool_minimum(w) + 1 + pool
    w["accepted"] = accepted_rounds(simulation_from_export(w))
    return w


def pool_minimum(w: dict) -> int:
    """Scenario validation's minimum pool (usable blocks) for an export's requests, outputs
    included (``scenario_from_export`` validates prompts alone)."""
    s = scenario_from_export(w)
    return min_blocks_per_request(s, max(peak_tokens(s, len(r["prompt"]), r["max_tokens"]) for r in w["requests"]))


def draw_pattern(rnd: random.Random) -> str:
    """A target layer pattern (M Mamba, A attention, model order): 1-40 Mamba and 1-8 attention
    layers, interleaved periodically (as Nemotron-H, Jamba, Qwen3-Next), at random, in runs, or
    with attention first."""
    m, a = rnd.randint(1, 40), rnd.randint(1, 8)
    style = rnd.choice(["periodic", "random", "runs", "attention_first"])
    if style == "periodic":
        out, left_m, left_a = [], m, a
        every = max(1, m // a)
        while left_m or left_a:
            take = min(every, left_m)
            out += ["M"] * take
            left_m -= take
            if left_a:
                out.append("A")
                left_a -= 1
        return "".join(out)
    letters = ["M"] * m + ["A"] * a
    if style == "random":
        rnd.shuffle(letters)
        return "".join(letters)
    if style == "runs":
        return "".join(letters)
    return "A" * a + "M" * m


def draw_layout(w: dict, rnd: random.Random) -> None:
    """A layer pattern and a drafter for workload ``w``: 0-3 draft layers of MTP or EAGLE
    (0: no drafter, or the n-gram one), 1-3 drafts."""
    w["layer_pattern"] = draw_pattern(rnd)
    layers = rnd.choice([0, 1, 1, 2, 3])
    if layers or rnd.random() < 0.3:
        w.update(num_speculative_tokens=rnd.choice([1, 2, 3]), acceptance_rate=rnd.choice([0.3, 0.7, 1.0]),
                 seed=rnd.randrange(1 << 16))
        if layers:
            w.update(spec_method=rnd.choice(["mtp", "eagle"]), num_draft_layers=layers)


def write(out: Path, count: int, seed: int, modes: tuple[str, ...] = ("align",), drafts: bool = False,
          at_minimum: bool = False, drafters: tuple[str, ...] = ("ngram",),
          mamba_groups: tuple[int, ...] = (1,), block_size: int = BS, units: tuple[int, ...] = (),
          multi_module: bool = True, layouts: bool = False) -> None:
    """``drafts``: half of the workloads draft 1-3 tokens a step, accepted by a Bernoulli model
    (ours decides, round by round; the export's ``accepted`` makes the peer's drafts as right).
    ``drafters``: the drafter kinds a workload with drafts draws from (ngram, mtp, eagle; MTP
    with one or as many draft layers as drafts).
    ``at_minimum``: each pool is scenario validation's minimum for the workload (outputs
    included) or one or two blocks more, so both sides plan right at the edge validation draws.
    ``layouts``: each workload draws a layer pattern and a drafter (``draw_layout``; both sides
    form the KV-cache groups from them) and a pool from the minimum for them to a roomy one."""
    out.mkdir(parents=True, exist_ok=True)
    written = 0
    k = 0
    while written < count:
        name = f"fuzz_{seed}_{k}"
        # (mode and drafts draw from streams of their own: earlier seeds' workloads are unchanged)
        mode = random.Random(f"{seed}/{k}/mode").choice(modes)
        w = make_workload(name, random.Random(f"{seed}/{k}"), mode, block_size)
        if block_size != BS:
            w["max_num_batched_tokens"] = max(w["max_num_batched_tokens"], 2 * block_size)
        unit = random.Random(f"{seed}/{k}/unit").choice(units) if units else block_size
        if unit != block_size:  # (vLLM 0.33's prefix_match_unit: partial-block prefix hits)
            w["prefix_match_unit"] = unit
        layout = random.Random(f"{seed}/{k}/layout").choice(mamba_groups)
        if layout > 1:  # (the Nemotron-H-8B layout: several Mamba groups beside one attention group)
            w["mamba_groups"] = layout
        spec = random.Random(f"{seed}/{k}/drafts")
        if drafts and spec.random() < 0.5:
            w.update(num_speculative_tokens=spec.choice([1, 2, 3]), acceptance_rate=spec.choice([0.3, 0.7, 1.0]),
                     seed=spec.randrange(1 << 16))
            # (a stream of its own: the workloads of earlier seeds and flags are unchanged)
            kind = random.Random(f"{seed}/{k}/drafter")
            method = kind.choice(drafters)
            if method != "ngram":
                layers = kind.choice([1, w["num_speculative_tokens"]]) if method == "mtp" else 1
                w.update(spec_method=method, num_draft_layers=layers if multi_module else 1)
                # (a drafter with layers of its own: the groups the engine forms from the layers, on both
                # sides. The recordings' fixed groups, the drafter's apart from the target's, are not what
                # it forms: an MTP layer joins the target attention's bucket, so with six Mamba groups of
                # four it makes five of five, and three MTP modules beside one attention layer make four
                # attention groups of one; the peer then planned another layout and stalled at pools our
                # planner fills)
                w["layer_pattern"] = ("M" * (4 * layout) + "A" * 4) if layout > 1 else "MA"
        if layouts:  # (a stream of its own)
            draw_layout(w, random.Random(f"{seed}/{k}/layers"))
        k += 1
        try:  # a config our validation refuses is drawn again
            if layouts:
                w["num_blocks"] = 1 << 20
                w["num_blocks"] = pool_minimum(w) + 1 + random.Random(f"{name}/pool").choice(
                    [0, 0, 1, 2, 5, 20, 100, 400])
            elif at_minimum:
                w["num_blocks"] = pool_minimum(w) + 1 + random.Random(f"{name}/pool").choice([0, 0, 1, 2])
            sim = simulation_from_export(w)
        except InputError:
            continue
        if w["num_speculative_tokens"]:
            w["accepted"] = accepted_rounds(sim)
        (out / f"{name}.json").write_text(json.dumps(w))
        written += 1
    print(f"{count} workloads written to {out}")


def _bad_input(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def compare_dir(out: Path, show: int) -> bool:
    files = sorted(p for p in out.glob("fuzz_*.json") if not p.name.endswith(".steps.json"))
    if not files:
        _bad_input(f"{out}: no fuzz_*.json workloads (run `peer_fuzz.py write {out}` first)")
    ok = 0
    for path in files:
        steps = path.with_name(f"{path.stem}.steps.json")
        if not steps.exists():
            _bad_input(f"{steps}: missing (run bench/peer_vllm.py on the workloads with --steps-dir)")
        w = json.loads(path.read_text())
        try:
            ours = steps_from_export(w)
        except InputError as e:  # (a workload written by hand, or validation since tightened)
            _bad_input(f"{path}: our scenario validation refuses it: {e}")
        ok += compare(w["workload"], ours, json.loads(steps.read_text()), show)
    print(f"{ok} of {len(files)} workloads identical at every step")
    return ok == len(files)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write", help="write random workloads")
    w.add_argument("dir", type=Path)
    w.add_argument("--count", type=int, default=40)
    w.add_argument("--seed", type=int, default=1)
    w.add_argument("--drafts", action="store_true", help="half of the workloads with speculative drafts")
    w.add_argument("--at-minimum", action="store_true",
                   help="pools at scenario validation's minimum for each workload (outputs included), or 1-2 more")
    w.add_argument("--modes", default="align", help="Mamba cache modes to draw from, comma-separated: "
                   "align, none (none: prefix caching off; vLLM 0.33 has no mode all)")
    w.add_argument("--drafters", default="ngram", help="drafter kinds to draw from with --drafts, "
                   "comma-separated: ngram, mtp, eagle")
    w.add_argument("--mamba-groups", default="1", help="Mamba group counts to draw from, comma-separated "
                   "(6: the Nemotron-H-8B layout, 24 Mamba and 4 attention layers)")
    nm = sub.add_parser("named", help="write the drafter workloads recorded in data/vllm-recorded/")
    nm.add_argument("dir", type=Path)
    nm.add_argument("--layouts", action="store_true", help="the layout workloads (data/vllm-recorded/layouts/)")
    w.add_argument("--one-module", action="store_true",
                   help="MTP drafters with one module only (by default: one, or as many as drafts)")
    w.add_argument("--block-size", type=int, default=BS, help="the block size (16 or 64)")
    w.add_argument("--match-units", default="", help="prefix_match_unit values to draw from, comma-separated "
                   "(below the block size: partial-block prefix hits)")
    w.add_argument("--layouts", action="store_true",
                   help="random layer patterns (1-40 Mamba, 1-8 attention layers, interleaved) and drafters "
                        "(0-3 MTP or EAGLE layers); both sides form the KV-cache groups from them")
    c = sub.add_parser("compare", help="compare our plans with the peer's steps")
    c.add_argument("dir", type=Path)
    c.add_argument("--show", type=int, default=3, help="differing steps to print per workload")
    args = ap.parse_args()
    if args.cmd == "write":
        if args.count < 1:
            ap.error("--count: 1 or more")
        modes = tuple(args.modes.split(","))
        if not set(modes) <= {"align", "none"}:
            ap.error("--modes: align and/or none, comma-separated (vLLM 0.33 has no mode all)")
        drafters = tuple(args.drafters.split(","))
        if not drafters or not set(drafters) <= {"ngram", "mtp", "eagle"}:
            ap.error("--drafters: ngram, mtp and/or eagle, comma-separated")
        try:
            layouts = tuple(int(x) for x in args.mamba_groups.split(","))
        except ValueError:
            ap.error("--mamba-groups: whole numbers, comma-separated")
        if min(layouts) < 1:
            ap.error("--mamba-groups: 1 or more")
        if args.block_size not in (16, 64):
            ap.error("--block-size: 16 or 64")
        try:
            units = tuple(int(x) for x in args.match_units.split(",")) if args.match_units else ()
        except ValueError:
            ap.error("--match-units: whole numbers, comma-separated")
        if any(u < 1 or args.block_size % u for u in units):
            ap.error(f"--match-units: each must divide the block size ({args.block_size})")
        write(args.dir, args.count, args.seed, modes, args.drafts, args.at_minimum, drafters, layouts,
              args.block_size, units, not args.one_module, args.layouts)
    elif args.cmd == "named":
        args.dir.mkdir(parents=True, exist_ok=True)
        named, make = (NAMED_LAYOUTS, named_layout_workload) if args.layouts else (NAMED, named_workload)
        for name in named:
            (args.dir / f"{name}.json").write_text(json.dumps(make(name)))
        print(f"{len(named)} workloads written to {args.dir}")
    else:
        sys.exit(0 if compare_dir(args.dir, args.show) else 1)


if __name__ == "__main__":
    main()
