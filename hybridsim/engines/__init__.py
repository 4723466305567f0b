"""Other engines' own schedulers as hybridsim's planner (``run --scheduler ENGINE``).

hybridsim's scheduler (``sched/``) is a fast model of the engine's. An engine's own scheduler,
driven live in process, emits the same StepPlans, so the executor and the oracle check the
engine's plans exactly as they check ours. ``support`` is torch- and engine-free (the CLI asks
it before anything loads); ``vllm`` drives vLLM's V1 scheduler.
"""

from __future__ import annotations

SCHEDULERS = ("hybridsim", "vllm")
