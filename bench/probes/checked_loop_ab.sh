#!/usr/bin/env bash
# The quickstart checked loop of two trees, side by side, alternating (CPU).
#   git worktree add /tmp/old <commit>; bash bench/probes/checked_loop_ab.sh /tmp/old . [rounds]
# Runs from a neutral folder: started from a repository root, Python would import that tree's
# package whatever PYTHONPATH says (each run asserts which package it imported).
set -eu
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd); rounds=${3:-3}
py=${PYTHON:-$new/.venv/bin/python}
cd "$(mktemp -d)"
for i in $(seq "$rounds"); do
  for tree in "$old" "$new"; do
    PYTHONPATH=$tree "$py" - "$tree" <<'PY'
import sys
tree = sys.argv[1]
import hybridsim
assert hybridsim.__file__.startswith(tree), hybridsim.__file__
from hybridsim.config import load_scenario
from hybridsim.runner import plan_scenario
print(f"{tree}: whole loop {plan_scenario(load_scenario(tree + '/scenarios/quickstart.yaml')).wall_s:.3f} s")
PY
  done
done
