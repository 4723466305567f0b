#!/usr/bin/env bash
# The paged-attention fault of bench_kernels.py's gqa section (bench/RESULTS.md), in one device call.
#   bash bench/probes/paged_fault.sh diag [UNFIXED_BENCH]   # witness, deterministic repro (+ memcheck), the bench
#   bash bench/probes/paged_fault.sh san                    # deterministic repro, plain and under memcheck
#   bash bench/probes/paged_fault.sh verify                 # this tree's bench, the RESULTS commands, no blocking
# UNFIXED_BENCH: a bench_kernels.py from before the fix (its repository root is imported with it).
# WHL: a folder of wheels to install first (pydantic and its needs: the device image lacks them).
# Logs and JSON go to one archive in $OUT; a summary is printed at the end and kept beside it.
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
L=/tmp/paged_fault  # every log and JSON here; $OUT gets one archive of them and the summary
rm -rf "$L" && mkdir -p "$L" "$OUT"
cd "$(dirname "$0")/../.."
WHAT=${1:-diag}
UNFIXED=${2:-}
if [ -n "${WHL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --find-links "$WHL" --target /tmp/site \
    pydantic pydantic-core typing-extensions annotated-types typing-inspection && export PYTHONPATH=/tmp/site
fi
P="python3 bench/probes/paged_fault.py"
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
MEMCHECK="$SAN --tool memcheck --report-api-errors no --show-backtrace no --print-limit 12"
BUDGET=${BUDGET:-370}  # seconds for the whole script: a step's timeout is cut to what is left
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  local s=$SECONDS
  [ $((BUDGET - SECONDS)) -lt "$t" ] && t=$((BUDGET - SECONDS))
  if [ "$t" -lt 20 ]; then echo "$name: skipped (budget)" | tee -a "$L/steps.txt"; return; fi
  timeout "$t" "$@" >"$L/$name.log" 2>&1
  echo "$name: rc=$? $((SECONDS - s))s" | tee -a "$L/steps.txt"
}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch,triton;print('torch',torch.__version__,'triton',triton.__version__)"
  echo "sanitizer: $SAN"
  python3 - <<'EOF'
import inspect, triton.testing as t
src = inspect.getsource(t.do_bench_cudagraph).splitlines()
print("\n".join(l for l in src if any(k in l for k in ("torch.cuda.stream", "fn()", "synchronize", "graph("))))
EOF
} >"$L/env.log" 2>&1
: >"$L/steps.txt"
if [ "$WHAT" = diag ]; then
  step witness 40 $P witness
  if [ -n "$UNFIXED" ]; then
    step unfixed_exact 100 python3 "$UNFIXED" --only gqa --gqa-configs 64,4,2 --gqa-splits "" --out "$L/unfixed.json"
    step unfixed_tap 100 $P bench "$UNFIXED" --tap --stop 9 -- --only gqa --gqa-configs 64,4,2 --gqa-splits "" \
      --out "$L/unfixed_tap.json"
  fi
  step seq 45 $P seq 16 1024 16
  step seq_warm 45 $P seq 16 1024 16 --warm-streams
  step seq_warm_sync 45 $P seq 16 1024 16 --warm-streams --sync
  step memcheck_seq_warm 80 $MEMCHECK $P seq 16 1024 16 --warm-streams
  step memcheck_nowrite 80 $MEMCHECK $P seq 4 256 16 --sync --no-write
  step fixed_one_config 150 python3 bench/bench_kernels.py --only gqa --gqa-configs 64,4,2 --gqa-splits "" \
    --out "$L/fixed_one.json"
  step memcheck_seq_warm_sync 80 $MEMCHECK $P seq 16 1024 16 --warm-streams --sync
elif [ "$WHAT" = san ]; then  # the deterministic repro with and without the fix, plain and under memcheck
  step witness 30 $P witness
  step seq_warm 40 $P seq 16 1024 16 --warm-streams
  step seq_warm_sync 40 $P seq 16 1024 16 --warm-streams --sync
  step memcheck_seq_warm 60 $MEMCHECK $P seq 16 1024 16 --warm-streams
  step memcheck_seq_warm_sync 60 $MEMCHECK $P seq 16 1024 16 --warm-streams --sync
  step memcheck_nowrite 60 $MEMCHECK $P seq 4 256 16 --sync --no-write
  step fixed_results_cmd 330 python3 bench/bench_kernels.py --only gqa --gqa-configs "64,4,2;32,4,3;128,8,2" \
    --out "$L/fixed_full.json"
else
  step fixed_results_cmd 330 python3 bench/bench_kernels.py --only gqa --gqa-configs "64,4,2;32,4,3;128,8,2" \
    --out "$L/fixed_full.json"
  step fixed_one_config 150 python3 bench/bench_kernels.py --only gqa --gqa-configs 64,4,2 --gqa-splits "" \
    --out "$L/fixed_one.json"
fi
{
echo "===== summary ($WHAT)"
cat "$L/env.log"
cat "$L/steps.txt"
for f in "$L"/*.log; do
  case $f in */env.log) continue ;; esac
  echo "--- $(basename "$f")"
  grep -E "WITNESS|SEQ|GRAPH|RING|STOP|illegal|Invalid|ERROR SUMMARY|Address|is out of bounds|Error|failed|Traceback|'kernel': 'paged_attention'|done in" "$f" \
    | grep -v "^=========     " | sed -E "s/^(\{'kernel'.{0,130}).*/\1 .../" | cut -c1-900 | head -40
done
} | tee "$OUT/summary_$WHAT.txt"
tar czf "$OUT/paged_fault_$WHAT.tgz" -C /tmp paged_fault
