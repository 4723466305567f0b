"""Check tallies: every named check counts comparisons, failures and the first failure.

A check that passes has compared real values: ``count`` is the number of
comparisons made, so a check that never ran shows 0, not "passed".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Failure:
    step: int
    request: Optional[str]
    message: str
    layer: Optional[str] = None
    position: Optional[int] = None
    max_abs_err: Optional[float] = None
    max_rel_err: Optional[float] = None

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


@dataclass
class CheckTally:
    name: str
    count: int = 0
    failures: int = 0
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    first_failure: Optional[Failure] = None
    examples: list[Failure] = field(default_factory=list)

    def passed(self, n: int = 1) -> None:
        self.count += n

    def failed(self, f: Failure) -> None:
        self.count += 1
        self.failures += 1
        if self.first_failure is None:
            self.first_failure = f
        if len(self.examples) < 20:
            self.examples.append(f)

    def as_dict(self) -> dict:
        return {"name": self.name, "count": self.count, "failures": self.failures,
                "max_abs_err": self.max_abs_err, "max_rel_err": self.max_rel_err,
                "first_failure": self.first_failure.as_dict() if self.first_failure else None}


class Checks:
    def __init__(self):
        self.tallies: dict[str, CheckTally] = {}
        self.divergence: dict[str, int] = {}  # request -> first step any check failed for it

    def get(self, name: str) -> CheckTally:
        t = self.tallies.get(name)
        if t is None:
            t = self.tallies[name] = _Tally(name, self)
        return t

    @property
    def failed(self) -> bool:
        return any(t.failures for t in self.tallies.values())

    def as_list(self) -> list[dict]:
        return [t.as_dict() for t in self.tallies.values()]


class _Tally(CheckTally):
    """A tally that also records each request's first divergent step in its ``Checks``."""

    def __init__(self, name: str, owner: Checks):
        super().__init__(name)
        self._owner = owner

    def failed(self, f: Failure) -> None:
        super().failed(f)
        if f.request is not None and f.request not in self._owner.divergence:
            self._owner.divergence[f.request] = f.step
