#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmarks, and scenarios executed with the Triton provider on
# the GPU (tiny ones, then the realistic presets), each printing its kernel timings table.
# Needs pydantic/typer/rich/pyyaml there: carry .wheels (see bench/RESULTS.md).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
WHAT=${1:-tests,bench,tiny,real}
if [ -d .wheels ]; then pip install -q --no-index --target /tmp/pydeps .wheels/*.whl 2>&1 | tail -1; export PYTHONPATH=$PWD:/tmp/pydeps; fi
python3 -c "import torch,triton;print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__)"
if [[ $WHAT == *tests* ]]; then
  python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_kernels_triton.py tests/test_gpu_run.py 2>&1 | tail -15 | tee $OUT/gpu_tests.log
fi
if [[ $WHAT == *bench* ]]; then
  python3 bench/bench_kernels.py --out $OUT/kernels.json ${BENCH_ARGS:-} 2>&1 | tail -40
fi
if [[ $WHAT == *tiny* ]]; then
  for s in quickstart spec_decode chunked_prefill forced_preemption mixed_hybrid_mla mla_long_context all_mode; do
    timeout 120 python3 -m hybridsim.cli run scenarios/$s.yaml --kernels triton --device cuda -q --json $OUT/run_$s.json
    echo "$s exit=$?"
  done 2>&1 | tee $OUT/runs.log
fi
if [[ $WHAT == *real* ]]; then
  for s in nemotron_h_8b deepseek_v3; do
    timeout 240 python3 -m hybridsim.cli run scenarios/$s.yaml --kernels triton --device cuda --json $OUT/run_$s.json \
      2>&1 | tail -45
    echo "$s exit=${PIPESTATUS[0]}"
  done 2>&1 | tee $OUT/real.log
fi
