"""The repository carries its data: every file under data/ is listed in data/SOURCES.md with its
sha256, every trace path of a scenario lies inside the repository, and nothing points outside it."""

from __future__ import annotations

import hashlib
import re

import yaml

from .conftest import DATA, REPO, SCENARIOS


def listed_digests() -> dict[str, str]:
    text = (DATA / "SOURCES.md").read_text()
    return {path: digest for digest, path in re.findall(r"^([0-9a-f]{64})  (\S+)$", text, re.M)}


def test_every_shipped_file_is_listed_with_its_sha256():
    shipped = {p.relative_to(DATA).as_posix() for p in DATA.rglob("*") if p.is_file() and p.name != "SOURCES.md"}
    listed = listed_digests()
    assert shipped == set(listed)
    for rel, digest in listed.items():
        assert hashlib.sha256((DATA / rel).read_bytes()).hexdigest() == digest, rel


def test_data_stays_lean():
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 5_000_000, f"data/ holds {total:,} bytes: ship slices, keep full traces out (data/SOURCES.md)"


def test_scenario_trace_paths_lie_inside_the_repository():
    traces = 0
    for path in SCENARIOS:
        wl = (yaml.safe_load(path.read_text()) or {}).get("workload") or {}
        if wl.get("kind") == "trace":
            target = (path.parent / wl["path"]).resolve()
            assert target.is_relative_to(REPO) and target.is_file(), f"{path.name}: {wl['path']}"
            traces += 1
    assert traces >= 4


def test_nothing_points_outside_the_repository():
    """No file refers to the team's shelf beside the checkout (a fresh clone has nothing there)."""
    outside = re.compile(r"\.\./shared|/work/" + "shared")
    skip = {".git", ".venv", ".peer-venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist", "out", ".gl"}
    hits = []
    for p in REPO.rglob("*"):
        parts = p.relative_to(REPO).parts  # (build outputs and ignored folders are not the repository's)
        if skip.intersection(parts) or any(part.endswith(".egg-info") for part in parts):
            continue
        if p.is_file() and p.stat().st_size < 5_000_000:
            try:
                text = p.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            hits += [f"{p.relative_to(REPO)}:{i}" for i, line in enumerate(text.splitlines(), 1)
                     if outside.search(line)]
    assert not hits, hits
