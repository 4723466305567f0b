"""Workload builders: deterministic tokens, shared prefixes, real-trace importers."""

from __future__ import annotations

import pytest

from hybridsim.config import parse_scenario
from hybridsim.errors import InputError
from hybridsim.workload import build_workload
from hybridsim.workload.tokens import stream_token, token_block, token_segments

from .conftest import need_shared, tiny_scenario


def test_token_stream_scalar_matches_vector():
    v = token_block(12345, 50, 1000, start=7)
    assert [stream_token(12345, 7 + i, 1000) for i in range(50)] == v.tolist()
    assert v.min() >= 1 and v.max() < 1000


def test_token_segments_match_one_stream_at_a_time():
    seeds = [3, (1 << 63) + 5, 77, -9]  # a negative seed is taken mod 2^64 as token_block does
    lengths = [5, 1, 40, 12]
    got = token_segments(seeds, lengths, 32000)
    assert got == [token_block(s, n, 32000).tolist() for s, n in zip(seeds, lengths)]


def test_shared_prefix_is_shared_and_rest_differs():
    wl = build_workload(parse_scenario(tiny_scenario(frac=1.0, prefix=40, pmin=60, pmax=90, n=6), "t.yaml"))
    ps = [r.prompt for r in wl.requests]
    assert all(p[:40] == ps[0][:40] for p in ps)
    assert len({p[40:50] for p in ps}) == len(ps)


def _trace_scenario(shared, fmt, path, extra=""):
    return f"""
name: t
model: {{preset: tiny-hybrid}}
cache: {{block_size: 16, num_blocks: 60000}}
scheduler: {{max_num_batched_tokens: 4096, max_num_seqs: 64, max_model_len: 32768}}
workload: {{kind: trace, format: {fmt}, path: {shared / path}, limit: 50 {extra}}}
"""


def test_mooncake_equal_hash_ids_give_equal_tokens():
    shared = need_shared()
    import json
    rows = [json.loads(l) for l in (shared / "traces-real/mooncake/conversation_trace.jsonl").open()][:50]
    text = _trace_scenario(shared, "mooncake", "traces-real/mooncake/conversation_trace.jsonl",
                           ", length_scale: 0.05, arrival: {kind: fixed, per_step: 4}")
    wl = build_workload(parse_scenario(text, "t.yaml"))
    per_hash = round(512 * 0.05)
    byid = {r.req_id: r for r in wl.requests}
    # rows 0 and 1 share hash id 0 (their first block) and nothing else
    a, b = byid["r0"].prompt, byid["r1"].prompt
    assert rows[0]["hash_ids"][0] == rows[1]["hash_ids"][0] and rows[0]["hash_ids"][1] != rows[1]["hash_ids"][1]
    assert a[:per_hash] == b[:per_hash] and a[per_hash:2 * per_hash] != b[per_hash:2 * per_hash]
    assert len(a) == round(rows[0]["input_length"] * 0.05)
    assert byid["r0"].max_tokens == round(rows[0]["output_length"] * 0.05)
    assert [r.arrival_step for r in wl.requests[:8]] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_azure_timestamps_become_steps():
    shared = need_shared()
    text = _trace_scenario(shared, "azure", "traces-real/azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
                           ", arrival: {kind: timestamps, step_seconds: 1.0}")
    wl = build_workload(parse_scenario(text, "t.yaml"))
    assert wl.requests[0].arrival_step == 0 and len(wl.requests[0].prompt) == 374
    assert wl.requests[1].arrival_step == 4  # 4.31 s later
    assert wl.requests[1].max_tokens == 109


def test_vidur_length_file_needs_an_arrival_process():
    shared = need_shared()
    text = _trace_scenario(shared, "vidur", "traces-real/vidur-processed/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv")
    with pytest.raises(InputError) as ei:
        build_workload(parse_scenario(text, "t.yaml"))
    assert "workload.arrival" in str(ei.value)


def test_malformed_trace_row_names_line(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 5}\n')
    text = f"""
name: t
model: {{preset: tiny-hybrid}}
cache: {{block_size: 16, num_blocks: 600}}
workload: {{kind: trace, format: mooncake, path: {bad}}}
"""
    with pytest.raises(InputError) as ei:
        build_workload(parse_scenario(text, "t.yaml"))
    assert ei.value.where == f"{bad}:2"
