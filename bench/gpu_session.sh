#!/usr/bin/env bash
# One device call: GPU tests, kernel benchmarks, and scenarios executed with the Triton provider on
# the GPU, each printing its tables. Carry .whl (pydantic and its needs; the image lacks them):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 ... -d .whl pydantic==...
# WHAT: comma list of first, tests, bench, oracle, tiny, real, scale, units, vllm (default tests,real).
# first: deepseek_v3 before anything else touches Triton on the machine (give it a fresh machine): a first
# run's kernel variants built ahead of the loop, the driver's helpers compiled among them (session 40).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}
WHAT=${1:-tests,real}
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
if [ -f .gpu-carry/vllm_py.tgz ]; then  # vLLM's Python files (bench/pack_vllm_for_device.sh), for --kernels vllm
  mkdir -p /tmp/vl && tar -xzf .gpu-carry/vllm_py.tgz -C /tmp/vl && export PYTHONPATH=$PYTHONPATH:/tmp/vl
fi
python3 -c "import torch,triton;print(torch.cuda.get_device_name(0), torch.__version__, triton.__version__)"
# every run lists the kernel variants it used here (device/prebuild.py), starting from the package's lists:
# copy it over hybridsim/device/kernel_variants.json when kernels changed
cp hybridsim/device/kernel_variants.json "$OUT/kernel_variants.json"
run() { timeout "$1" python3 -m hybridsim.cli run "scenarios/$2.yaml" --kernels triton --device cuda \
          --kernel-variants "$OUT/kernel_variants.json" "${@:3}"; }
if [[ $WHAT == *first* ]]; then
  run 300 deepseek_v3 --json $OUT/run_deepseek_v3_first.json 2>&1 | tail -30; echo "deepseek_v3 (first) exit=${PIPESTATUS[0]}"
fi
if [[ $WHAT == *tests* ]]; then
  python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/test_probe.py tests/test_kernels_triton.py tests/test_paged_attention.py tests/test_ceilings.py \
    tests/test_gpu_run.py tests/test_block_copy.py tests/test_partial_exec.py tests/test_dense_attention_f64.py tests/test_latent_attention_f64.py \
    tests/test_segments.py tests/test_digit_attention_f64.py tests/test_digit_keys.py tests/test_probe_latents.py tests/test_oracle_batching.py tests/test_prebuild.py \
    tests/test_verdicts.py tests/test_transfer.py tests/test_checked_kernels.py \
    2>&1 | tail -15 | tee $OUT/gpu_tests.log
fi
if [[ $WHAT == *vllm* ]]; then  # the engine's kernels: each op against the reference, then both Mooncake runs
  python3 -m hybridsim kernels check vllm --device cuda 2>&1 | tee $OUT/check_vllm.txt | tail -20
  for s in nemotron_h_8b_mooncake deepseek_v3_mooncake; do
    run 330 $s --kernels vllm --json $OUT/run_${s}_vllm.json 2>&1 | tail -40; echo "$s exit=${PIPESTATUS[0]}"  # (the later --kernels wins)
  done 2>&1 | tee $OUT/vllm.log
fi
if [[ $WHAT == *bench* ]]; then
  python3 bench/bench_kernels.py --out $OUT/kernels.json ${BENCH_ARGS:-} 2>&1 | tail -40
fi
if [[ $WHAT == *oracle* ]]; then  # the oracle's float64 attention (GQA and MLA kernels, and torch) and the probe scans
  python3 bench/bench_oracle.py --out $OUT/oracle.json 2>&1 | tail -12
  python3 bench/bench_scan.py --out $OUT/scan.json 2>&1 | tail -25
fi
if [[ $WHAT == *tiny* ]]; then
  for s in quickstart spec_decode chunked_prefill forced_preemption mixed_hybrid_mla mla_long_context all_mode; do
    run 120 $s -q --json $OUT/run_$s.json; echo "$s exit=$?"
  done 2>&1 | tee $OUT/runs.log
fi
if [[ $WHAT == *real* ]]; then
  for s in nemotron_h_8b deepseek_v3; do
    run 300 $s --json $OUT/run_$s.json 2>&1 | tail -60; echo "$s exit=${PIPESTATUS[0]}"
  done 2>&1 | tee $OUT/real.log
fi
if [[ $WHAT == *scale* ]]; then
  for s in nemotron_h_8b_mooncake deepseek_v3_mooncake; do
    run 330 $s --json $OUT/run_$s.json 2>&1 | tail -60; echo "$s exit=${PIPESTATUS[0]}"
  done 2>&1 | tee $OUT/scale.log
fi
if [[ $WHAT == *units* ]]; then  # partial-block prefix hits at real scale (16-token units)
  run 330 nemotron_h_8b_mooncake_units --json $OUT/run_nemotron_h_8b_mooncake_units.json 2>&1 | tail -60
  echo "nemotron_h_8b_mooncake_units exit=${PIPESTATUS[0]}"
fi
