"""Same-process A/B of the planner: an older copy of the package against the working tree.

    git worktree add /tmp/base REV && mkdir -p /tmp/abpkg && cp -r /tmp/base/hybridsim /tmp/abpkg/hybridsim_base
    python bench/probes/planner_ab.py decode64 6      # workload (decode64, decode256, spec256), rounds
    python bench/probes/planner_ab.py mooncake2000 6  # seconds to plan (Simulation built + run)

Both versions run in one process, alternating (base first in even rounds), so the shared
machine's slow and fast phases fall on both alike; the package uses relative imports only,
so the old copy loads under another name.
"""
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, '/tmp/abpkg')
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / 'bench'))
import bench_planner as bp  # noqa: E402
from hybridsim_base.config import parse_scenario as pb  # noqa: E402
from hybridsim_base.simulate import Simulation as SB  # noqa: E402
from hybridsim_base.workload import build_workload as wb  # noqa: E402


def steady(pkg, text, steps):
    if pkg == 'base':
        loaded = pb(text, "bench")
        sim = SB(loaded.scenario, wb(loaded))
    else:
        loaded = bp.parse_scenario(text, "bench")
        sim = bp.Simulation(loaded.scenario, bp.build_workload(loaded))
    it = iter(sim)
    n = loaded.scenario.workload.num_requests
    while True:  # warm up until every request is decoding (as bench_planner does)
        plan, _ = next(it)
        reqs = sim.scheduler.requests
        if len(plan.scheduled) == n and all(s.num_computed_tokens >= reqs[s.req_id].num_prompt_tokens
                                            for s in plan.scheduled):
            break
    t0 = time.perf_counter()
    for _ in range(steps):
        next(it)
    return steps / (time.perf_counter() - t0)


def whole(pkg, text):
    """Seconds to plan a whole workload: the Simulation built (requests, hashes) and run."""
    if pkg == 'base':
        loaded = pb(text, "bench")
        wl, sim_cls = wb(loaded), SB
    else:
        loaded = bp.parse_scenario(text, "bench")
        wl, sim_cls = bp.build_workload(loaded), bp.Simulation
    t0 = time.perf_counter()
    sim_cls(loaded.scenario, wl).run()
    return time.perf_counter() - t0


w = sys.argv[1]
rounds = int(sys.argv[2])
if w == 'mooncake2000':
    text, measure, unit = bp.mooncake_scenario(2000), whole, 's'
else:
    n, spec = {'decode64': (64, 0), 'decode256': (256, 0), 'spec256': (256, 3)}[w]
    text, unit = bp.decode_scenario(n, spec), 'steps/s'
    measure = lambda pkg, text: steady(pkg, text, 500)  # noqa: E731
res = {'base': [], 'new': []}
for r in range(rounds):
    for pkg in (('base', 'new') if r % 2 == 0 else ('new', 'base')):
        res[pkg].append(measure(pkg, text))
b, nw = statistics.median(res['base']), statistics.median(res['new'])
print(f"{w}: base {b:,.3f} {unit} {[round(x, 3) for x in res['base']]}  new {nw:,.3f} {unit} "
      f"{[round(x, 3) for x in res['new']]}  ratio {nw / b:.3f}")
