"""Exactness of planner changes: an older copy of the package against the working tree.

    git worktree add /tmp/base REV && mkdir -p /tmp/abpkg && cp -r /tmp/base/hybridsim /tmp/abpkg/hybridsim_base
    python bench/probes/planner_equiv.py [EXAMPLES]     # default 150 random scenarios
    python bench/probes/planner_equiv.py 150 --caching-only   # leave out prefix caching off

Plans every shipped scenario and EXAMPLES random property-test scenarios with both versions in
one process and requires identical plans (every row), outcomes and run statistics. Speed work on
the planner must not change a single plan; this says so, or prints the first scenario that differs.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, '/tmp/abpkg')
sys.path.insert(0, str(REPO))
from hypothesis import HealthCheck, given, settings  # noqa: E402

import hybridsim.config as config_new  # noqa: E402
import hybridsim.simulate as simulate_new  # noqa: E402
import hybridsim.workload as workload_new  # noqa: E402
import hybridsim_base.config as config_base  # noqa: E402
import hybridsim_base.simulate as simulate_base  # noqa: E402
import hybridsim_base.workload as workload_base  # noqa: E402
from tests.test_properties import scenarios  # noqa: E402

NEW = (config_new, simulate_new, workload_new)
BASE = (config_base, simulate_base, workload_base)


def plan_all(pkg, text: str, base_dir):
    config, simulate, workload = pkg
    loaded = config.parse_scenario(text, "t.yaml", base_dir)
    sim = simulate.Simulation(loaded.scenario, workload.build_workload(loaded))
    steps = [(p.step, tuple(tuple(r) for r in p.scheduled), p.preempted, p.finished, p.forced_preempted,
              dict(o.sampled), dict(o.accepted)) for p, o in sim]
    return steps, sim.stats.as_dict()


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    examples = int(args[0]) if args else 150
    # --caching-only: leave out scenarios with prefix caching off (for a deliberate change there)
    caching_only = "--caching-only" in sys.argv
    for path in sorted((REPO / "scenarios").glob("*.yaml")):
        if caching_only and "enable_prefix_caching: false" in path.read_text():
            print(f"{path.name:24s} left out (prefix caching off)")
            continue
        a = plan_all(BASE, path.read_text(), path.parent)
        b = plan_all(NEW, path.read_text(), path.parent)
        print(f"{path.name:24s} {'same' if a == b else 'DIFFERENT'} ({len(a[0])} steps)")
        if a != b:
            sys.exit(1)

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(scenarios())
    def same_plans(text):
        if caching_only and "enable_prefix_caching: false" in text:
            return
        assert plan_all(BASE, text, None) == plan_all(NEW, text, None), text

    same_plans()
    print(f"{examples} random scenarios: same")


if __name__ == "__main__":
    main()
