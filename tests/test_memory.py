"""The memory plan: added up and announced before anything is allocated; a run that cannot fit
is refused (exit 2 naming cache.num_blocks when fewer blocks would fit, exit 3 naming the device
when nothing would); an out-of-memory error while running is one message and exit 3."""

from __future__ import annotations

import pytest
import torch

import hybridsim.engine.memory as memory
from hybridsim.config import parse_scenario
from hybridsim.errors import EnvironmentProblem, InputError
from hybridsim.runner import plan_scenario

from .cli_inproc import hsi
from .conftest import tiny_scenario

NEMOTRON = """
name: big
model: {{preset: nemotron-h-8b}}
cache: {{block_size: 64, num_blocks: {blocks}, enable_prefix_caching: true, mamba_cache_mode: align}}
scheduler: {{max_num_batched_tokens: 512, max_num_seqs: {seqs}, max_model_len: 1024}}
workload: {{kind: synthetic, num_requests: 2, prompt_len: {{dist: fixed, value: 100}},
           output_len: {{dist: fixed, value: 4}}}}
execution: {{device: cpu, kernels: reference}}
"""


def test_the_plan_is_announced_before_allocation_and_adds_up():
    lines: list[list[str]] = []
    res = plan_scenario(parse_scenario(tiny_scenario(preset="tiny-hybrid-mla"), "t"), announce=lines.append)
    assert lines and lines[0][0].startswith("memory plan on cpu")
    items = res.memory["items"]
    assert {i["name"] for i in items} >= {"Mamba state cache", "Mamba oracle states", "MLA latent caches"}
    assert res.memory["total_bytes"] == sum(i["bytes"] for i in items)


def test_a_pool_too_large_is_refused_naming_num_blocks(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 8 << 30)
    with pytest.raises(InputError) as e:
        plan_scenario(parse_scenario(NEMOTRON.format(blocks=4000, seqs=2), "big.yaml"))
    msg = str(e.value)
    assert "cache.num_blocks" in msg and "at most" in msg and "big.yaml:4" in msg


def test_buffers_too_large_for_the_device_are_an_environment_problem(monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 8 << 30)
    with pytest.raises(EnvironmentProblem) as e:
        plan_scenario(parse_scenario(NEMOTRON.format(blocks=40, seqs=256), "big.yaml"))
    assert "cpu" in str(e.value) and "GiB" in str(e.value)


def test_cli_refuses_a_pool_no_machine_holds_with_exit_2(tmp_path):
    f = tmp_path / "huge.yaml"
    f.write_text(NEMOTRON.format(blocks=200000, seqs=2))
    r = hsi("run", f)
    assert r.returncode == 2, r.stderr
    assert "cache.num_blocks" in r.stderr and "Traceback" not in r.stderr
    assert "memory plan on cpu" in r.stderr  # announced before the refusal


def test_out_of_memory_while_running_is_exit_3_not_a_traceback(monkeypatch):
    from hybridsim.engine import executor

    def boom(self, plan, outcome):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(executor.Executor, "_step", boom)
    with pytest.raises(EnvironmentProblem) as e:
        plan_scenario(parse_scenario(tiny_scenario(), "t"))
    assert "out of memory at step 0" in str(e.value) and "planned" in str(e.value)


def test_the_gpu_attention_oracle_is_planned_without_keys_or_scores(monkeypatch):
    """On a GPU the GQA oracle's kernels keep queries, keys and scores inside them: the plan counts
    their outputs only, less than the torch path's keys, scores and outputs on a CPU."""
    from hybridsim.simulate import kv_groups
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a GPU")
    monkeypatch.setattr(memory, "free_bytes", lambda device: 80 << 30)
    s = parse_scenario(NEMOTRON.format(blocks=64, seqs=4), "t").scenario
    groups = kv_groups(s)
    a = s.geometry().attention

    def oracle(device: str) -> dict:
        plan = memory.plan_memory(s, groups, torch.device(device))
        return next(i for i in plan.as_dict()["items"] if i["name"] == "attention oracle (estimate)")
    gpu, cpu = oracle("cuda"), oracle("cpu")
    assert gpu["bytes"] == 8 * a.layers * 512 * a.heads * a.head_dim  # 512: max_num_batched_tokens
    assert "keys and scores, stay inside the kernels" in gpu["detail"] and gpu["bytes"] < cpu["bytes"]
