"""Scenario parsing: valid files load; every kind of mistake names the key path and the line."""

from __future__ import annotations

import pytest

from hybridsim.config import load_scenario, parse_scenario
from hybridsim.errors import InputError

from .conftest import SCENARIOS, tiny_scenario


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.name)
def test_every_shipped_scenario_validates(path):
    loaded = load_scenario(path)
    assert loaded.scenario.name


def test_spec_example_validates():
    from .conftest import REPO
    s = load_scenario(REPO / "scenarios" / "quickstart.yaml").scenario
    assert s.spec_decode.num_speculative_tokens == 3
    assert s.cache.resolved_mode() == "align"


def _err(text: str) -> InputError:
    with pytest.raises(InputError) as ei:
        parse_scenario(text, "s.yaml")
    return ei.value


def test_unknown_key_names_path_and_line():
    text = tiny_scenario().replace("max_num_seqs: 8", "max_num_seqs: 8, max_num_seq: 3")
    e = _err(text)
    assert "scheduler.max_num_seq" in e.message and "unknown key" in e.message
    assert e.where == "s.yaml:6"


def test_misspelt_key_is_named_not_the_missing_one():
    """A misspelt required key is both unknown and missing: the message names the misspelling
    and the key it stands for, on the misspelling's line."""
    e = _err(tiny_scenario().replace("num_blocks:", "num_blokcs:"))
    assert e.message.startswith("cache.num_blokcs: unknown key (did you mean num_blocks?")
    assert "more problem" not in e.message and e.where == "s.yaml:5"
    e = _err(tiny_scenario().replace("num_blocks:", "num_blokcs:").replace("max_num_seqs: 8", "max_num_seqs: x"))
    assert e.message.startswith("cache.num_blokcs: unknown key") and "(and 1 more problem(s))" in e.message


def test_unknown_key_names_what_is_missing_beside_it():
    """A key unlike any expected one still points at the required keys missing beside it."""
    e = _err(tiny_scenario(spec=2, acc="{kind: bernoulli, p: 0.6}"))
    assert e.message == "spec_decode.acceptance.p: unknown key (not part of the scenario schema; missing here: rate)"


def test_wrong_type_names_path_and_line():
    e = _err(tiny_scenario(blocks="lots"))
    assert e.message.startswith("cache.num_blocks")
    assert e.where == "s.yaml:5"


def test_negative_length_rejected():
    e = _err(tiny_scenario(pmin=-3))
    assert "workload.prompt_len.min" in e.message
    assert e.where == "s.yaml:12"


def test_missing_required_key():
    text = "\n".join(l for l in tiny_scenario().splitlines() if not l.startswith("cache:"))
    e = _err(text)
    assert e.message.startswith("cache") and "missing" in e.message


def test_bad_yaml_reports_line():
    e = _err("name: x\nmodel: {preset: tiny-hybrid\ncache: 3\n")
    assert "not valid YAML" in e.message and e.where.startswith("s.yaml:")


def test_duplicate_key_rejected():
    e = _err("name: x\nname: y\n")
    assert "appears twice" in e.message and e.where == "s.yaml:2"


def test_unknown_preset():
    e = _err(tiny_scenario(preset="gpt-5"))
    assert "unknown preset" in e.message and "tiny-hybrid" in e.message


def test_all_mode_block_must_be_multiple_of_chunk():
    e = _err(tiny_scenario(mode="all", bs=24))
    assert e.message.startswith("cache.block_size") and "chunk_size" in e.message
    assert e.where == "s.yaml:5"


def test_align_needs_prefix_caching():
    e = _err(tiny_scenario(caching="false"))
    assert "cache.mamba_cache_mode" in e.message


def test_pattern_acceptance_bounded_by_drafts():
    e = _err(tiny_scenario(spec=2, acc="{kind: pattern, accepted: [1, 3]}"))
    assert "spec_decode" in e.message and "more than num_speculative_tokens" in e.message


def test_pool_too_large_to_hold_is_refused_not_a_memory_error():
    e = _err(tiny_scenario(blocks=2**24 + 1))
    assert e.message.startswith("cache.num_blocks") and "16777216" in e.message and e.where == "s.yaml:5"


def test_workload_too_large_to_hold_is_refused_not_a_memory_error():
    e = _err(tiny_scenario(n=10**7, pmax=200))  # up to 2e9 prompt tokens
    assert e.message.startswith("workload.num_requests") and "cannot hold in memory" in e.message


def test_out_of_memory_is_an_environment_problem(capsys):
    import typer

    from hybridsim.cli import _guard

    def body() -> int:
        raise MemoryError()
    with pytest.raises(typer.Exit) as ei:
        _guard(body)
    assert ei.value.exit_code == 3 and "out of memory" in capsys.readouterr().err


def test_run_that_ends_before_the_first_arrival_is_refused():
    from hybridsim.runner import check_workload_fits, plan_scenario
    from hybridsim.workload import build_workload

    text = tiny_scenario().replace("arrival: {kind: fixed, per_step: 2}",
                                   "arrival: {kind: steps, steps: [40, 41, 42, 43, 44, 45, 46, 47]}")
    assert "steps: [40" in text
    loaded = parse_scenario(text + "execution: {max_steps: 40}\n", "s.yaml")
    with pytest.raises(InputError) as ei:
        check_workload_fits(loaded, build_workload(loaded))
    assert ei.value.message.startswith("execution.max_steps: the run stops at step 40, before the first request "
                                       "arrives (step 40)")
    loaded = parse_scenario(text + "execution: {max_steps: 41}\n", "s.yaml")
    assert plan_scenario(loaded, check="off").stats.steps == 1  # one step is enough to run


def test_too_few_blocks_for_longest_request():
    e = _err(tiny_scenario(blocks=10))
    assert e.message.startswith("cache.num_blocks") and "needs" in e.message


def test_budget_below_one_block_in_align_mode():
    e = _err(tiny_scenario(budget=8))
    assert "max_num_batched_tokens" in e.message


def test_long_prefill_threshold_above_model_length():
    """vLLM's SchedulerConfig refuses it; so do we, naming the key and its line."""
    text = tiny_scenario(max_len=256, pmax=200).replace(
        "max_model_len: 256}", "max_model_len: 256, long_prefill_token_threshold: 300}")
    e = _err(text)
    assert e.message == ("scheduler.long_prefill_token_threshold: 300 is more than max_model_len (256); "
                         "the engine refuses that")
    assert e.where == "s.yaml:6"


def test_prompt_longer_than_model():
    e = _err(tiny_scenario(pmax=5000))
    assert "workload.prompt_len" in e.message


def test_unknown_union_tag():
    e = _err(tiny_scenario(acc="{kind: sometimes}"))
    assert "spec_decode.acceptance" in e.message


def test_preset_with_overrides():
    text = tiny_scenario().replace("model: {preset: tiny-hybrid}", "model: {preset: tiny-hybrid, mamba: {layers: 3}}")
    geo = parse_scenario(text).scenario.geometry()
    assert geo.mamba.layers == 3 and geo.mamba.heads == 4 and geo.name == "tiny-hybrid+overrides"


@pytest.mark.parametrize("section,want", [
    ("{heads: 5, kv_heads: 2}", "model.attention: heads (5) must be a multiple of kv_heads (2)"),
    ("{head_dim: -3}", "model.attention.head_dim: Input should be greater than or equal to 1"),
])
def test_bad_geometry_override_is_named_where_it_is(section, want):
    """A preset's geometry overridden badly: the message names the section (not the top level) and its line."""
    text = tiny_scenario(preset="tiny-hybrid").replace("model: {preset: tiny-hybrid}",
                                                       f"model: {{preset: tiny-hybrid, attention: {section}}}")
    assert "attention:" in text
    e = _err(text)
    assert e.message == want and e.where == "s.yaml:4"
