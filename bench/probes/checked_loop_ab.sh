#!/usr/bin/env bash
# The quickstart checked loop of two (or more) trees, side by side, alternating (CPU), then each
# tree's runs sorted with their median.
#   git worktree add /tmp/old <commit>; bash bench/probes/checked_loop_ab.sh /tmp/old . [rounds] [--cli]
# --cli: each run is the console command a user types (`hybridsim run quickstart.yaml`, through the
# entry point, so with whatever process set-up that tree's CLI does), its whole loop read from --json;
# without it, plan_scenario called from Python.
# Runs from a neutral folder: started from a repository root, Python would import that tree's
# package whatever PYTHONPATH says (each run asserts which package it imported). This machine's
# speed drifts by 10-25% over minutes: take many rounds.
set -eu
rounds=3
cli=0
trees=()
for a in "$@"; do
  if [[ $a == --cli ]]; then cli=1
  elif [[ $a =~ ^[0-9]+$ ]]; then rounds=$a; else trees+=("$(cd "$a" && pwd)"); fi
done
py=${PYTHON:-${trees[-1]}/.venv/bin/python}
cd "$(mktemp -d)"
declare -A runs
for i in $(seq "$rounds"); do
  for tree in "${trees[@]}"; do
    if (( cli )); then
      PYTHONPATH=$tree "$py" -c 'import sys, hybridsim, hybridsim.cli as c
assert hybridsim.__file__.startswith(sys.argv[1]), hybridsim.__file__
sys.argv = ["hybridsim", "run", sys.argv[1] + "/scenarios/quickstart.yaml", "-q", "--json", "run.json"]
c.main()' "$tree" || true
      t=$("$py" -c 'import json; d = json.load(open("run.json")); print("%.3f" % [t["total_s"] for t in d["timings"] if t["phase"] == "wall"][0])')
    else
    t=$(PYTHONPATH=$tree "$py" - "$tree" <<'PY'
import sys
tree = sys.argv[1]
import hybridsim
assert hybridsim.__file__.startswith(tree), hybridsim.__file__
from hybridsim.config import load_scenario
from hybridsim.runner import plan_scenario
print(f"{plan_scenario(load_scenario(tree + '/scenarios/quickstart.yaml')).wall_s:.3f}")
PY
)
    fi
    echo "$tree: whole loop $t s"
    runs[$tree]="${runs[$tree]:-} $t"
  done
done
for tree in "${trees[@]}"; do
  sorted=$(echo ${runs[$tree]} | tr ' ' '\n' | sort -n | tr '\n' ' ')
  median=$(echo ${runs[$tree]} | tr ' ' '\n' | sort -n | awk '{a[NR]=$1} END {print (NR % 2 ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2)}')
  echo "$tree: sorted $sorted median $median"
done
