"""Workload builders: deterministic tokens, shared prefixes, real-trace importers."""

from __future__ import annotations

import pytest

from hybridsim.config import parse_scenario
from hybridsim.errors import InputError
from hybridsim.workload import build_workload
from hybridsim.workload.tokens import stream_token, token_block, token_segments

from .conftest import DATA, tiny_scenario


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


def _trace_scenario(fmt, path, extra=""):
    return f"""
name: t
model: {{preset: tiny-hybrid}}
cache: {{block_size: 16, num_blocks: 60000}}
scheduler: {{max_num_batched_tokens: 4096, max_num_seqs: 64, max_model_len: 32768}}
workload: {{kind: trace, format: {fmt}, path: {DATA / path}, limit: 50 {extra}}}
"""


def _small_trace_scenario(fmt: str, path, workload_extra: str = "") -> str:
    """A scenario over a trace file written by the test (a 600-block pool)."""
    return f"""
name: t
model: {{preset: tiny-hybrid}}
cache: {{block_size: 16, num_blocks: 600}}
workload: {{kind: trace, format: {fmt}, path: {path}{workload_extra}}}
"""


def test_mooncake_equal_hash_ids_give_equal_tokens():
    import json
    rows = [json.loads(l) for l in (DATA / "mooncake/conversation_trace.jsonl").open()][:50]
    text = _trace_scenario("mooncake", "mooncake/conversation_trace.jsonl",
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
    text = _trace_scenario("azure", "azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
                           ", arrival: {kind: timestamps, step_seconds: 1.0}")
    wl = build_workload(parse_scenario(text, "t.yaml"))
    assert wl.requests[0].arrival_step == 0 and len(wl.requests[0].prompt) == 374
    assert wl.requests[1].arrival_step == 4  # 4.31 s later
    assert wl.requests[1].max_tokens == 109


def test_vidur_length_file_needs_an_arrival_process():
    text = _trace_scenario("vidur", "vidur/arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv")
    with pytest.raises(InputError) as ei:
        build_workload(parse_scenario(text, "t.yaml"))
    assert "workload.arrival" in str(ei.value)


def test_malformed_trace_row_names_line(tmp_path):
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n{"timestamp": 5}\n')
    text = _small_trace_scenario("mooncake", bad)
    with pytest.raises(InputError) as ei:
        build_workload(parse_scenario(text, "t.yaml"))
    assert ei.value.where == f"{bad}:2"


LLMSS = "llmservingsim/sharegpt-llama-3.1-8b-300-sps10.jsonl"


def test_llmservingsim_prompts_outputs_and_arrivals_are_the_recorded_ones():
    """Real token ids: a scaled prompt keeps its first tokens, the simulated model commits the
    recorded output tokens, arrivals come from the nanosecond timestamps."""
    import json

    from hybridsim.simulate import Simulation

    rows = [json.loads(line) for line in (DATA / LLMSS).open()][:50]
    text = _trace_scenario("llmservingsim", LLMSS,
                           ", length_scale: 0.25, arrival: {kind: timestamps, step_seconds: 0.01}")
    loaded = parse_scenario(text, "t.yaml")
    wl = build_workload(loaded)
    assert len(wl.requests) == 50 and wl.vocab_size > 32000 and "vocab_size raised" in wl.notes[0]
    byid = {r.req_id: r for r in wl.requests}
    t0 = rows[0]["arrival_time_ns"]
    for i, row in enumerate(rows):
        r = byid[f"r{i}"]
        assert list(r.prompt) == row["input_tok_ids"][:round(row["input_toks"] * 0.25)]
        assert r.max_tokens == round(row["output_toks"] * 0.25)
        assert r.arrival_step == (row["arrival_time_ns"] - t0) // 10_000_000
    committed: dict[str, list[int]] = {}
    for plan, out in Simulation(loaded.scenario, wl):
        for rid, toks in out.sampled.items():
            committed.setdefault(rid, []).extend(toks)
    assert committed == {f"r{i}": row["output_tok_ids"][:byid[f"r{i}"].max_tokens] for i, row in enumerate(rows)}


@pytest.mark.parametrize("line,why", [
    ('{"input_tok_ids": [1, 2], "arrival_time_ns": 0}', "output_tok_ids"),
    ('{"input_tok_ids": [1, 2], "output_tok_ids": [3], "arrival_time_ns": 0, "input_toks": 3}', "input_toks is 3"),
    ('{"input_tok_ids": [1, -2], "output_tok_ids": [3], "arrival_time_ns": 0}', "token ids"),
    ('{"input_tok_ids": [], "output_tok_ids": [3], "arrival_time_ns": 0}', "non-empty"),
    ('{"input_tok_ids": [1], "output_tok_ids": [3], "arrival_time_ns": 1.5}', "arrival_time_ns"),
    ('[1, 2, 3]', "JSON object"),
])
def test_llmservingsim_bad_record_names_its_line(tmp_path, line, why):
    bad = tmp_path / "w.jsonl"
    bad.write_text('{"input_tok_ids": [5, 6], "output_tok_ids": [7], "arrival_time_ns": 0}\n' + line + "\n")
    text = _small_trace_scenario("llmservingsim", bad)
    with pytest.raises(InputError) as ei:
        build_workload(parse_scenario(text, "t.yaml"))
    assert ei.value.where == f"{bad}:2" and why in ei.value.message


def _burstgpt(tmp_path, body: str, extra: str = ""):
    path = tmp_path / "b.csv"
    path.write_text(body)
    text = _small_trace_scenario("burstgpt", path, ", arrival: {kind: timestamps, step_seconds: 2.0}" + extra)
    return path, parse_scenario(text, "t.yaml")


# rows in BurstGPT's published schema (no copy of the dataset is available here)
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
46,GPT-4,417,276,693,API log
49,ChatGPT,133,27,160,Conversation log
"""


def test_burstgpt_rows_become_requests_and_failed_calls_are_skipped(tmp_path):
    _, loaded = _burstgpt(tmp_path, BURSTGPT)
    wl = build_workload(loaded)
    assert [(len(r.prompt), r.max_tokens, r.arrival_step) for r in wl.requests] == [(472, 18, 0), (417, 276, 20),
                                                                                  (133, 27, 22)]
    assert wl.notes == ["1 BurstGPT row(s) with no request or response tokens skipped"]
    _, loaded = _burstgpt(tmp_path, BURSTGPT, ", limit: 2")  # the limit counts requests kept
    assert [r.max_tokens for r in build_workload(loaded).requests] == [18, 276]


def test_burstgpt_bad_file_is_one_message(tmp_path):
    path, loaded = _burstgpt(tmp_path, BURSTGPT.replace("Response tokens", "Output tokens"))
    with pytest.raises(InputError) as ei:
        build_workload(loaded)
    assert ei.value.where == f"{path}:1" and "missing Response tokens" in ei.value.message
    path, loaded = _burstgpt(tmp_path, BURSTGPT.replace("46,GPT-4,417", "46,GPT-4,many"))
    with pytest.raises(InputError) as ei:
        build_workload(loaded)
    assert ei.value.where == f"{path}:4" and "bad BurstGPT row" in ei.value.message


@pytest.mark.parametrize("fmt", ["mooncake", "azure", "burstgpt", "vidur", "llmservingsim", "hybridsim"])
def test_unreadable_trace_file_is_one_message(tmp_path, fmt):
    """A binary file, or a line no CSV reader takes, is bad input naming the file (not a traceback)."""
    binary = tmp_path / "b.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    wide = tmp_path / "w.csv"
    wide.write_text("a" * 200_000 + "\n1,2\n")  # past the csv module's field limit
    for path in (binary, wide) if fmt in ("azure", "burstgpt", "vidur") else (binary,):
        text = _small_trace_scenario(fmt, path, ", arrival: {kind: fixed, per_step: 1}")
        with pytest.raises(InputError) as ei:
            build_workload(parse_scenario(text, "t.yaml"))
        msg = ei.value.message  # (the hybridsim format reads through the trace reader, which says it itself)
        assert ei.value.where == str(path) and (f"as a trace of format {fmt}" in msg or "not a UTF-8 text file" in msg)
