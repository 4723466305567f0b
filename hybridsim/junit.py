"""The golden gate's verdicts as JUnit XML (``replay --check --junit FILE``), the report format CI
systems display (GitHub Actions through a JUnit publishing action, GitLab's ``artifacts:reports:
junit``, Jenkins' ``junit`` step).

One test case per trace: a trace whose checks fail, or whose results differ from its expected file,
is a ``<failure>`` whose message is the first failing check with its first divergence (the body lists
every failing check's first divergence, then every difference); a trace that is not even a
well-formed trace (bad input) or whose replay died is an ``<error>``; a trace without an expected
file is a failure too (the gate fails it).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path

from .golden import GoldenRow

_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")  # (characters XML 1.0 cannot hold)
_ERRORS = {"bad input": "bad input", "died": "worker died", "error": "error"}
SUITE = "hybridsim replay --check"


def _text(s: str) -> str:
    return _NOT_XML.sub("?", s)


def _case(row: GoldenRow, path: Path) -> ET.Element:
    case = ET.Element("testcase", classname=_text(str(path.parent)), name=_text(path.name),
                      file=_text(str(path)), time=f"{row.wall_s:.3f}")
    if row.result in ("pass", "updated", "unchanged"):
        return case
    if row.result in _ERRORS:
        message = row.differences[0] if row.differences else row.result
        err = ET.SubElement(case, "error", type=_ERRORS[row.result], message=_text(message))
        err.text = _text("\n".join(row.differences))
        return case
    checks = [f"{name}: {where}" for name, where in row.first_failures.items()]
    message = checks[0] if checks else (row.differences[0] if row.differences else row.result)
    kind = next(iter(row.first_failures), "expected file")
    fail = ET.SubElement(case, "failure", type=_text(kind), message=_text(message))
    body = []
    if checks:
        body += ["first divergence of each failing check:", *(f"  {c}" for c in checks)]
    if row.differences:
        body += [f"differences from {path.name[:-len('.jsonl')] if path.name.endswith('.jsonl') else path.name}"
                 ".expected.json:" if row.result != "no expected file" else "no expected file:",
                 *(f"  {d}" for d in row.differences)]
    fail.text = _text("\n".join(body))
    return case


def junit_xml(rows: list[GoldenRow], paths: list[Path]) -> str:
    """The JUnit document for the gate's rows (``paths``: the trace of each row, in order)."""
    cases = [_case(r, p) for r, p in zip(rows, paths)]
    failures = sum(c.find("failure") is not None for c in cases)
    errors = sum(c.find("error") is not None for c in cases)
    total = f"{sum(r.wall_s for r in rows):.3f}"
    counts = {"tests": str(len(cases)), "failures": str(failures), "errors": str(errors), "skipped": "0",
              "time": total}
    root = ET.Element("testsuites", name=SUITE, **counts)
    suite = ET.SubElement(root, "testsuite", name=SUITE, **counts)
    suite.extend(cases)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
