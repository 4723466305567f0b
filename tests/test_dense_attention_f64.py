"""The float64 attention kernels the GPU oracle runs (``kernels/dense_attention_f64.py``: queries
projected from token ids inside the attention kernels, keys there too or, for long rows, once into
a workspace) against their torch definition: the queries bit for bit (``GQAStack.queries``), the
outputs to float64 rounding, packed rows in shuffled order, decode rows and long chunks over
context, GQA groups of 1, 3 and 4 heads, head sizes whose half is and is not a power of two,
tokens between rows that no row owns (a read past a row's keys changes its output), a workspace
bound that splits long rows into chunks and passes or leaves a row to the in-kernel projection,
decode rows' keys split into ranges merged after (at a range's boundary, across one, a bound on
the partial results), outputs poisoned first (a query left unwritten shows)."""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridsim.kernels import dense_attention_f64 as dense  # noqa: E402
from hybridsim.kernels.dense_attention_f64 import probe_attention, probe_attention_reference, tile_queries  # noqa: E402
from hybridsim.layers.gqa import GQAProbe, GQAStack  # noqa: E402
from hybridsim.layers.mla import TABLE, TABLE2  # noqa: E402
from hybridsim.model import AttentionGeometry  # noqa: E402

from .helpers import compile_for_hopper  # noqa: E402

INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")
ROWS = [(1, 0), (1, 37), (3, 70), (4, 5), (17, 0), (40, 23), (9, 100)]  # (queries, keys before them)


def _check(heads: int, kv_heads: int, d: int, seed: int, device: str, rows=ROWS,
           workspace_elems: int | None = None) -> None:
    geo = AttentionGeometry(layers=2, heads=heads, kv_heads=kv_heads, head_dim=d, dtype="bfloat16")
    stack = GQAStack([GQAProbe(geo, layer, seed) for layer in range(2)], device)
    rng = random.Random(seed)
    rows = list(rows)
    rng.shuffle(rows)
    q_len, pos0 = [a for a, _ in rows], [b for _, b in rows]
    gap = 3  # tokens no row owns, between rows
    k_start = [sum(a + b + gap for a, b in rows[:i]) for i in range(len(rows))]
    tokens = torch.tensor([rng.randrange(0, 3_000_000) for _ in range(k_start[-1] + sum(rows[-1]) + gap)],
                          device=device)
    q_start = [sum(q_len[:i]) for i in range(len(rows))]
    want = probe_attention_reference(stack, tokens, q_start, q_len, k_start, pos0)
    assert want.shape == (2, sum(q_len), heads, d) and torch.isfinite(want).all()
    out = torch.full_like(want, float("nan"))
    got = probe_attention(stack.cast(torch.float32), tokens, q_start, q_len, k_start, pos0, out=out,
                          workspace_elems=workspace_elems)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)


def _check_queries(heads: int, kv_heads: int, d: int, seed: int, device: str, rows) -> None:
    """The queries the attention kernels project in their tiles (small and large; the workspace
    tiles' size too), written out: ``GQAStack.queries``' float64 values bit for bit, for fresh
    token ids over the whole table range (both embedding tables' every row) at the rows'
    positions; packed rows with gaps, outputs poisoned first."""
    geo = AttentionGeometry(layers=2, heads=heads, kv_heads=kv_heads, head_dim=d, dtype="bfloat16")
    stack = GQAStack([GQAProbe(geo, layer, seed) for layer in range(2)], device)
    rng = random.Random(seed)
    q_len, pos0 = [a for a, _ in rows], [b for _, b in rows]
    k_start = [sum(a + b + 5 for a, b in rows[:i]) for i in range(len(rows))]
    tokens = torch.tensor([rng.randrange(0, TABLE * TABLE2) for _ in range(k_start[-1] + sum(rows[-1]))],
                          device=device)
    q_start = [sum(q_len[:i]) + 2 * i for i in range(len(rows))]  # (two query slots no row owns between rows)
    qtok = torch.cat([tokens[ks + p0: ks + p0 + ql] for ks, p0, ql in zip(k_start, pos0, q_len)])
    qpos = torch.cat([torch.arange(p0, p0 + ql, device=device) for p0, ql in zip(pos0, q_len)])
    want = stack.queries(qtok, qpos, max(qpos.tolist()) + 1)
    slots = torch.cat([torch.arange(qs, qs + ql) for qs, ql in zip(q_start, q_len)]).to(device)
    G = heads // kv_heads
    GP = 1 << (G - 1).bit_length()
    for bq in sorted({max(1, dense.M_SHORT // GP), max(1, dense.M_LONG // GP), max(1, dense.WORKSPACE[0] // GP)}):
        out = torch.full((2, q_start[-1] + q_len[-1] + 2, heads, d), float("nan"), dtype=torch.float64, device=device)
        got = tile_queries(stack.cast(torch.float32), tokens, q_start, q_len, k_start, pos0, bq, out=out)
        assert got.data_ptr() == out.data_ptr()
        # the bits (a -0.0 for a 0.0 would show)
        assert torch.equal(got[:, slots].view(torch.int64), want.view(torch.int64)), bq
        unowned = torch.ones(out.shape[1], dtype=torch.bool, device=device)
        unowned[slots] = False
        assert torch.isnan(got[:, unowned]).all()  # nothing written past a row's queries


def _launches(monkeypatch) -> dict[str, list]:
    """The routes ``probe_attention`` takes, recorded: the query counts of the rows each in-kernel
    launch takes, (query counts, (layer, KV head) pairs a pass) of each workspace chunk, and
    for the decode rows (query counts, the key ranges' length, each tile's ranges) where their
    keys are split (else they are in "projecting")."""
    seen: dict[str, list] = {"projecting": [], "workspace": [], "split": []}
    projecting, workspace, split_plan = dense._attend_projecting, dense._attend_workspace, dense._split_plan

    def spy_projecting(c, rows, bq, warps):
        seen["projecting"].append(sorted(c.q_len[r] for r in rows))
        return projecting(c, rows, bq, warps)

    def spy_workspace(c, rows, step):
        seen["workspace"].append((sorted(c.q_len[r] for r in rows), step))
        return workspace(c, rows, step)

    def spy_split_plan(c, rows, bq, split, bound):
        plan = split_plan(c, rows, bq, split, bound)
        if plan is not None:
            seen["split"].append((sorted(c.q_len[r] for r in rows), plan[0],
                                  sorted((c.q_len[r], c.pos0[r], ranges) for r, _, ranges in plan[1])))
        return plan

    monkeypatch.setattr(dense, "_attend_projecting", spy_projecting)
    monkeypatch.setattr(dense, "_attend_workspace", spy_workspace)
    monkeypatch.setattr(dense, "_split_plan", spy_split_plan)
    return seen


@INTERPRETER
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 32), (6, 2, 24), (4, 4, 16)], ids=["group4", "group3-d24", "mha"])
def test_float64_attention_kernel_equals_the_definition(heads, kv_heads, d):
    _check(heads, kv_heads, d, 11, "cpu")


@INTERPRETER
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 32), (6, 2, 24), (4, 4, 16), (32, 8, 128)],
                         ids=["group4", "group3-d24", "mha", "nemotron"])
def test_queries_projected_in_the_kernels_are_exact(heads, kv_heads, d):
    """Rows of 1 to 13 queries at positions up to about 4,000."""
    _check_queries(heads, kv_heads, d, 17, "cpu", rows=[(3, 4000), (1, 0), (13, 2500), (6, 37), (2, 3990)])


@INTERPRETER
def test_long_rows_attend_over_one_shared_workspace(monkeypatch):
    """Prefill chunks of several query tiles (groups of 4: 2 queries a decode tile, 8 a long one)
    share one workspace holding every (layer, KV head) of their keys; a row of one long tile and
    the decodes project their keys in the kernel."""
    seen = _launches(monkeypatch)
    _check(8, 2, 32, 23, "cpu", rows=[(2, 40), (1, 0), (7, 30), (64, 0), (33, 90), (9, 5)])
    assert seen["projecting"] == [[1, 2], [7]]
    assert seen["workspace"] == [([9, 33, 64], 2 * 2)]  # 2 layers x 2 KV heads at once


@INTERPRETER
def test_a_small_workspace_splits_long_rows(monkeypatch):
    """A bound of 40 keys with every (layer, KV head): rows of 17 and 35 keys in chunks of their
    own, a row of 52 keys alone three pairs a pass (then the fourth), and a row of 170 keys (more
    than the bound holds for even one pair) projecting its keys in the kernel, with the one-tile
    row."""
    seen = _launches(monkeypatch)
    pairs, per_pair = 2 * 2, 2 * 32
    _check(8, 2, 32, 31, "cpu", rows=[(1, 0), (3, 70), (6, 5), (17, 0), (20, 15), (12, 40), (30, 140)],
           workspace_elems=pairs * per_pair * 40)
    assert seen["projecting"] == [[1, 3], [6, 30]]
    assert sorted(seen["workspace"]) == [([12], 3), ([17], pairs), ([20], pairs)]


# decode rows (groups of 4: up to 4 queries a tile) over 20-150 keys in ranges of 32 (one key
# block: the interpreter's time goes with the keys; test_a_small_partial_bound_takes_longer_ranges
# has ranges of two blocks): one range (20 and 31 keys before), a last range of one key (32), of
# the tile's queries alone (3 at 64, a boundary), across a boundary (2 at 95, 4 at 126), and beside
# them a one-tile row and a workspace row
SPLIT_ROWS = [(1, 20), (1, 31), (1, 32), (3, 64), (2, 95), (4, 126), (1, 149), (7, 30), (17, 20)]


@INTERPRETER
@pytest.mark.parametrize("heads,kv_heads,d", [(8, 2, 32), (6, 2, 24)], ids=["group4", "group3-d24"])
def test_decode_rows_split_their_keys_into_ranges(monkeypatch, heads, kv_heads, d):
    """Ranges of 32 keys: a program per range writes partial results, one launch merges them;
    rows of one range and rows of five agree with the definition alike."""
    monkeypatch.setattr(dense, "DECODE_SPLIT_KEYS", 32)
    seen = _launches(monkeypatch)
    _check(heads, kv_heads, d, 41, "cpu", rows=SPLIT_ROWS)
    assert seen["projecting"] == [[7]] and seen["workspace"] == [([17], 2 * 2)]
    assert seen["split"] == [([1, 1, 1, 1, 2, 3, 4], 32, [
        (1, 20, [(0, 21)]), (1, 31, [(0, 32)]), (1, 32, [(0, 32), (32, 33)]),
        (1, 149, [(0, 32), (32, 64), (64, 96), (96, 128), (128, 150)]),
        (2, 95, [(0, 32), (32, 64), (64, 97)]), (3, 64, [(0, 32), (32, 64), (64, 67)]),
        (4, 126, [(0, 32), (32, 64), (64, 96), (96, 130)])])]


@INTERPRETER
def test_a_small_partial_bound_takes_longer_ranges(monkeypatch):
    """Partial results bounded: ranges of 32 keys would take 17 slots, of 64 keys 10 (each 2
    layers x 2 KV heads x 16 (query, head) rows x 34 float64); a bound of 10 slots doubles the
    range (to two key blocks), a bound of 4 (ranges of 128 keys would take 6) leaves every tile one
    range (no merge)."""
    monkeypatch.setattr(dense, "DECODE_SPLIT_KEYS", 32)
    slot = 2 * 2 * 16 * (32 + 2)
    rows = [(1, 32), (3, 64), (2, 95), (4, 126), (1, 149)]
    seen = _launches(monkeypatch)
    monkeypatch.setattr(dense, "PARTIAL_ELEMS", 10 * slot)
    _check(8, 2, 32, 43, "cpu", rows=rows)
    assert [split for _, split, _ in seen["split"]] == [64] and seen["projecting"] == []
    monkeypatch.setattr(dense, "PARTIAL_ELEMS", 4 * slot)
    _check(8, 2, 32, 44, "cpu", rows=rows)
    assert len(seen["split"]) == 1 and seen["projecting"] == [[1, 1, 2, 3, 4]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("heads,kv_heads,d", [(32, 8, 128), (16, 2, 256), (6, 2, 24)])
def test_float64_attention_kernel_on_the_gpu(heads, kv_heads, d):
    _check(heads, kv_heads, d, 12, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_queries_projected_in_the_kernels_are_exact_on_the_gpu():
    """Compiled (TF32 on the tensor cores): still GQAStack.queries' bits, at Nemotron-H-8B's geometry."""
    _check_queries(32, 8, 128, 15, "cuda", rows=[(1, 9000), (3, 12000), (600, 0), (40, 700)])
    _check_queries(6, 2, 24, 16, "cuda", rows=[(1, 300), (17, 4000), (5, 0)])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_long_rows_on_the_gpu_with_a_split_workspace():
    """Nemotron-H-8B's attention geometry, long chunks over context: one workspace, then a bound
    that takes the longest row a few pairs a pass and leaves a row too long for one pair."""
    rows = [(1, 3000), (3, 1200), (600, 0), (300, 2000), (40, 700), (200, 9000)]
    _check(32, 8, 128, 13, "cuda", rows=rows)
    _check(32, 8, 128, 14, "cuda", rows=rows, workspace_elems=2 * 128 * 3000)


_COMPILE_FOR_HOPPER = """
import os
import re
import shutil
import subprocess
import tempfile

import triton.backends.nvidia
from triton import compile as build
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridsim.kernels import dense_attention_f64 as dense
from hybridsim.layers.gqa import V_SHIFT
from hybridsim.layers.mla import HIDDEN, ROPE_SHIFT, TABLE, TABLE2

# Nemotron-H-8B: 32 heads over 8 KV heads (groups of 4), head size 128
G, D = 4, 128
tmp = tempfile.mkdtemp()
tools = os.path.join(os.path.dirname(triton.backends.nvidia.__file__), "bin")
rows, keys, warps, stages = dense.WORKSPACE
scaled = dict(K_SHIFT=2.0 ** -ROPE_SHIFT, V_SCALE=2.0 ** -V_SHIFT)
tables = dict(HID=HIDDEN, T1=TABLE, T2=TABLE2)
short = dict(G=G, GP=G, BQ=dense.M_SHORT // G, BN=dense.KEYS_PER_BLOCK, **tables, **scaled)
cases = (
    ("short", dense._probe_attention_kernel, dict(short, PARTIAL=False), dense.WARPS_SHORT, dense.STAGES),
    ("split", dense._probe_attention_kernel, dict(short, PARTIAL=True), dense.WARPS_SHORT, dense.STAGES),
    ("merge", dense._merge_ranges_kernel, dict(G=G, GP=G, BQ=dense.M_SHORT // G, V_SCALE=scaled["V_SCALE"]),
     dense.MERGE_WARPS, 1),
    ("long", dense._probe_attention_kernel, dict(G=G, GP=G, BQ=dense.M_LONG // G, BN=dense.KEYS_PER_BLOCK, **tables,
                                                 **scaled, PARTIAL=False), dense.WARPS_LONG, dense.STAGES),
    ("project", dense._project_keys_kernel, dict(BN=dense.PROJECT_KEYS, **tables), dense.PROJECT_WARPS, 1),
    ("workspace", dense._workspace_attention_kernel, dict(G=G, GP=G, BQ=rows // G, BN=keys, **tables, **scaled), warps,
     stages),
)
for name, kern, const, warps, stages in cases:
    const = dict(const, D=D, BH=D // 2)
    names = kern.arg_names
    sig = {}
    for arg in names:
        if arg in const:
            sig[arg] = "constexpr"
        elif arg in ("o", "scale_ptr", "part"):
            sig[arg] = "*fp64"
        elif arg in ("emb1", "emb2", "wq", "wk", "wv", "cc", "ss", "k_ws", "v_ws"):
            sig[arg] = "*fp32"
        elif arg in ("KVH", "pair0"):
            sig[arg] = "i32"
        elif arg in ("so_l", "so_t", "slab"):
            sig[arg] = "i64"
        else:
            sig[arg] = "*i64"
    # pointers and strides 16-aligned, as the launcher finds them at run time (the loads vectorise)
    aligned = {(names.index(a),): [["tt.divisibility", 16]] for a, t in sig.items()
               if t.startswith("*") or a in ("so_l", "so_t", "slab")}
    src = ASTSource(fn=kern, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=aligned)
    out = build(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = out.asm["ptx"]
    # registers and spills a thread (ptxas), for the record: pytest -s shows them
    with open(os.path.join(tmp, name + ".ptx"), "w") as f:
        f.write(ptx)
    regs, spills = "?", "?"
    for ptxas in ("ptxas-blackwell", "ptxas"):  # (whichever of Triton's takes its PTX version)
        ptxas = os.path.join(tools, ptxas)
        usage = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", os.devnull, f.name], capture_output=True,
                               text=True).stderr if os.path.exists(ptxas) else ""
        found = re.search(r"(\\d+) bytes spill stores.*?Used (\\d+) registers", usage, re.S)
        if found:
            spills, regs = found.groups()
            break
    print(name, out.metadata.shared, "mma.sync.aligned.m8n8k4.row.col.f64" in ptx, "tf32" in ptx, "cp.async" in ptx,
          regs, spills)
shutil.rmtree(tmp)
"""


def test_dense_attention_kernels_compile_for_hopper_at_nemotron_shapes():
    """Without a GPU: Triton's front end and ptxas build the launches (decode tiles, whole or a
    key range each writing partial results, the ranges' merge, long tiles projecting their keys,
    the workspace's projection, long tiles over the workspace) for
    sm_90 at Nemotron-H-8B's attention shapes, within Hopper's shared memory (227 KB a block):
    attention on the float64 tensor cores, projections on TF32 (exact: integers below 2**11; the
    queries' in every attention kernel, the keys' too where they are not in the workspace), the
    workspace loads asynchronous (pipelined). A process of its own: this module runs Triton's
    interpreter."""
    lines = compile_for_hopper(_COMPILE_FOR_HOPPER).strip().splitlines()
    print("\n".join(lines))  # (pytest -s: shared memory, DMMA, TF32, cp.async, registers, spilled bytes)
    got = {name: (int(shared), dmma, tf32, cp_async)
           for name, shared, dmma, tf32, cp_async, _, _ in map(str.split, lines)}
    assert set(got) == {"short", "split", "merge", "long", "project", "workspace"}
    assert all(shared <= 227 * 1024 for shared, *_ in got.values()), got
    assert got["workspace"][1:] == ("True", "True", "True")
    assert got["project"][1:3] == ("False", "True")
    assert got["short"][1:3] == got["split"][1:3] == got["long"][1:3] == ("True", "True")
