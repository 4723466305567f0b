# The two commands a user types: `make run` and `make test`. Both create .venv if missing.
# torch==2.13.0 is installed first when the venv has no torch (a CPU build on these machines;
# a bare `torch` requirement would pull a multi-GB CUDA build). An existing torch is kept.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test bench fidelity golden clean

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

test: $(STAMP)
	$(BIN)/python -m pytest -q
	$(BIN)/hybridsim replay traces/ --check -j 2

fidelity: $(STAMP)
	$(BIN)/hybridsim fidelity data/vllm-recorded/*.jsonl

bench: $(STAMP)
	$(BIN)/python bench/bench_planner.py all

clean:
	rm -rf $(VENV) .pytest_cache

# Re-record the golden traces from scenarios/ and the vLLM recordings, then rewrite their expected files.
GOLDEN_SCENARIOS := quickstart chunked_prefill align_prefix_hits all_mode no_prefix_cache memory_pressure \
                    forced_preemption spec_decode spec_padding mla_long_context mixed_hybrid_mla partial_hits
golden: $(STAMP)
	@for s in $(GOLDEN_SCENARIOS); do $(BIN)/hybridsim run scenarios/$$s.yaml -q --check off --record traces/$$s.jsonl || exit 1; done
	@for r in data/vllm-recorded/*.jsonl; do $(BIN)/hybridsim convert $$r --out traces/vllm_$$(basename $$r) || exit 1; done
	$(BIN)/hybridsim replay traces/ --update-expected
