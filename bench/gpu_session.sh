#!/usr/bin/env bash
# One device call: kernel tests at real sizes, state-copy benchmark, and every tiny scenario
# executed with the Triton provider on the GPU (needs pydantic/typer/rich/pyyaml/pandas there).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
python3 -c "import torch,triton;print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__)"
python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_triton.py 2>&1 | tail -2 | tee $OUT/gpu_tests.log
python3 -c "import pydantic, typer, rich, yaml, pandas" 2>&1 | tail -1
for s in quickstart spec_decode chunked_prefill forced_preemption mixed_hybrid_mla mla_long_context all_mode; do
  timeout 120 python3 -m hybridsim.cli run scenarios/$s.yaml --kernels triton --device cuda -q --json $OUT/run_$s.json
  echo "$s exit=$?"
done 2>&1 | tee $OUT/runs.log
