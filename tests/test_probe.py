"""The probe layers' arithmetic: the batched scans equal the token-by-token definition bit for
bit, comparisons count exactly the elements that differ, and the exact quantities (Mamba
states, MLA latent entries, RoPE tables) are pinned to values no platform can change.

The Triton scan runs under the interpreter here (small sizes); ``-m gpu`` runs it compiled
at real sizes.
"""

from __future__ import annotations

import copy
import hashlib
import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridsim.kernels.probe_scan import NAN_DIFF, NO_MISMATCH, ScanBuilder, scan_reference  # noqa: E402
from hybridsim.kernels.probe_scan_triton import scan_triton  # noqa: E402
from hybridsim.layers.exact import (FAST_MOD_MIN, MAX_STATE_DIM, Q, fingerprint_rows, mod_q, rope_phases,  # noqa: E402
                                    trig_table)
from hybridsim.layers.mamba import MambaProbe, stack_tables  # noqa: E402
from hybridsim.layers.mla import MLAProbe, MLAStack, dense_reference  # noqa: E402
from hybridsim.model import MambaGeometry, MLAGeometry  # noqa: E402
from hybridsim.presets import build_preset  # noqa: E402

from .helpers import compile_for_hopper  # noqa: E402

GEOMETRIES = {
    "mamba2": MambaGeometry(layers=3, heads=4, head_dim=8, d_state=16, n_groups=2, conv_kernel=4),
    "mamba1": MambaGeometry(kind="mamba1", layers=2, heads=2, head_dim=8, d_state=4, conv_kernel=4),
    "gdn": MambaGeometry(kind="gdn", layers=2, heads=4, head_dim=8, d_state=8, n_groups=2, conv_kernel=4),
    "mamba2-k3": MambaGeometry(layers=2, heads=2, head_dim=8, d_state=8, n_groups=1, conv_kernel=3),
    "mamba2-k2": MambaGeometry(layers=2, heads=2, head_dim=8, d_state=8, n_groups=1, conv_kernel=2),
}


def _definition(probe: MambaProbe, window, h, tokens):
    """Token by token: outputs and the state after every token."""
    ys, states = [], []
    w, hh = window[None], h[None]
    for t in tokens:
        y, w, hh = probe.token_step(w, hh, torch.tensor([t]))
        ys.append(y[0])
        states.append((w[0].clone(), hh[0].clone()))
    return torch.stack(ys), states


def _case(geo: MambaGeometry, seed: int, lens: list[int], spec_rows=(), pages: int = 64):
    """Rows with random tokens, half from random cached states; events at random tokens."""
    rnd = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    probes = [MambaProbe(geo, layer, seed) for layer in range(geo.layers)]
    tab = stack_tables(probes, "cpu")
    L, K = geo.layers, geo.conv_kernel
    R = K - 1 + 3
    conv = torch.full((L, pages, R, tab.dim), float("nan"))
    temporal = torch.full((L, pages, tab.H, tab.P, tab.N), float("nan"))
    slot = torch.arange(L)
    free = iter(rnd.sample(range(1, pages), pages - 1))  # shuffled pages
    b = ScanBuilder(L)
    window = torch.zeros(len(lens), L, K - 1, tab.dim)
    expect = []
    for row, n in enumerate(lens):
        toks = [rnd.randrange(0, 200_000) for _ in range(n)]
        if row % 2:
            w0 = torch.randint(0, Q, (L, K - 1, tab.dim), generator=gen)
            h0 = torch.randint(0, Q, (L, tab.H, tab.P, tab.N), generator=gen)
            pg = next(free)
            temporal[:, pg] = h0.float()
            window[row] = w0.float()
            init = [pg] * L
        else:
            w0 = torch.zeros(L, K - 1, tab.dim, dtype=torch.int64)
            h0 = torch.zeros(L, tab.H, tab.P, tab.N, dtype=torch.int64)
            init = [-1] * L
        hist = [next(free)] * L if row in spec_rows else None
        i = b.add_row(toks, init, hist)
        expect.append((toks, [_definition(probes[layer], w0[layer], h0[layer], toks) for layer in range(L)], w0))
        for t in sorted({n - 1, rnd.randrange(n)}):
            pg = next(free)
            b.write(i, t, [pg] * L, [pg] * L)
    y = torch.full((sum(lens), L, tab.H * tab.P), -1, dtype=torch.int32)
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    ln, _ = b.build(window, conv, temporal, slot, "cpu", y_out=y, y_start=starts)
    return probes, tab, b, ln, expect


def _clone(ln):
    twin = copy.copy(ln)
    for k, v in ln.__dict__.items():
        if isinstance(v, torch.Tensor):
            setattr(twin, k, v.clone())
    return twin


@pytest.mark.parametrize("kind", sorted(GEOMETRIES))
@pytest.mark.parametrize("chunk", [5, 64])
def test_reference_scan_equals_the_definition(kind, chunk):
    geo = GEOMETRIES[kind]
    probes, tab, b, ln, expect = _case(geo, 11, [1, 4, 23, 70, 3], spec_rows=(1, 4))
    scan_reference(tab, ln, chunk=chunk)
    K = geo.conv_kernel
    for row, (toks, per_layer, w0) in enumerate(expect):
        ys = int(ln.y_start[row])
        for layer, (y_def, states) in enumerate(per_layer):
            assert torch.equal(ln.y_out[ys:ys + len(toks), layer].long(), y_def), (row, layer)
        if ln.hist_cpage is not None and int(ln.hist_cpage[row, 0]) >= 0:  # draft rows' conv history
            pg = int(ln.hist_cpage[row, 0])
            for layer, (_, states) in enumerate(per_layer):
                hist = ln.state_conv[layer, pg, : K - 2 + len(toks)].long()
                inputs = torch.cat([w0[layer][1:], torch.stack([s[0][-1] for s in states])])
                assert torch.equal(hist, inputs)
    for row, t, tpages, cpages in b.events:
        for layer, (_, states) in enumerate(expect[row][1]):
            w, h = states[t]
            assert torch.equal(ln.state_temporal[layer, tpages[layer]].long(), h)
            assert torch.equal(ln.state_conv[layer, cpages[layer], : K - 1].long(), w)


def _assert_triton_equals_reference(tab, ln, **route) -> None:
    """The launch through the Triton scan and the torch form: pages and outputs equal bit for bit."""
    tri = _clone(ln)
    scan_reference(tab, ln)
    scan_triton(tab, tri, **route)
    same = lambda a, b: torch.equal(torch.nan_to_num(a, -1.0), torch.nan_to_num(b, -1.0))  # noqa: E731
    assert same(ln.state_conv, tri.state_conv) and same(ln.state_temporal, tri.state_temporal)
    assert torch.equal(ln.y_out, tri.y_out)


INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")


@INTERPRETER
@pytest.mark.parametrize("kind", sorted(GEOMETRIES))
def test_triton_scan_equals_reference_bit_for_bit(kind):
    geo = GEOMETRIES[kind]
    _, tab, _, ln, _ = _case(geo, 5, [1, 4, 9], spec_rows=(1,))
    _assert_triton_equals_reference(tab, ln)


def _compare_events(b: ScanBuilder, ln, expect, L: int) -> ScanBuilder:
    """The oracle's launch over the same rows: compare the state after every event of ``b`` with
    the page it wrote, and every output but each row's first; tags are (row, token)."""
    cb = ScanBuilder(L)
    for row, (toks, _, _) in enumerate(expect):
        cb.add_row(toks, ln.init_tpage[row].tolist(), y_from=1, y_count=len(toks) - 1)
    for row, t, tpages, cpages in b.events:
        cb.compare(row, t, tpages, cpages, 0, (row, t))
    return cb


@pytest.mark.parametrize("provider", ["reference", pytest.param("triton", marks=INTERPRETER)])
def test_comparisons_count_exactly_the_differing_elements(provider):
    """The oracle's mode: compare states after given tokens with pages; one changed element,
    one NaN element and one changed output are reported where they are, nothing else."""
    geo = GEOMETRIES["mamba2"]
    _, tab, b, ln, expect = _case(geo, 3, [3, 6], pages=32)
    scan_reference(tab, ln)  # the pages now hold the true states after the events' tokens
    L, K = geo.layers, geo.conv_kernel
    cb = _compare_events(b, ln, expect, L)
    conv, temporal, y_ref = ln.state_conv.clone(), ln.state_temporal.clone(), ln.y_out.clone()
    e_row, e_t, e_tp, e_cp = b.events[0]
    temporal[1, e_tp[1], 0, 1, 2] += 5  # layer 1: one temporal element off by 5
    conv[2, e_cp[2], 1, 3] = float("nan")  # layer 2: one conv element never written
    y_ref[int(ln.y_start[1]) + 2, 0, 4] += 1  # row 1, token 2 (the second compared), layer 0
    oracle_conv, oracle_t = ln.state_conv.clone(), ln.state_temporal.clone()
    launch, tags = cb.build(ln.init_window, oracle_conv, oracle_t, torch.arange(L), "cpu",
                            y_start=ln.y_start + 1, cmp=(conv, temporal, torch.arange(L)), y_ref=y_ref)
    (scan_reference if provider == "reference" else scan_triton)(tab, launch)
    st = launch.stats
    first = tags.index((e_row, e_t))
    P_N = tab.P * tab.N
    assert st[first, 1].tolist() == [1, 5, (K - 1) * tab.dim + 0 * P_N + 1 * tab.N + 2]
    assert st[first, 2].tolist() == [1, NAN_DIFF, 1 * tab.dim + 3]
    assert st[len(tags) + 1, 0].tolist() == [1, 1, 1]
    others = torch.ones_like(st[..., 0], dtype=torch.bool)
    others[first, 1] = others[first, 2] = others[len(tags) + 1, 0] = False
    assert (st[..., 0][others] == 0).all() and (st[..., 2][others] == NO_MISMATCH).all()
    # only one temporal element off: the conv windows and the outputs all agree
    temporal = ln.state_temporal.clone()
    temporal[0, e_tp[0], 1, 0, 3] += 7
    launch, tags = cb.build(ln.init_window, ln.state_conv.clone(), ln.state_temporal.clone(), torch.arange(L), "cpu",
                            y_start=ln.y_start + 1, cmp=(ln.state_conv.clone(), temporal, torch.arange(L)),
                            y_ref=ln.y_out.clone())
    (scan_reference if provider == "reference" else scan_triton)(tab, launch)
    st = launch.stats
    assert st[tags.index((e_row, e_t)), 0].tolist() == [1, 7, (K - 1) * tab.dim + 1 * P_N + 3]
    assert int(st[..., 0].sum()) == 1


CHUNKED = MambaGeometry(layers=2, heads=4, head_dim=16, d_state=32, n_groups=2, conv_kernel=4)


@INTERPRETER
@pytest.mark.parametrize("K", [4, 2])
def test_chunked_triton_scan_equals_reference_bit_for_bit(K):
    """Long rows go to the chunked tensor-core kernel (short ones and draft rows stay token by
    token): outputs, state writes at the end and in the middle of chunks, and conv windows
    straddling the starting window all equal the torch form."""
    from hybridsim.kernels.probe_scan_triton import _routes
    _, tab, _, ln, _ = _case(CHUNKED.model_copy(update={"conv_kernel": K}), 5, [3, 34, 70], spec_rows=(0,))
    assert _routes(tab, ln) == ([0], [1, 2])
    _assert_triton_equals_reference(tab, ln)


@INTERPRETER
@pytest.mark.parametrize("chunk_min", [32, 1], ids=["token-by-token-and-chunked", "all-chunked"])
def test_int16_state_pages_hold_what_float32_pages_hold(chunk_min):
    """The Mamba oracle keeps its own states as int16 residues (``oracle.STATE_DTYPE``): a launch over int16
    temporal pages (rows starting from them, states written into them) gives the float32 launch's
    outputs and states, in the torch form and in both Triton kernels (a state written mid-chunk too)."""
    from hybridsim.oracle import STATE_DTYPE
    _, tab, _, ln, _ = _case(CHUNKED, 9, [1, 3, 34, 40])
    small = _clone(ln)
    small.state_temporal = torch.nan_to_num(ln.state_temporal, 0.0).to(STATE_DTYPE)  # (NaN reads as 0 either way)
    tri = _clone(small)
    scan_reference(tab, ln)
    scan_reference(tab, small)
    scan_triton(tab, tri, chunk_min=chunk_min)
    for got in (small, tri):
        assert got.state_temporal.dtype == STATE_DTYPE and torch.equal(got.y_out, ln.y_out)
        assert torch.equal(got.state_temporal.long(), torch.nan_to_num(ln.state_temporal, 0.0).long())


@INTERPRETER
def test_chunked_scan_takes_short_rows_exactly():
    """Rows of 1, 2 and 5 tokens as one (partial) chunk each, as the oracle's decode rows may run:
    a state written after every token (a chunk cut at each) and after the last only, bit for bit the
    torch form's; the draft row stays token by token."""
    from hybridsim.kernels.probe_scan_triton import _routes
    _, tab, _, ln, _ = _case(CHUNKED, 7, [1, 2, 5, 3], spec_rows=(3,))
    assert _routes(tab, ln, chunk_min=1) == ([3], [0, 1, 2])
    _assert_triton_equals_reference(tab, ln, chunk_min=1)


@INTERPRETER
def test_chunked_comparisons_count_what_the_reference_counts():
    """The oracle's mode in the chunked kernel: one changed temporal element, one NaN conv
    element, one changed output in a long row are counted exactly as the torch form counts them."""
    from hybridsim.kernels.probe_scan_triton import _routes
    _, tab, b, ln, expect = _case(CHUNKED, 3, [40, 66], pages=32)
    scan_reference(tab, ln)
    L = CHUNKED.layers
    cb = _compare_events(b, ln, expect, L)
    conv, temporal, y_ref = ln.state_conv.clone(), ln.state_temporal.clone(), ln.y_out.clone()
    e_row, e_t, e_tp, e_cp = b.events[0]
    temporal[1, e_tp[1], 0, 1, 2] += 5
    conv[0, e_cp[0], 1, 3] = float("nan")
    y_ref[int(ln.y_start[1]) + 30, 1, 4] += 3
    stats = []
    for scan in (scan_reference, scan_triton):
        launch, tags = cb.build(ln.init_window, ln.state_conv.clone(), ln.state_temporal.clone(), torch.arange(L),
                                "cpu", y_start=ln.y_start + 1, cmp=(conv, temporal, torch.arange(L)), y_ref=y_ref)
        assert _routes(tab, launch) == ([], [0, 1])
        scan(tab, launch)
        stats.append(launch.stats)
    assert torch.equal(stats[0], stats[1])
    assert int(stats[1][..., 0].sum()) == 3


@INTERPRETER
def test_chunked_output_mismatches_fold_over_chunks():
    """The chunked kernel keeps its output mismatches element by element across a row's chunks
    and folds them once: several mismatches at the same place in different chunks, and in two
    rows, count, take the largest difference and the first token exactly as the torch form."""
    _, tab, b, ln, expect = _case(CHUNKED, 3, [40, 66], pages=32)
    scan_reference(tab, ln)
    L = CHUNKED.layers
    cb = _compare_events(b, ln, expect, L)
    y_ref = ln.y_out.clone()
    r1 = int(ln.y_start[1])
    for t, layer, ch, d in ((2, 1, 4, 3), (34, 1, 4, 9), (35, 1, 5, 2), (65, 0, 7, 1)):
        y_ref[r1 + t, layer, ch] += d
    y_ref[int(ln.y_start[0]) + 39, 1, 0] += 4
    stats = []
    for scan in (scan_reference, scan_triton):
        launch, _ = cb.build(ln.init_window, ln.state_conv.clone(), ln.state_temporal.clone(), torch.arange(L),
                             "cpu", y_start=ln.y_start + 1, cmp=(ln.state_conv.clone(), ln.state_temporal.clone(),
                                                                 torch.arange(L)), y_ref=y_ref)
        scan(tab, launch)
        stats.append(launch.stats)
    assert torch.equal(stats[0], stats[1])
    assert int(stats[1][..., 0].sum()) == 5
    assert int(stats[1][..., 1].max()) == 9


def test_every_state_element_depends_on_the_first_token():
    """Change only the first token of 40: (nearly) every element of the final state moves."""
    probe = MambaProbe(build_preset("tiny-hybrid").mamba, 0, seed=1)
    toks = [random.Random(2).randrange(1000) for _ in range(40)]
    _, w1, h1 = probe.run(toks)
    _, w2, h2 = probe.run([toks[0] + 1] + toks[1:])
    assert (h1 != h2).float().mean() > 0.99
    assert torch.equal(w1, w2)  # the conv window holds only the last K-1 inputs


def test_exact_arithmetic_stays_in_int32():
    """Bounds the Triton scan relies on: h update, conv and the d_state sum of products."""
    assert 2 * (Q - 1) ** 2 < 2 ** 31
    assert MAX_STATE_DIM * (Q - 1) ** 2 + (Q - 1) ** 2 < 2 ** 31
    assert 4 * (Q - 1) ** 2 + Q < 2 ** 31


def test_fast_modulo_is_the_integer_modulo():
    """``mod_q`` (a quotient from a multiplication) against int64 modulo, at the values where a
    rounded quotient would slip: multiples of Q and their neighbours, up to 2**51, and negatives."""
    gen = torch.Generator().manual_seed(3)
    k = torch.cat([torch.randint(0, 1 << 40, (4096,), generator=gen), torch.arange(4096),
                   torch.tensor([(1 << 51) // Q - 1, (1 << 51) // Q - 2])])
    x = torch.cat([k * Q + r for r in (0, 1, Q - 1, -1)]
                  + [torch.randint(-(1 << 51) + 1, 1 << 51, (8192,), generator=gen)])
    x = x[x.abs() < (1 << 51)]
    assert x.numel() >= FAST_MOD_MIN
    got = mod_q(x.double())
    assert torch.equal(got.long(), x % Q) and bool((got >= 0).all() and (got < Q).all())
    small = x[:7].double()  # (below the size where the fast form is used)
    assert torch.equal(mod_q(small).long(), x[:7] % Q)


def test_rope_and_trig_tables_are_pinned():
    """The tables come from decimal arithmetic; these digests are what every machine computes."""
    cos_t, sin_t = trig_table()
    digest = hashlib.sha256(cos_t.numpy().tobytes() + sin_t.numpy().tobytes()).hexdigest()
    assert digest[:16] == TRIG_DIGEST
    assert rope_phases(64)[:4].tolist() == ROPE64_HEAD
    assert int(cos_t.abs().max()) == 1024 and int(cos_t[0]) == 1024 and int(sin_t[1024]) == 1024


TRIG_DIGEST = "9c787d66d3278a05"
ROPE64_HEAD = [683565276, 512601642, 384397003, 288257087]  # 2**32 / (2 pi) * 10000**(-2i/64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mla_latent_is_exact_and_batch_invariant(dtype):
    geo = MLAGeometry(layers=1, heads=4, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=16,
                      v_head_dim=16, dtype=dtype)
    probe = MLAProbe(geo, 0, seed=4)
    tok = torch.randint(0, 100_000, (37,))
    pos = torch.arange(1000, 1037)
    lat64 = probe.latent64(tok, pos)
    lat32 = probe.latent(tok, pos)
    assert torch.equal(lat32.double(), lat64)  # exactly representable in float32
    for i in (0, 5, 36):  # one token alone: the same bits
        assert torch.equal(probe.latent(tok[i:i + 1], pos[i:i + 1])[0], lat32[i])
    perm = torch.randperm(37)
    assert torch.equal(probe.latent(tok[perm], pos[perm]), lat32[perm])
    far = torch.randint(0, 1 << 17, (37,))  # the executor's float32 projection: the same values
    lat, q_nope, q_pe = probe.project(tok, far)
    want_q = probe.queries64(tok, far)
    assert lat.dtype == torch.float32 and torch.equal(lat.double(), probe.latent64(tok, far))
    assert torch.equal(q_nope.double(), want_q[0]) and torch.equal(q_pe.double(), want_q[1])


def test_mla_oracle_equals_the_unabsorbed_definition():
    geo = MLAGeometry(layers=2, heads=4, kv_lora_rank=64, qk_rope_head_dim=8, qk_nope_head_dim=16,
                      v_head_dim=16)
    probes = [MLAProbe(geo, layer, seed=9) for layer in range(2)]
    stack = MLAStack(probes, "cpu")
    rows = [torch.randint(0, 50_000, (n,)) for n in (5, 40, 17)]
    qs = [(0, 5), (35, 5), (10, 7)]
    n = max(len(r) for r in rows)
    tok = torch.zeros(3, n, dtype=torch.int64)
    qpos = torch.zeros(3, 7, dtype=torch.int64)
    for i, (r, (c, k)) in enumerate(zip(rows, qs)):
        tok[i, : len(r)] = r
        qpos[i] = torch.clamp(c + torch.arange(7), max=c + k - 1)
    assert stack.expands(1, 512, 512) and not stack.expands(1, 3, 512)  # long prefill pieces, decode rows
    for expand in (False, True):  # both associations
        out = stack.attend(tok, qpos, expand=expand)
        for i, (r, (c, k)) in enumerate(zip(rows, qs)):
            for layer, p in enumerate(probes):
                want = dense_reference(p, r, torch.arange(c, c + k))
                assert torch.allclose(out[layer, i, :k], want, rtol=1e-10, atol=1e-12)
    pos = torch.arange(n).expand(3, n)
    assert torch.equal(stack.latents(tok, n)[1], torch.stack([probes[1].latent64(t, pos[0]) for t in tok]))


def test_fingerprints_are_exact_and_order_free():
    t = torch.randint(0, Q, (3, 50)).float()
    t[1, 7] = float("nan")
    fp = fingerprint_rows(t)
    assert torch.equal(fingerprint_rows(t.clone()), fp)
    u = t.clone()
    u[2, 49] += 1
    assert fingerprint_rows(u)[2] != fp[2] and torch.equal(fingerprint_rows(u)[:2], fp[:2])


@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["nemotron-h-8b", "jamba-1.5-mini", "qwen3-next-80b"])
def test_triton_scan_at_real_sizes_on_the_gpu(preset):
    """Compiled, at a real model's head and state sizes (two layers, a few rows): the Triton scan
    equals the torch form on the GPU bit for bit, writes, outputs and comparisons alike."""
    geo = build_preset(preset).mamba.model_copy(update={"layers": 2})
    probes = [MambaProbe(geo, layer, 7) for layer in range(2)]
    tab = stack_tables(probes, "cuda")
    L, K, dim = 2, geo.conv_kernel, tab.dim
    pages = 12
    conv = torch.full((L, pages, K - 1 + 3, dim), float("nan"), device="cuda")
    temporal = torch.full((L, pages, tab.H, tab.P, tab.N), float("nan"), device="cuda")
    temporal[:, 1] = torch.randint(0, Q, temporal[:, 1].shape, device="cuda").float()
    b = ScanBuilder(L)
    lens = [4, 37, 130]
    for row, n in enumerate(lens):
        b.add_row(torch.randint(0, 10 ** 6, (n,)).tolist(), [1] * L if row else [-1] * L,
                  hist=[2] * L if row == 0 else None, y_from=0, y_count=n)
        b.write(row, n - 1, [3 + row] * L, [3 + row] * L)
        b.write(row, n // 2, [6 + row] * L, [6 + row] * L)
        b.compare(row, n - 1, [1] * L, [1] * L, 0, row)
    window = torch.randint(0, Q, (3, L, K - 1, dim), device="cuda").float()
    y = torch.full((sum(lens), L, tab.H * tab.P), -1, dtype=torch.int32, device="cuda")
    starts = torch.tensor([0, 4, 41], device="cuda")
    ln, _ = b.build(window, conv, temporal, torch.arange(L, device="cuda"), "cuda", y_out=y, y_start=starts,
                    cmp=(conv.clone(), temporal.clone(), torch.arange(L, device="cuda")), y_ref=y.clone() + 1)
    tri = _clone(ln)
    scan_reference(tab, ln)
    scan_triton(tab, tri)
    same = lambda a, b: torch.equal(torch.nan_to_num(a, -1.0), torch.nan_to_num(b, -1.0))  # noqa: E731
    assert same(ln.state_conv, tri.state_conv) and same(ln.state_temporal, tri.state_temporal)
    assert torch.equal(ln.y_out, tri.y_out) and torch.equal(ln.stats, tri.stats)
    assert int(ln.stats[..., 0].sum()) > 0  # the comparisons found the (deliberate) differences


@pytest.mark.gpu
def test_triton_scan_with_a_single_layer_compiles_and_matches():
    """L == 1 (the recorded engine's one Mamba layer): Triton must not specialise it away."""
    geo = GEOMETRIES["mamba2"].model_copy(update={"layers": 1})
    _, tab, _, ln, _ = _case(geo, 9, [3, 5])
    ln = _clone(ln)
    for name, v in list(ln.__dict__.items()):
        if isinstance(v, torch.Tensor):
            setattr(ln, name, v.cuda())
    tab = stack_tables([MambaProbe(geo, 0, 9)], "cuda")
    ref = _clone(ln)
    scan_reference(tab, ref)
    scan_triton(tab, ln)
    assert torch.equal(ln.y_out, ref.y_out)


_COMPILE_FOR_HOPPER = """
import sys
from triton import compile as build
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridsim.kernels.probe_scan_chunked import _chunked_scan_kernel as kern, chunked_fits
from hybridsim.kernels.probe_scan_triton import CHUNK_TOKENS, CHUNK_WARPS
from hybridsim.layers.exact import Q
from hybridsim.layers.mamba import MambaProbe
from hybridsim.presets import build_preset

p = MambaProbe(build_preset(sys.argv[1]).mamba.model_copy(update={"layers": 1}), 0, 1)
assert chunked_fits(p.H, p.P, p.G, p.N, p.geo.conv_kernel, p.bc_from_conv)
const = dict(H=p.H, P=p.P, G=p.G, N=p.N, KM1=p.geo.conv_kernel - 1, DIM=p.H * p.P + 2 * p.G * p.N,
             BT=CHUNK_TOKENS, WRITE_Y=False, COMPARE=True, QQ=Q)
kinds = {"*fp32": {"init_window", "conv", "cmp_conv", "cmp_temporal"}, "*i16": {"temporal"},  # (the oracle's states)
         "*i32": {"parts", "y_out", "y_ref", "emb", "conv_w", "conv_b", "head", "Dt", "powt"}, "*i8": {"bcbuf"}}
names = kern.arg_names
sig = {}
for name in names:
    if name in const:
        sig[name] = "constexpr"
    elif name in ("L", "n_cmp") or name.startswith(("c_s", "t_s", "cc_s", "ct_s")):
        sig[name] = "i64"
    else:
        sig[name] = next((k for k, v in kinds.items() if name in v), "*i64")
src = ASTSource(fn=kern, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
out = build(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": CHUNK_WARPS})
print("wgmma" in out.asm["ptx"])
"""


@pytest.mark.parametrize("preset", ["nemotron-h-8b"])  # (qwen3-next-80b's shapes compile too: 16 s more)
def test_chunked_scan_compiles_for_hopper_at_real_shapes(preset):
    """Without a GPU: Triton's front end and ptxas build the chunked kernel for sm_90 at a real
    model's shapes in the oracle's mode (its own states int16), its products on Hopper's tensor cores (an int8 product
    of inner size 16 once failed only on the device; this catches that class of error anywhere).
    A process of its own: this module runs Triton's interpreter."""
    assert compile_for_hopper(_COMPILE_FOR_HOPPER, preset).strip() == "True"
