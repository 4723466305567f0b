"""What partial-block prefix hits buy: the same workload planned with whole-block units.

A scenario with ``cache.prefix_match_unit`` below its block size takes hits that end at unit
boundaries inside a block (``sched.partial``). To show a user what that is worth, the run
plans the same requests (same prompts, outputs and arrivals) once more with the unit equal to
the block — planning only, no execution, a fraction of the run's time — and the summary puts
that run's hit tokens beside its own.
"""

from __future__ import annotations

from typing import Optional

from .config import Scenario
from .simulate import Simulation
from .workload.base import Workload


def uses_partial_hits(s: Scenario) -> bool:
    unit = s.cache.prefix_match_unit
    return unit is not None and unit < s.cache.block_size


def whole_block_hit_tokens(s: Scenario, wl: Workload) -> Optional[int]:
    """Prefix hit tokens of the same workload with whole-block units (None when the scenario's
    unit is the block already)."""
    if not uses_partial_hits(s):
        return None
    whole = s.model_copy(update={"cache": s.cache.model_copy(update={"prefix_match_unit": None})})
    sim = Simulation(whole, wl)
    for _ in sim:
        pass
    return sim.stats.prefix_hit_tokens
