"""Our scheduler against the real vLLM 0.33 scheduler's recordings, step by step."""

from __future__ import annotations

import pytest

from hybridsim.convert import convert_recording
from hybridsim.errors import InputError
from hybridsim.fidelity import run_fidelity
from hybridsim.trace import read_trace
from hybridsim.vllm_recorded import load_recording

from .conftest import RECORDINGS, need_shared


def test_recordings_present():
    need_shared()
    assert len(RECORDINGS) >= 3


@pytest.mark.parametrize("rec", RECORDINGS, ids=lambda p: p.stem)
def test_every_recorded_step_identical(rec):
    rep = run_fidelity(str(rec))
    assert rep.steps_recorded > 0
    assert rep.identical_steps_pct == 100.0, [d.__dict__ for d in rep.diffs[:5]]
    # bookkeeping matches too, not just decisions
    assert rep.free_blocks_equal == rep.steps_recorded
    assert rep.block_ids_equal == rep.steps_recorded


@pytest.mark.parametrize("rec", RECORDINGS, ids=lambda p: p.stem)
def test_recording_converts_to_a_consistent_trace(rec, tmp_path):
    out = tmp_path / f"{rec.stem}.jsonl"
    n = convert_recording(rec, out)
    tr = read_trace(out)  # raises on any accounting inconsistency
    assert len(tr.steps) == n > 0
    assert tr.header["groups"][0]["kind"] == "mamba"


def test_cut_recording_is_bad_input(tmp_path):
    """A recording cut inside a string: file, line and column, the decoder's message said once."""
    p = tmp_path / "cut.jsonl"
    p.write_text('{"type": "config", "mod')
    with pytest.raises(InputError) as ei:
        load_recording(p)
    assert ei.value.where == f"{p}:1"
    assert ei.value.message == "not valid JSON (Unterminated string starting at column 20)"
