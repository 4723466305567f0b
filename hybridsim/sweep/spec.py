"""Sweep files: a base scenario, a grid of dotted-key overrides, seeds; expanded into cells.

Every cell is built and validated (schema, cross-field rules, workload fit, executability)
before anything runs, so that a typo in the 37th cell costs nothing: it is refused with one
message naming the cell and the key, the way a bad scenario file is (``config.py``).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..config import LoadedScenario, Scenario, _format_pydantic, _LineMap
from ..errors import InputError, read_text
from ..safe_load import load_yaml


class SweepFile(BaseModel):
    """The schema of SWEEP.yaml (keys are a contract, like the scenario's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base: str = Field(..., min_length=1, description="scenario file, relative to the sweep file")
    grid: dict[str, list[Any]] = Field(default_factory=dict, description="dotted scenario key -> values")
    zip: list[dict[str, list[Any]]] = Field(default_factory=list, description="keys that vary together")
    seeds: Optional[list[int]] = Field(None, min_length=1, description="each cell runs once per seed")
    exclude: list[dict[str, Any]] = Field(default_factory=list, description="partial cells to leave out")
    inject_bug: list[str] = Field(default_factory=list, description="known-wrong variants for every cell")


@dataclass(frozen=True)
class Cell:
    """One scenario of a sweep: its overrides, seed and validated scenario (plain data, picklable)."""

    index: int
    label: str  # "block_size=16 num_speculative_tokens=3 seed=0": the row key of results.csv
    values: dict[str, Any]  # dotted key -> value, in column order
    seed: int
    raw: dict  # the scenario as a plain dict (what a worker validates again)
    base_dir: str  # for a trace workload's relative path
    source: str

    def loaded(self) -> LoadedScenario:
        """The cell's scenario, rebuilt where it runs (another process or machine)."""
        scenario = Scenario.model_validate(self.raw)
        return LoadedScenario(scenario, Path(self.base_dir), self.source, _LineMap("", self.source))

    @property
    def slug(self) -> str:
        """A file name for this cell's artefacts (its recorded trace)."""
        safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in self.label)
        return f"{self.index:03d}_{safe[:80]}"


@dataclass
class Sweep:
    path: Path
    keys: list[str]  # grid and zip keys in column order
    cells: list[Cell]
    bugs: list[str] = field(default_factory=list)


def _set(raw: dict, key: str, value: Any, where: str) -> None:
    """Set a dotted key (``cache.block_size``, ``faults.0.at_step``) in a scenario dict."""
    parts = key.split(".")
    cur: Any = raw
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(cur, list):
            if not part.isdigit() or int(part) >= len(cur):
                raise InputError(f"{key}: {'.'.join(parts[:i]) or key} is a list of {len(cur)}; "
                                 f"{part!r} is not an index in it", where)
            part = int(part)  # type: ignore[assignment]
            if last:
                cur[part] = value
            else:
                cur = cur[part]
            continue
        if not isinstance(cur, dict):
            raise InputError(f"{key}: {'.'.join(parts[:i])} is a value, not a section", where)
        if last:
            cur[part] = value
        else:
            if cur.get(part) is None:
                cur[part] = {}
            cur = cur[part]


def _short_names(keys: list[str]) -> dict[str, str]:
    """Each key's last dotted part, or the whole key where two keys share a last part."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def _fmt(v: Any) -> str:
    return "null" if v is None else (str(v).lower() if isinstance(v, bool) else str(v))


def _dims(spec: SweepFile, lines: _LineMap) -> list[list[dict[str, Any]]]:
    """The sweep's dimensions: one per grid key, one per zip group (its keys move together)."""
    dims: list[list[dict[str, Any]]] = []
    seen: set[str] = set()
    for key, values in spec.grid.items():
        if not values:
            raise InputError(f"grid.{key}: an empty list (a grid of no cells)", lines.where(("grid", key)))
        dims.append([{key: v} for v in values])
        seen.add(key)
    for g, group in enumerate(spec.zip):
        lengths = {k: len(v) for k, v in group.items()}
        if not group or len(set(lengths.values())) != 1 or 0 in lengths.values():
            raise InputError(f"zip[{g}]: the lists of a zip group vary together, so they need the same "
                             f"non-zero length (have {lengths})", lines.where(("zip", g)))
        for key in group:
            if key in seen:
                raise InputError(f"{key} is swept twice (grid and zip, or two zip groups)",
                                 lines.where(("zip", g, key)))
            seen.add(key)
        n = next(iter(lengths.values()))
        dims.append([{k: group[k][i] for k in group} for i in range(n)])
    if "seed" in seen:
        raise InputError("seed: sweep seeds with the seeds: list (the results' seed column)",
                         lines.where(("grid", "seed")) if "seed" in spec.grid else lines.where(("zip",)))
    return dims


def load_sweep(path: str | Path) -> Sweep:
    """Read SWEEP.yaml, expand its cells and validate every one; raise ``InputError`` on the first bad one."""
    p = Path(path)
    if not p.is_file():
        raise InputError("no such sweep file" if not p.exists() else "is a folder, not a sweep file", str(p))
    text = read_text(p)
    lines = _LineMap(text, str(p))
    raw = load_yaml(text, str(p))
    if not isinstance(raw, dict):
        raise InputError("a sweep file is a YAML mapping (base, grid, seeds, zip, exclude)", str(p))
    try:
        spec = SweepFile.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(err["loc"])
        msg = "unknown key (a sweep file has base, grid, zip, seeds, exclude, inject_bug)" \
            if err["type"] == "extra_forbidden" else err["msg"]
        raise InputError(f"{'.'.join(map(str, loc)) or '(top level)'}: {msg}", lines.where(loc)) from None
    base = (p.parent / spec.base) if not Path(spec.base).is_absolute() else Path(spec.base)
    if not base.is_file():
        raise InputError(f"base: no such scenario file {base}", lines.where(("base",)))
    base_text = read_text(base)
    base_lines = _LineMap(base_text, str(base))
    base_raw = load_yaml(base_text, str(base))
    if not isinstance(base_raw, dict):
        raise InputError("a scenario is a YAML mapping (name, model, cache, workload, ...)", str(base))
    if spec.inject_bug:
        from ..bugs import check_bugs
        try:
            check_bugs(spec.inject_bug)
        except InputError as e:
            raise InputError(f"inject_bug: {e.message}", lines.where(("inject_bug",))) from None
    dims = _dims(spec, lines)
    keys = [k for d in dims for k in d[0]]
    short = _short_names(keys)
    seeds = spec.seeds if spec.seeds is not None else [None]
    cells: list[Cell] = []
    labels: set[str] = set()
    combos = list(itertools.product(*dims)) if dims else [()]
    for combo in combos:
        values: dict[str, Any] = {}
        for part in combo:
            values.update(part)
        if any(all(k in values and values[k] == v for k, v in ex.items()) for ex in spec.exclude):
            continue
        for seed in seeds:
            cell = _build_cell(len(cells), values, seed, base_raw, base, base_lines, lines, short)
            if spec.inject_bug:  # (a bug in a layer kind the cell's model lacks would change nothing)
                from ..bugs import inapplicable_bugs
                missing = inapplicable_bugs(cell.loaded().scenario, set(spec.inject_bug))
                if missing:
                    raise InputError(f"cell {len(cells) + 1} ({cell.label}): inject_bug: {missing[0]}",
                                     lines.where(("inject_bug",)))
            if cell.label in labels:
                raise InputError(f"cell {cell.label} appears twice (a value repeats in the grid)",
                                 lines.where(("grid",)))
            labels.add(cell.label)
            cells.append(cell)
    for i, ex in enumerate(spec.exclude):
        unknown = [k for k in ex if k not in keys and k != "seed"]
        if unknown:
            raise InputError(f"exclude[{i}]: {unknown[0]} is not a swept key", lines.where(("exclude", i)))
    if not cells:
        raise InputError("every cell is excluded: nothing to run", lines.where(("exclude",)))
    return Sweep(p, keys, cells, list(spec.inject_bug))


def _build_cell(index: int, values: dict[str, Any], seed: Optional[int], base_raw: dict, base: Path,
                base_lines: _LineMap, lines: _LineMap, short: dict[str, str]) -> Cell:
    raw = copy.deepcopy(base_raw)
    for key, v in values.items():
        _set(raw, key, v, lines.where(("grid", key)))
    if seed is not None:
        raw["seed"] = seed
    label = " ".join([f"{short[k]}={_fmt(v)}" for k, v in values.items()]
                     + ([f"seed={seed}"] if seed is not None else [])) or "base"
    cell_seed = seed if seed is not None else raw.get("seed", 0)
    what = f"cell {index + 1} ({label})"
    try:
        scenario = Scenario.model_validate(raw)
    except ValidationError as e:
        problem = _format_pydantic(e, raw, base_lines)
        raise InputError(f"{what}: {problem.message}", _where(problem.message, values, lines, problem.where)) from None
    loaded = LoadedScenario(scenario, base.parent, f"{base} [{label}]", base_lines)
    _check_runs(loaded, what, values, lines)
    return Cell(index, label, dict(values), int(cell_seed), scenario.model_dump(mode="json"), str(base.parent),
                f"{base} [{label}]")


def _where(message: str, values: dict[str, Any], lines: _LineMap, fallback: Optional[str]) -> Optional[str]:
    """The sweep file's line of the swept key a problem names, else where the base file has it."""
    named = message.split(":", 1)[0]  # the key path the problem names ("cache.block_size")
    for key in values:
        if named == key or key.startswith(named + ".") or named.startswith(key + "."):
            return lines.where(("grid", key)) if ("grid", key) in lines.lines else _zip_where(key, lines)
    return fallback


def _zip_where(key: str, lines: _LineMap) -> str:
    for path in lines.lines:
        if len(path) == 3 and path[0] == "zip" and path[2] == key:
            return lines.where(path)
    return lines.where(())


def _check_runs(loaded: LoadedScenario, what: str, values: dict[str, Any], lines: _LineMap) -> None:
    """What ``run`` refuses after the schema: a workload that does not fit, a mode that cannot execute."""
    from ..runner import check_workload_fits
    from ..workload import build_workload

    s = loaded.scenario
    try:
        check_workload_fits(loaded, build_workload(loaded))
    except InputError as e:
        raise InputError(f"{what}: {e.message}", _where(e.message, values, lines, e.where)) from None
    if s.execution.scheduler == "vllm":  # (an engine's scheduler: installed here, or nothing runs)
        from ..engines.support import require_vllm
        require_vllm()
    why = s.cannot_execute() if s.execution.check != "off" else None
    if why:
        raise InputError(f"{what}: {why} (leave the cell out with exclude:, or set execution.check: off)",
                         lines.where(("grid",)))
