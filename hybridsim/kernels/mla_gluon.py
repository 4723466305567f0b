"""MLA decode split kernel for Hopper, written in Gluon (Triton's explicit-layout dialect).

Why a second kernel: the Triton version computes every logit twice. Triton lays out the
logit product of an attention loop with all 8 warps along the rows, so with 64 rows both
warp groups compute the same 64 x 64 logits, and nothing in the Triton language changes
that choice without a barrier that disables its loop pipeliner (bench/RESULTS.md, session 3).
Here the layouts, shared buffers and barriers are explicit:

* one program: 64 (query token, head) rows of one request over one key split, 8 warps;
* the queries are read in their own precision and cast into shared memory (64 x 576) by the
  kernel itself while the first latent tiles are in flight; latent tiles of 64 keys (64 x 576)
  arrive by TMA into a ring of NUM_STAGES buffers, each used as K and as V;
* logits S = Q K^T are split by key columns across the two warp groups (warps [4, 2]):
  each group computes half of them, none twice; the row max is combined across the groups
  every tile, the row sums only once at the end (they are kept per column until then);
* P goes to shared memory (bf16) and both groups read all of it for P V, each for its half
  of the 512 output columns (warps [4, 2] on the accumulator, 128 registers a thread);
* the last partial tile has the rows past the sequence end zeroed in shared memory
  (unused cache rows may hold anything, NaN included), as the Triton kernel does;
* a row tile stops at its last row's last visible key (bottom-right causal mask), as the Triton
  kernel does: a prefill chunk sent through the decode path (``mla.paths``) would otherwise walk
  every key of the chunk for its first tokens' rows;
* the normalised result leaves through shared memory (the latent ring, free by then) as whole
  512-byte rows: the accumulator's own layout makes global accesses 4x as costly per byte;
* with 2 splits the pair merges itself, no combine launch: in a one-wave grid each program
  writes the half of its result that the other merges and merges the other half; otherwise
  the second to finish merges the other's whole partial; more splits use the combine kernel.

Same contract and outputs as ``_mla_split_kernel`` (partials per split, lse in natural log,
0 and -inf for a split with no visible key, bottom-right causal mask). Used only where it
applies: Hopper, 16-bit cache, L = 512 (two 256 halves), R = 64, pages a multiple of 64.
"""

from __future__ import annotations

import functools

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernel is used
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
    HAVE_GLUON = True
except Exception:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False


if HAVE_GLUON:

    # counts that change between steps are not specialised (a new class compiled a variant mid-run);
    # M, nq and the merge flags select code and stay (unspecialised, they cost 1-2%: session 29)
    @gluon.jit(do_not_specialize=["n_qrows", "max_blocks", "keys_per_split", "num_splits"])
    def _mla_gluon_split_kernel(q_lat, q_pe, kv_desc, kr_desc, block_table, seq_lens, o_part, lse_part,
                                o_out, lse_out, counters, n_qrows, M, H, nq, max_blocks, keys_per_split,
                                num_splits, merge_here, halves, qk_scale_log2,
                                L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, HALF: gl.constexpr,
                                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
        gl.static_assert(L == 2 * HALF)
        gl.static_assert(PAGE % BLOCK_N == 0)
        # ---- layouts: 8 warps = two warp groups, split along columns for every product
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, BLOCK_N // 2, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                           instr_shape=[16, HALF // 2, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
        fix_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])
        row_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [8, 1], [1, 0])  # 512 B a warp a row
        row_r: gl.constexpr = gl.SliceLayout(1, row_layout)
        col_r: gl.constexpr = gl.SliceLayout(0, row_layout)
        dt: gl.constexpr = kv_desc.dtype

        mt, sp, b, seq_len, k_start, k_end, n_tiles, table = _program_keys(seq_lens, block_table, max_blocks,
                                                                           keys_per_split, M, H, nq, BLOCK_M,
                                                                           BLOCK_N)
        pair = counters + 4 * (b * gl.num_programs(0) + mt)  # this row tile's counters (two splits)

        # ---- shared memory: queries once, a ring of latent tiles, P, barriers
        q_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], dt)
        qr_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, R], dt)
        q_lo = gl.allocate_shared_memory(dt, [BLOCK_M, HALF], q_lay)
        q_hi = gl.allocate_shared_memory(dt, [BLOCK_M, HALF], q_lay)
        q_r = gl.allocate_shared_memory(dt, [BLOCK_M, R], qr_lay)
        kv_lo = gl.allocate_shared_memory(dt, [NUM_STAGES, BLOCK_N, HALF], kv_desc.layout)
        kv_hi = gl.allocate_shared_memory(dt, [NUM_STAGES, BLOCK_N, HALF], kv_desc.layout)
        k_r = gl.allocate_shared_memory(dt, [NUM_STAGES, BLOCK_N, R], kr_desc.layout)
        p_smem = gl.allocate_shared_memory(dt, [BLOCK_M, BLOCK_N],
                                           gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dt))
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)

        # the first tile, then the queries, then (once the queries have landed) the rest of the
        # prologue: the queries are needed as early as the first tile, and the second tile would
        # only compete with them for bandwidth (measured: 1 us less at B=32 ctx 1k than issuing
        # it before the queries land)
        _load_tile(kv_desc, kr_desc, table, ready.index(0), kv_lo.index(0), kv_hi.index(0), k_r.index(0),
                   k_start, 0 < n_tiles, PAGE, HALF, L)
        # queries: read in their own precision (fp32 from the model), cast to the cache's dtype
        # into shared memory while the first latent tiles are in flight (no separate cast launch)
        qrows = b * M + mt * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_r).to(gl.int64)
        qmask = gl.expand_dims(qrows < n_qrows, 1)
        c_h = gl.arange(0, HALF, layout=col_r)
        c_r = gl.arange(0, R, layout=col_r)
        qa = gl.load(q_lat + gl.expand_dims(qrows, 1) * L + gl.expand_dims(c_h, 0), mask=qmask, other=0.0)
        qb = gl.load(q_lat + gl.expand_dims(qrows, 1) * L + HALF + gl.expand_dims(c_h, 0), mask=qmask, other=0.0)
        qc = gl.load(q_pe + gl.expand_dims(qrows, 1) * R + gl.expand_dims(c_r, 0), mask=qmask, other=0.0)
        on_start = mt * 0  # the pair's word 0 as this program found it when it started (see the merge)
        if merge_here:
            if halves:  # its round trip hides under the loads above
                on_start = gl.atomic_add(pair, 1, sem="relaxed", scope="gpu")
        q_lo.store(qa.to(dt))
        q_hi.store(qb.to(dt))
        q_r.store(qc.to(dt))
        for s in gl.static_range(1, NUM_STAGES):
            _load_tile(kv_desc, kr_desc, table, ready.index(s), kv_lo.index(s), kv_hi.index(s), k_r.index(s),
                       k_start + s * BLOCK_N, s < n_tiles, PAGE, HALF, L)
        fence_async_shared()
        gl.thread_barrier()

        rows_s = mt * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_s)
        qpos = seq_len - nq + rows_s // H
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_cols = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        # keys below this position are visible to every query row of the tile (bottom-right
        # causal mask; rows past M count as the last query token) and inside the sequence
        first_masked = gl.minimum(seq_len - nq + 1, k_end)
        acc_lo = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout)
        acc_hi = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)

        for i in range(n_tiles):
            st = i % NUM_STAGES
            n0 = k_start + i * BLOCK_N
            mbarrier.wait(ready.index(st), (i // NUM_STAGES) & 1)
            klo = kv_lo.index(st)
            khi = kv_hi.index(st)
            kr = k_r.index(st)
            if n0 + BLOCK_N > k_end:  # the partial last tile: zero the rows past the end
                keep = gl.expand_dims(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, fix_layout)) < k_end, 1)
                klo.store(gl.where(keep, klo.load(fix_layout), 0.0).to(dt))
                khi.store(gl.where(keep, khi.load(fix_layout), 0.0).to(dt))
                kr.store(gl.where(keep, kr.load(fix_layout), 0.0).to(dt))
                fence_async_shared()
                gl.thread_barrier()
            # logits: each warp group computes its half of the key columns
            s_acc = warpgroup_mma(q_lo, klo.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s_acc = warpgroup_mma(q_hi, khi.permute((1, 0)), s_acc, is_async=True)
            s_acc = warpgroup_mma(q_r, kr.permute((1, 0)), s_acc, is_async=True)
            s_acc = warpgroup_mma_wait(num_outstanding=0, deps=(s_acc,))
            if n0 + BLOCK_N > first_masked:  # a tile past the end or under the causal mask
                kpos = n0 + gl.arange(0, BLOCK_N, layout=col_s)
                visible = (gl.expand_dims(kpos, 0) <= gl.expand_dims(qpos, 1)) & gl.expand_dims(kpos < k_end, 0)
                s_val = gl.where(visible, s_acc * qk_scale_log2, float("-inf"))
            else:
                s_val = s_acc * qk_scale_log2
            m_new = gl.maximum(m_i, gl.max(s_val, 1))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(s_val - gl.expand_dims(m_safe, 1))
            # row sums stay per column until the end: no cross-warp-group reduction per tile
            l_cols = l_cols * gl.expand_dims(alpha, 1) + p
            m_i = m_new
            p_smem.store(p.to(dt))
            fence_async_shared()
            gl.thread_barrier()  # both halves of P written before either group reads it
            a_o = gl.expand_dims(gl.convert_layout(alpha, row_o), 1)
            acc_lo = warpgroup_mma(p_smem, klo, acc_lo * a_o, is_async=True)
            acc_hi = warpgroup_mma(p_smem, khi, acc_hi * a_o, is_async=True)
            acc_lo, acc_hi = warpgroup_mma_wait(num_outstanding=0, deps=(acc_lo, acc_hi))
            gl.thread_barrier()  # every group is done with this stage and with P
            nxt = i + NUM_STAGES
            _load_tile(kv_desc, kr_desc, table, ready.index(st), kv_lo.index(st), kv_hi.index(st), k_r.index(st),
                       k_start + nxt * BLOCK_N, nxt < n_tiles, PAGE, HALF, L)

        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(s))

        l_i = gl.sum(l_cols, 1)
        empty = l_i == 0.0
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
        # The normalised result goes out through shared memory: the accumulator's own layout
        # (8-byte pieces of 8 rows per warp access) makes global loads and stores 4x as costly
        # per byte as whole 512-byte rows, and the epilogue and merge move 128 KB a program.
        # The latent ring is free now (no copy in flight: every started tile was waited for);
        # each half of the output (64 x 256 fp32) fits in one half of the ring.
        gl.static_assert(NUM_STAGES * BLOCK_N >= 2 * BLOCK_M)
        stage_lay: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0])
        out_lo = kv_lo._reinterpret(gl.float32, [BLOCK_M, HALF], stage_lay)
        out_hi = kv_hi._reinterpret(gl.float32, [BLOCK_M, HALF], stage_lay)
        inv_o = gl.expand_dims(gl.convert_layout(inv, row_o), 1)
        out_lo.store(acc_lo * inv_o)
        out_hi.store(acc_hi * inv_o)
        gl.thread_barrier()
        rows_r = mt * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_r)
        rmask = rows_r < M
        grow = b * M + rows_r.to(gl.int64)  # query row in (B * M)
        cols = gl.expand_dims(gl.arange(0, HALF, layout=col_r), 0)
        own_lse = gl.convert_layout(lse, row_r)
        prow = sp * n_qrows + grow  # this split's partial rows
        orow = (1 - sp) * n_qrows + grow  # the other split's (two splits)
        if merge_here:  # two splits: the pair merges itself
            if halves:
                _merge_pair_halves(pair, on_start, halves, sp, out_lo, out_hi, own_lse, o_part, lse_part, o_out,
                                   lse_out, grow, prow, orow, rmask, cols, L, HALF, row_layout)
            else:
                _merge_pair_whole(pair, out_lo, out_hi, own_lse, o_part, lse_part, o_out, lse_out, grow, prow,
                                  orow, rmask, cols, L, HALF, row_layout)
        else:  # one split (o_part[0] is the result) or many (the combine kernel merges them)
            _store_rows(o_part, lse_part, prow, rmask, cols, out_lo, out_hi, own_lse, L, HALF, row_layout)

    @gluon.jit
    def _program_keys(seq_lens, block_table, max_blocks, keys_per_split, M, H, nq, BLOCK_M: gl.constexpr,
                      BLOCK_N: gl.constexpr):
        """This program's row tile, split and request, the request's length, the keys of its split
        [k_start, k_end), the number of tiles it walks and the request's block-table row.

        No tile past the one holding the last visible key of the row tile's last query (keys beyond
        it are under the causal mask for every row of the tile): a request of many query tokens (the
        decode path over a prefill chunk, ``mla.paths``) would otherwise walk every key for its first
        token's rows too, twice the tiles a chunk that starts its sequence needs. A split left with
        none writes 0 and -inf."""
        mt = gl.program_id(0)
        sp = gl.program_id(1)
        b = gl.program_id(2).to(gl.int64)
        seq_len = gl.load(seq_lens + b).to(gl.int32)
        k_start = sp * keys_per_split
        k_end = gl.minimum(k_start + keys_per_split, seq_len)
        last_q = (gl.minimum(mt * BLOCK_M + BLOCK_M, M) - 1) // H  # the tile's last row's query token
        k_stop = gl.minimum(k_end, seq_len - nq + last_q + 1)  # past that token's last visible key
        n_tiles = gl.cdiv(gl.maximum(k_stop - k_start, 0), BLOCK_N)
        return mt, sp, b, seq_len, k_start, k_end, n_tiles, block_table + b * max_blocks

    @gluon.jit
    def _merge_pair_halves(pair, on_start, halves, sp, out_lo, out_hi, own_lse, o_part, lse_part, o_out, lse_out,
                           grow, prow, orow, rmask, cols, L: gl.constexpr, HALF: gl.constexpr,
                           layout: gl.constexpr):
        """Two splits of a one-wave grid merge half the columns each: each writes the half of its
        result that the other merges, then merges the other's (half the bytes on the critical
        path, both halves written at once). Roles are fixed without a round trip at the end for
        the second program to start: word 0 of ``pair`` counts starts (low 4 bits, ``on_start``
        is its value before this program's) and the first starter's commit (+16, made when it
        finishes). The first starter commits to halves only if the other had started by then, so
        is resident and reaches its own write without waiting: waiting for it is safe. Otherwise
        it writes its whole partial and leaves, and the second merges everything. The second
        knows from ``on_start`` whether the first had committed; if not, the first will see it
        started and commit to halves. Words 1 and 2: split 0's and split 1's "written" (2 a half,
        1 the whole partial). Each word goes back to zero once both are past their last read."""
        mine = pair + 1 + sp
        theirs = pair + 2 - sp
        if on_start % 16 == 0:  # the first to start
            commit = gl.atomic_add(pair, 16, sem="relaxed", scope="gpu")
            if (commit % 16 == 2) & (halves != 2):  # halves == 2: tests force the whole path
                _give_half(mine, o_part, lse_part, prow, rmask, cols, out_lo, out_hi, own_lse, sp, L, HALF, layout)
                _wait_nonzero(theirs)
                gl.store(theirs, 0)
                gl.store(pair, 0)
                _merge_own_half(out_lo, out_hi, own_lse, o_part, lse_part, o_out, lse_out, grow, orow, rmask, cols,
                                sp, L, HALF, layout)
            else:
                _give_whole(mine, o_part, lse_part, prow, rmask, cols, out_lo, out_hi, own_lse, L, HALF, layout)
        else:  # the second to start: the first is resident (or done)
            gave = on_start < 16  # the first had not committed: it will commit to halves
            if gave:
                _give_half(mine, o_part, lse_part, prow, rmask, cols, out_lo, out_hi, own_lse, sp, L, HALF, layout)
            seen = _wait_nonzero(theirs)
            gl.store(theirs, 0)
            gl.store(pair, 0)
            if seen == 2:
                _merge_own_half(out_lo, out_hi, own_lse, o_part, lse_part, o_out, lse_out, grow, orow, rmask, cols,
                                sp, L, HALF, layout)
            else:  # the first wrote its whole partial and left without reading ours
                if gave:
                    gl.store(mine, 0)
                _merge_whole(out_lo, out_hi, own_lse, o_part, lse_part, o_out, lse_out, grow, orow, rmask, cols, L,
                             HALF, layout)

    @gluon.jit
    def _merge_pair_whole(pair, out_lo, out_hi, own_lse, o_part, lse_part, o_out, lse_out, grow, prow, orow, rmask,
                          cols, L: gl.constexpr, HALF: gl.constexpr, layout: gl.constexpr):
        """Several waves: the second program of the pair to finish merges the other's whole
        partial, waiting only for a program that has arrived (so is resident). Word 0 counts
        arrivals, word 1 says the first's partial is written."""
        arrived = gl.atomic_add(pair, 1, sem="relaxed", scope="gpu")
        if arrived == 1:
            _wait_nonzero(pair + 1)
            _merge_whole(out_lo, out_hi, own_lse, o_part, lse_part, o_out, lse_out, grow, orow, rmask, cols, L, HALF,
                         layout)
            gl.store(pair, 0)
            gl.store(pair + 1, 0)
        else:
            _give_whole(pair + 1, o_part, lse_part, prow, rmask, cols, out_lo, out_hi, own_lse, L, HALF, layout)

    @gluon.jit
    def _wait_nonzero(flag):
        """Spin until the other program of the pair releases ``flag``; returns its value."""
        seen = gl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        while seen == 0:
            seen = gl.atomic_add(flag, 0, sem="acquire", scope="gpu")
        gl.thread_barrier()
        return seen

    @gluon.jit
    def _load_tile(kv_desc, kr_desc, table, bar, lo, hi, r, n0, live, PAGE: gl.constexpr, HALF: gl.constexpr,
                   L: gl.constexpr):
        """Start the TMA copies of the latent tile at key n0 (one page slice) into a stage."""
        row = gl.load(table + n0 // PAGE, mask=live, other=0).to(gl.int32) * PAGE + n0 % PAGE
        mbarrier.expect(bar, 2 * kv_desc.block_type.nbytes + kr_desc.block_type.nbytes, pred=live)
        tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, lo, pred=live)
        tma.async_copy_global_to_shared(kv_desc, [row, HALF], bar, hi, pred=live)
        tma.async_copy_global_to_shared(kr_desc, [row, L], bar, r, pred=live)

    @gluon.jit
    def _store_rows(o_ptr, lse_ptr, rows, rmask, cols, o_lo, o_hi, lse, L: gl.constexpr, HALF: gl.constexpr,
                    layout: gl.constexpr):
        """Both halves of a normalised result, staged in shared memory, as whole rows."""
        optr = o_ptr + gl.expand_dims(rows, 1) * L + cols
        m2 = gl.expand_dims(rmask, 1)
        gl.store(optr, o_lo.load(layout), mask=m2)
        gl.store(optr + HALF, o_hi.load(layout), mask=m2)
        gl.store(lse_ptr + rows, lse, mask=rmask)

    @gluon.jit
    def _merge_weights(own_lse, lse_part, lse_out, grow, orow, rmask, write_lse):
        """Weights of this split's and the other's normalised results, exp(lse_s - max); a split
        with lse -inf weighs 0; a row empty in both gives 0 and -inf (written if write_lse)."""
        other_lse = gl.load(lse_part + orow, mask=rmask, other=float("-inf"), cache_modifier=".cg")
        mx = gl.maximum(own_lse, other_lse)
        m_safe = gl.where(mx == float("-inf"), 0.0, mx)
        w = gl.exp(own_lse - m_safe)
        w2 = gl.exp(other_lse - m_safe)
        wsum = w + w2
        empty = wsum == 0.0
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, wsum))
        gl.store(lse_out + grow, gl.where(empty, float("-inf"), m_safe + gl.log(gl.where(empty, 1.0, wsum))),
                 mask=rmask & write_lse)
        return w * inv, w2 * inv

    @gluon.jit
    def _merge_cols(own, off, a, a2, o_part, o_out, orow, grow, rmask, cols, L: gl.constexpr, layout: gl.constexpr):
        """Columns [off, off + HALF): own (staged in shared memory) * a + the other's partial * a2."""
        m2 = gl.expand_dims(rmask, 1)
        other = gl.load(o_part + gl.expand_dims(orow, 1) * L + off + cols, mask=m2, other=0.0, cache_modifier=".cg")
        gl.store(o_out + gl.expand_dims(grow, 1) * L + off + cols,
                 own.load(layout) * gl.expand_dims(a, 1) + gl.expand_dims(a2, 1) * other, mask=m2)

    @gluon.jit
    def _give_half(flag, o_part, lse_part, prow, rmask, cols, own_lo, own_hi, own_lse, sp, L: gl.constexpr,
                   HALF: gl.constexpr, layout: gl.constexpr):
        """Write the half of this split's result that the other split merges (split s merges half s)
        and its lse, then release ``flag`` = 2."""
        m2 = gl.expand_dims(rmask, 1)
        optr = o_part + gl.expand_dims(prow, 1) * L + cols
        if sp == 0:
            gl.store(optr + HALF, own_hi.load(layout), mask=m2)
        else:
            gl.store(optr, own_lo.load(layout), mask=m2)
        gl.store(lse_part + prow, own_lse, mask=rmask)
        gl.thread_barrier()
        gl.atomic_add(flag, 2, sem="release", scope="gpu")

    @gluon.jit
    def _give_whole(flag, o_part, lse_part, prow, rmask, cols, own_lo, own_hi, own_lse, L: gl.constexpr,
                    HALF: gl.constexpr, layout: gl.constexpr):
        """Write this split's whole partial and lse for the other to merge, then release ``flag`` = 1."""
        _store_rows(o_part, lse_part, prow, rmask, cols, own_lo, own_hi, own_lse, L, HALF, layout)
        gl.thread_barrier()
        gl.atomic_add(flag, 1, sem="release", scope="gpu")

    @gluon.jit
    def _merge_whole(own_lo, own_hi, own_lse, o_part, lse_part, o_out, lse_out, grow, orow, rmask, cols,
                     L: gl.constexpr, HALF: gl.constexpr, layout: gl.constexpr):
        """All columns: this split's result with the other's whole partial; writes the lse."""
        a, a2 = _merge_weights(own_lse, lse_part, lse_out, grow, orow, rmask, True)
        _merge_cols(own_lo, 0, a, a2, o_part, o_out, orow, grow, rmask, cols, L, layout)
        _merge_cols(own_hi, HALF, a, a2, o_part, o_out, orow, grow, rmask, cols, L, layout)

    @gluon.jit
    def _merge_own_half(own_lo, own_hi, own_lse, o_part, lse_part, o_out, lse_out, grow, orow, rmask, cols, sp,
                        L: gl.constexpr, HALF: gl.constexpr, layout: gl.constexpr):
        a, a2 = _merge_weights(own_lse, lse_part, lse_out, grow, orow, rmask, sp == 0)  # one writes the lse
        if sp == 0:
            _merge_cols(own_lo, 0, a, a2, o_part, o_out, orow, grow, rmask, cols, L, layout)
        else:
            _merge_cols(own_hi, HALF, a, a2, o_part, o_out, orow, grow, rmask, cols, L, layout)


@functools.lru_cache(maxsize=None)
def _is_hopper(device) -> bool:
    import torch

    return torch.cuda.get_device_capability(device)[0] == 9


def gluon_applies(cache, L: int, R: int, block_n: int) -> bool:
    """Where the Gluon kernel is used: Hopper, 16-bit cache laid out for TMA, DeepSeek-style dims."""
    if not HAVE_GLUON or not cache.is_cuda or not _is_hopper(cache.device):
        return False
    import torch

    page = cache.shape[1]
    return (cache.dtype in (torch.bfloat16, torch.float16) and L == 512 and R == 64 and page % block_n == 0
            and cache.is_contiguous() and cache.data_ptr() % 16 == 0)


_COUNTERS: dict = {}
# Two splits merge half the columns each when the grid is one wave and both are resident (False:
# the second to finish always merges everything). Not with several waves: a program waiting for
# its partner would hold a multiprocessor that a waiting program could use. Tests force each way,
# and "first-whole" (the first to start always writes its whole partial).
MERGE_HALVES = True


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def _counters(dev, n: int):
    """Four words per row tile for the two-split merge (see ``_merge_pair_halves`` and
    ``_merge_pair_whole``), zero between launches (the programs reset them before they exit).
    One buffer per device: launches on one stream (as the executor makes them) never overlap."""
    import torch

    buf = _COUNTERS.get(dev)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[dev] = torch.zeros(max(n, 1024), dtype=torch.int32, device=dev)
    return buf


def latent_descriptors(cache, L: int, R: int, block_n: int):
    """Tensor descriptors of a paged latent cache (pages, page, L + R) for the copy engine: tiles of
    block_n rows of one half of the latent columns, and of the rope columns."""
    dt = gl.bfloat16 if str(cache.dtype) == "torch.bfloat16" else gl.float16
    flat = cache.view(-1, L + R)
    shared = gl.NVMMASharedLayout.get_default_for
    half = L // 2
    return (GluonDescriptor.from_tensor(flat, [block_n, half], shared([block_n, half], dt)),
            GluonDescriptor.from_tensor(flat, [block_n, R], shared([block_n, R], dt)))


def launch_gluon_split(q_lat, q_pe, cache, block_table, seq_lens, o_part, lse_part, o_out, lse_out, M, H, nq,
                       per, qk_scale_log2, num_splits, block_m=64, block_n=64, num_stages=2) -> None:
    """Launch the split kernel. q_lat (B, M, L) and q_pe (B, M, R), contiguous, any float dtype
    (cast inside). With one split o_part[0] / lse_part[0] is the result; with two, the second
    program of each row tile to finish merges both into o_out (B, M, L) / lse_out (B, M); with
    more, the caller merges o_part / lse_part (the combine kernel)."""
    B = q_lat.shape[0]
    L, R = q_lat.shape[-1], q_pe.shape[-1]
    half = L // 2
    page = cache.shape[1]
    kv_desc, kr_desc = latent_descriptors(cache, L, R, block_n)
    mtiles = (M + block_m - 1) // block_m
    counters = _counters(cache.device, 4 * B * mtiles)
    halves = 0
    if MERGE_HALVES and mtiles * num_splits * B <= _sm_count(cache.device):
        halves = 2 if MERGE_HALVES == "first-whole" else 1
    _mla_gluon_split_kernel[(mtiles, num_splits, B)](
        q_lat, q_pe, kv_desc, kr_desc, block_table, seq_lens, o_part, lse_part, o_out, lse_out, counters,
        B * M, M, H, nq, block_table.shape[1], per, num_splits, int(num_splits == 2), halves,
        qk_scale_log2,
        L=L, R=R, PAGE=page, HALF=half, BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=num_stages, num_warps=8)
