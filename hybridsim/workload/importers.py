"""Real-trace importers: Mooncake JSONL, Azure 2023 CSV, BurstGPT CSV, Vidur CSV,
LLMServingSim workload JSONL, hybridsim traces, vLLM recordings.

Lengths and times scale as Vidur's trace replay does (``length_scale`` on both
prompt and output, ``time_scale`` on inter-arrival times). Mooncake hash ids
become token blocks: equal hash ids give equal tokens, so prefix sharing is
reproduced at any block size and any length scale. LLMServingSim workloads carry
real token ids, prompts and outputs: a scaled prompt keeps its first tokens (so
shared prefixes stay shared) and the simulated model commits the recorded outputs.
"""

from __future__ import annotations

import csv
import json
import math
import random
from contextlib import closing
from datetime import datetime
from itertools import islice
from pathlib import Path
from typing import Iterator

import numpy as np

from ..config import StepsArrival, TimestampArrival, TraceWorkload
from ..errors import InputError
from ..safe_load import bounded_lines
from .base import Workload, WorkloadRequest
from .synthetic import arrival_steps
from .tokens import combine, combine_many, token_block, token_rows


class _Row:
    __slots__ = ("time_s", "prompt_len", "output_len", "hash_ids", "prompt", "line", "req_id", "outputs")

    def __init__(self, time_s, prompt_len, output_len, line, hash_ids=None, prompt=None, req_id=None, outputs=None):
        self.req_id = req_id
        self.outputs = outputs  # recorded output token ids (LLMServingSim)
        self.time_s = time_s
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.hash_ids = hash_ids
        self.prompt = prompt
        self.line = line


def _read_jsonl(path: Path, limit: int | None, what: str, expected: str, row_of) -> tuple[list[_Row], list[str]]:
    """One row per non-empty line, made by ``row_of(record, line number)``; a line that is not
    such a record is one message naming it (``what`` it should be, the ``expected`` keys)."""
    rows = []
    with path.open() as f:
        for ln, line in bounded_lines(f, str(path)):  # (hostile lines refused: safe_load)
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise TypeError("a record must be a JSON object")
                rows.append(row_of(d, ln))
            except RecursionError:
                raise InputError(f"not {what} (nested too deeply); expected {expected}", f"{path}:{ln}") from None
            except (ValueError, KeyError, TypeError) as e:
                raise InputError(f"not {what} ({type(e).__name__}: {e}); expected {expected}", f"{path}:{ln}") from None
            if limit and len(rows) >= limit:
                break
    return rows, []


def _mooncake_row(d: dict, ln: int) -> _Row:
    return _Row(float(d["timestamp"]) / 1000.0, int(d["input_length"]), int(d["output_length"]), ln,
                hash_ids=[int(h) for h in d["hash_ids"]])


def _read_mooncake(path: Path, limit: int | None) -> tuple[list[_Row], list[str]]:
    return _read_jsonl(path, limit, "a Mooncake record", "timestamp, input_length, output_length, hash_ids",
                       _mooncake_row)


def _csv_records(path: Path) -> Iterator:
    """A CSV file, streamed: its header (names stripped; None for an empty file), then (line
    number, record) for every non-empty record."""
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        yield None if header is None else [h.strip() for h in header]
        for ln, rec in enumerate(reader, 2):
            if rec:
                yield ln, rec


def _read_csv(path: Path, limit: int | None) -> tuple[list[str], list[tuple[int, list[str]]]]:
    with closing(_csv_records(path)) as records:
        header = next(records)
        if header is None:
            raise InputError("empty CSV file", str(path))
        return header, list(islice(records, limit))


def _shown(header: list[str]) -> str:
    """A file's first line as a message quotes it: cut short (it may not be a CSV header at all)."""
    text = ",".join(header)
    return "no header" if not text else text if len(text) <= 80 else text[:77] + "..."


def _read_azure(path: Path, limit: int | None) -> tuple[list[_Row], list[str]]:
    header, recs = _read_csv(path, limit)
    want = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
    if header[:3] != want:
        raise InputError(f"Azure 2023 CSV header should be {','.join(want)}, found {_shown(header)}",
                         f"{path}:1")
    rows, t0 = [], None
    for ln, rec in recs:
        try:
            ts = rec[0].strip()
            # 7 fractional digits: keep microseconds
            if "." in ts:
                head, frac = ts.split(".")
                ts = f"{head}.{frac[:6]}"
            t = datetime.fromisoformat(ts).timestamp()
            t0 = t if t0 is None else t0
            rows.append(_Row(t - t0, int(rec[1]), int(rec[2]), ln))
        except (ValueError, IndexError) as e:
            raise InputError(f"bad Azure row ({e})", f"{path}:{ln}") from None
    return rows, []


def _read_vidur(path: Path, limit: int | None) -> tuple[list[_Row], list[str]]:
    header, recs = _read_csv(path, limit)
    if "num_prefill_tokens" not in header or "num_decode_tokens" not in header:
        raise InputError("Vidur CSV needs num_prefill_tokens and num_decode_tokens columns "
                         f"(found {_shown(header)})", f"{path}:1")
    ip, io = header.index("num_prefill_tokens"), header.index("num_decode_tokens")
    it = header.index("arrived_at") if "arrived_at" in header else None
    rows = []
    for ln, rec in recs:
        try:
            rows.append(_Row(float(rec[it]) if it is not None else None, int(float(rec[ip])),
                             int(float(rec[io])), ln))
        except (ValueError, IndexError) as e:
            raise InputError(f"bad Vidur row ({e})", f"{path}:{ln}") from None
    return rows, []


def _read_hybridsim(path: Path, limit: int | None) -> tuple[list[_Row], list[str]]:
    from ..trace import read_trace_requests  # local: trace depends on workload types

    rows = []
    for i, (wr, line) in enumerate(read_trace_requests(path)):
        rows.append(_Row(None, len(wr.prompt), wr.max_tokens, line, prompt=wr.prompt, req_id=wr.req_id))
        rows[-1].time_s = float(wr.arrival_step)
        if limit and len(rows) >= limit:
            break
    return rows, []


def _read_vllm_recorded(path: Path, limit: int | None) -> tuple[list[_Row], list[str]]:
    from ..vllm_recorded import load_recording  # local: it builds scenarios from config

    rec = load_recording(path)
    rows = []
    for r in rec.workload.requests[: limit or None]:
        rows.append(_Row(float(r.arrival_step), len(r.prompt), r.max_tokens, 2, prompt=r.prompt, req_id=r.req_id))
    return rows, []


_BURSTGPT = ("Timestamp", "Request tokens", "Response tokens")


def _read_burstgpt(path: Path, limit: int | None) -> tuple[list[_Row], list[str]]:
    """BurstGPT CSV (``Timestamp`` in seconds, ``Request tokens``, ``Response tokens``; its other
    columns are ignored). Rows with no request or no response tokens (failed calls) are skipped
    and counted; ``limit`` counts the requests kept."""
    rows, skipped = [], 0
    with closing(_csv_records(path)) as records:
        header = next(records) or []
        missing = [c for c in _BURSTGPT if c not in header]
        if missing:
            raise InputError(f"BurstGPT CSV needs the columns {', '.join(_BURSTGPT)}; missing {', '.join(missing)} "
                             f"(found {_shown(header)})", f"{path}:1")
        it, ip, io = (header.index(c) for c in _BURSTGPT)
        for ln, rec in records:
            try:
                t, p, o = float(rec[it]), int(float(rec[ip])), int(float(rec[io]))
            except (ValueError, IndexError) as e:
                raise InputError(f"bad BurstGPT row ({e})", f"{path}:{ln}") from None
            if p <= 0 or o <= 0:
                skipped += 1
                continue
            rows.append(_Row(t, p, o, ln))
            if limit and len(rows) >= limit:
                break
    notes = [f"{skipped} BurstGPT row(s) with no request or response tokens skipped"] if skipped else []
    return rows, notes


def _token_ids(d: dict, key: str) -> list[int]:
    ids = d[key]
    if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
        raise ValueError(f"{key} must be a non-empty list of token ids (ints >= 0)")
    count = key.replace("_tok_ids", "_toks")
    if count in d and d[count] != len(ids):
        raise ValueError(f"{count} is {d[count]} but {key} holds {len(ids)} tokens")
    return ids


def _llmservingsim_row(d: dict, ln: int) -> _Row:
    prompt, outputs = _token_ids(d, "input_tok_ids"), _token_ids(d, "output_tok_ids")
    t = d["arrival_time_ns"]
    if type(t) is not int or t < 0:
        raise ValueError("arrival_time_ns must be an int >= 0")
    return _Row(t / 1e9, len(prompt), len(outputs), ln, prompt=prompt, outputs=outputs)


def _read_llmservingsim(path: Path, limit: int | None) -> tuple[list[_Row], list[str]]:
    """LLMServingSim workload JSONL: ``input_tok_ids``, ``output_tok_ids``, ``arrival_time_ns``
    (``input_toks`` / ``output_toks``, when present, must match the lists)."""
    return _read_jsonl(path, limit, "an LLMServingSim workload record",
                       "input_tok_ids, output_tok_ids, arrival_time_ns", _llmservingsim_row)


def _hash_token_rows(rows: list[_Row], seed: int, per_hash: int, vocab: int):
    """Token block of every distinct Mooncake hash id, computed in one vectorised pass."""
    ids = sorted({h for r in rows if r.hash_ids is not None for h in r.hash_ids})
    if not ids:
        return None
    seeds = combine_many((seed, 0x4D), np.array([h & 0xFFFFFFFFFFFFFFFF for h in ids], dtype=np.uint64))
    return token_rows(seeds, per_hash, vocab), {h: k for k, h in enumerate(ids)}


_READERS = {"mooncake": _read_mooncake, "azure": _read_azure, "burstgpt": _read_burstgpt, "vidur": _read_vidur,
            "llmservingsim": _read_llmservingsim, "hybridsim": _read_hybridsim, "vllm-recorded": _read_vllm_recorded}
_STEP_TIMES = ("hybridsim", "vllm-recorded")  # their times are already engine steps


def build_from_trace(wl: TraceWorkload, path: Path, seed: int, max_model_len: int,
                     where: str = "workload.path") -> Workload:
    """The workload of the trace at ``path`` (``wl.path`` resolved); ``where``: the scenario's line for it."""
    if not path.exists():
        shown = "" if Path(wl.path).is_absolute() else f" (relative to the scenario's folder: {path.resolve()})"
        raise InputError(f"workload.path: trace file not found: {wl.path}{shown}", where)
    if not path.is_file():
        raise InputError(f"workload.path: {wl.path} is a folder, not a trace file", where)
    try:
        rows, notes = _READERS[wl.format](path, wl.limit)
    except (UnicodeDecodeError, csv.Error) as e:  # (a binary file, or a line no CSV reader takes)
        kind = "csv.Error" if isinstance(e, csv.Error) else type(e).__name__
        raise InputError(f"cannot read it as a trace of format {wl.format} ({kind}: {e})", str(path)) from None
    except OSError as e:  # (unreadable: permissions, a device)
        raise InputError(f"workload.path: cannot read {wl.path} ({e.strerror or type(e).__name__})", where) from None
    if not rows:
        raise InputError("the trace holds no requests", str(path))
    vocab = wl.vocab_size
    recorded = {}  # request id -> recorded output tokens
    if rows[0].outputs is not None:  # real token ids: the vocabulary must cover them
        top = max(max(max(r.prompt), max(r.outputs)) for r in rows)
        if top >= vocab:
            vocab = top + 1
            notes.append(f"vocab_size raised to {vocab:,} to cover the trace's token ids")
    # arrivals
    if isinstance(wl.arrival, TimestampArrival):
        if rows[0].time_s is None:
            raise InputError(f"{wl.format} file {path.name} has no timestamps; give workload.arrival "
                             "(poisson, fixed or steps)", "workload.arrival")
        t0 = rows[0].time_s
        if wl.format in _STEP_TIMES:
            steps = [int(r.time_s) for r in rows]
        else:
            steps = [max(0, math.floor((r.time_s - t0) * wl.time_scale / wl.arrival.step_seconds)) for r in rows]
    else:
        if isinstance(wl.arrival, StepsArrival) and len(wl.arrival.steps) != len(rows):
            raise InputError(f"arrival.steps has {len(wl.arrival.steps)} entries for {len(rows)} requests",
                             "workload.arrival.steps")
        steps = arrival_steps(wl.arrival, len(rows), random.Random(combine(seed, 0x5157)))
    scale = wl.length_scale
    per_hash = max(1, round(wl.hash_block_size * scale))
    hash_rows = _hash_token_rows(rows, seed, per_hash, vocab)
    out_seeds = combine_many((seed, 0xB2), np.arange(len(rows), dtype=np.uint64)).tolist()  # combine(seed, 0xB2, i)
    clipped = 0
    reqs = []
    arrays = []  # the prompts as int64 arrays (None once one does not fit)
    order = sorted(range(len(rows)), key=lambda i: (steps[i], i))
    for i in order:
        r = rows[i]
        plen = max(1, round(r.prompt_len * scale)) if r.prompt is None or r.outputs is not None else len(r.prompt)
        olen = max(1, round(r.output_len * scale)) if wl.format not in _STEP_TIMES else r.output_len
        if r.prompt is not None:  # (a scaled prompt of real tokens keeps its first ones)
            prompt = list(r.prompt[:plen])
        elif r.hash_ids is not None:  # (an array until clipped)
            tokens, where = hash_rows
            ids = r.hash_ids[: -(-plen // per_hash)]
            prompt = tokens[[where[h] for h in ids]].ravel()[:plen] if ids else np.zeros(0, dtype=np.int64)
            if len(prompt) < plen:  # fewer hash ids than the scaled length covers
                prompt = np.concatenate([prompt, token_block(combine(seed, 0xA1, i), plen - len(prompt), vocab)])
        else:
            prompt = token_block(combine(seed, 0xA1, i), plen, vocab)
        if len(prompt) >= max_model_len:
            prompt = prompt[: max_model_len - 1]
            clipped += 1
        arr = None
        if isinstance(prompt, np.ndarray):
            arr, prompt = prompt, prompt.tolist()
        if arrays is not None:
            if arr is None:
                try:
                    arr = np.array(prompt, dtype=np.int64)
                except OverflowError:  # token ids past int64: hashed one by one later
                    arrays = None
            if arrays is not None:
                arrays.append(arr)
        rid = r.req_id or f"r{i}"
        if r.outputs is not None:
            recorded[rid] = r.outputs
        reqs.append(WorkloadRequest(rid, steps[i], tuple(prompt), olen, 0, out_seeds[i]))
    if clipped:
        notes.append(f"{clipped} prompt(s) clipped to max_model_len - 1 = {max_model_len - 1} tokens")
    flat = np.concatenate(arrays) if arrays else None
    return Workload(reqs, vocab, f"{wl.format}:{path.name}", notes, prompt_tokens=flat, outputs=recorded or None)
