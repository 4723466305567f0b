"""Workloads: requests with deterministic token ids, synthetic or imported from real traces."""

from __future__ import annotations

from ..config import LoadedScenario, SyntheticWorkload
from .base import Workload, WorkloadRequest
from .importers import build_from_trace
from .synthetic import build_synthetic


def build_workload(loaded: LoadedScenario) -> Workload:
    s = loaded.scenario
    wl = s.workload
    if isinstance(wl, SyntheticWorkload):
        return build_synthetic(wl, s.seed, s.scheduler.max_model_len)
    return build_from_trace(wl, loaded.resolve_path(wl.path), s.seed, s.scheduler.max_model_len,
                            loaded.where("workload", "path"))


__all__ = ["Workload", "WorkloadRequest", "build_workload"]
