# The two commands a user types: `make run` and `make test`. Both create .venv if missing.
# torch==2.13.0 is installed first when the venv has no torch (a CPU build on these machines;
# a bare `torch` requirement would pull a multi-GB CUDA build). An existing torch is kept.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test bench fidelity golden clean peer

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): $(BIN)/python pyproject.toml
	@if ! $(BIN)/python -c "import torch" >/dev/null 2>&1; then \
		echo "installing torch==2.13.0 into $(VENV)"; \
		$(BIN)/python -m pip install --quiet torch==2.13.0; \
	fi
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@# byte-compile the package (an editable install does not, and with PYTHONDONTWRITEBYTECODE set, as
	@# on these machines, every process would compile it again: 0.15 s a process, each sweep worker too)
	$(BIN)/python -m compileall -q hybridsim
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/hybridsim run scenarios/quickstart.yaml

# The suite in two parts: most tests two at a time (pytest-xdist; CI has two cores), then those marked
# `serial` (Ray, worker pools, signals: they start processes on every core) one at a time. Plain
# `pytest` runs everything one at a time. (-m replaces pyproject's addopts -m, so gpu/peer are repeated.)
test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m 'not gpu and not peer and not serial'
	$(BIN)/python -m pytest -q -m 'serial and not gpu and not peer'
	$(BIN)/hybridsim replay traces/ --check -j 2

fidelity: $(STAMP)
	$(BIN)/hybridsim fidelity data/vllm-recorded/*.jsonl

bench: $(STAMP)
	$(BIN)/python bench/bench_planner.py all

# vLLM 0.33's own scheduler beside ours (`run --scheduler vllm`, the live comparisons): needs .peer-venv
peer:
	@test -x .peer-venv/bin/python || { echo "no .peer-venv: run bench/peer_setup.sh first"; exit 3; }
	.peer-venv/bin/python -m pytest -m peer -q tests/test_vllm_scheduler.py tests/test_peer.py

clean:
	rm -rf $(VENV) .pytest_cache

# Re-record the golden traces from scenarios/ and the vLLM recordings, then rewrite their expected files.
GOLDEN_SCENARIOS := quickstart chunked_prefill align_prefix_hits all_mode no_prefix_cache memory_pressure \
                    forced_preemption spec_decode spec_padding mla_long_context mixed_hybrid_mla partial_hits
golden: $(STAMP)
	@for s in $(GOLDEN_SCENARIOS); do $(BIN)/hybridsim run scenarios/$$s.yaml -q --check off --record traces/$$s.jsonl || exit 1; done
	@for r in data/vllm-recorded/*.jsonl; do $(BIN)/hybridsim convert $$r --out traces/vllm_$$(basename $$r) || exit 1; done
	$(BIN)/hybridsim convert data/vllm-recorded/layouts/mixed_mtp_pressure.jsonl --out traces/vllm_mixed_mtp.jsonl
	$(BIN)/hybridsim convert data/vllm-recorded/layouts/mtp3_qwen_like.jsonl --out traces/vllm_mtp3_padded.jsonl
	$(BIN)/hybridsim convert data/vllm-recorded/layouts/eagle2_attention_first.jsonl --out traces/vllm_eagle_attn1st.jsonl
	$(BIN)/hybridsim replay traces/ --update-expected
