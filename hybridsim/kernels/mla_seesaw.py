"""MLA decode for Hopper with two warp groups taking turns ("seesaw"), in Gluon.

Why a second Gluon kernel: the split kernel (``mla_gluon.py``) runs every step of a tile in
lockstep across its 8 warps: the logits, then the softmax, then P V, with the matrix units idle
while the softmax runs, and its logits are only 32 keys wide a warp group (each group reads all
of Q from shared memory for half of the keys). Here the two warp groups are separate partitions
(``gl.warp_specialize``) and take two key tiles at a time, the schedule FlashMLA's deep-dive
(2025) describes:

* group 0 owns output columns 0..255 (O_L), group 1 columns 256..511 (O_R): a 64 x 512 fp32
  accumulator does not fit one group's registers, and each keeps its half across tiles;
* of a pair of tiles (a in ring stage 0, b in stage 1), group 0 computes the logits of a and
  group 1 those of b, each 64 keys wide over all 576 latent columns;
* the running row maximum passes from one group to the other through shared memory: group 0
  folds tile a into it (m0) and publishes m0, a's row sums and P_a; group 1 folds tile b on top
  (m1) and publishes m1, b's row sums and P_b. Each group then adds both tiles' P V to its half,
  rescaling between them. While one group runs its softmax the other's products use the
  matrix units;
* P of a tile is written over the tile's rope columns, which only its logits read: shared memory
  holds the queries, a ring of two latent tiles and nothing else;
* each tile arrives in three pieces (columns 0..255, 256..511 and the rope columns), each with
  its own barriers: a group starts its logits on a piece as soon as that piece has landed, and a
  piece of the ring is copied again as soon as the groups that read it are done (a V half by its
  group, the rope piece, holding P, by both); a third partition (one warp) issues the copies.

Both groups keep the same row maximum and row sums (each computes them from the same values in
the same order), so each normalises and writes its own half, staged through its own half of the
ring. Same contract as ``_mla_split_kernel`` for the partial results (per split, lse in natural
log, 0 and -inf for a split with no visible key, bottom-right causal mask); splits are merged by
the combine launch.

Measured (H200, bench/RESULTS.md): with every request's pages in L2 the seesaw reaches 492-513
TFLOP/s against the split kernel's 417-441; over distinct pages (as decode reads them) both run
at 397-425 TFLOP/s, DRAM at about 40% of its rate and each latent tile read from it about once
(ncu): what bounds them there is the two-tile ring (a tile's copy can start only when the stage
is free, about a pair of tiles before it is needed), which shared memory allows no deeper. The
split kernel stays the default (it also merges two splits itself); ``impl="seesaw"`` selects this.
"""

from __future__ import annotations

try:  # Gluon ships with Triton >= 3.5
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)

    from .mla_gluon import _program_keys
    HAVE_GLUON = True
except Exception:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

# registers a thread: the launch's cap for 3 warp groups (65,536 / 384, a multiple of 8), then what
# each partition is given (the loader's warp needs almost none; the two groups the rest)
LAUNCH_REGS = 168

if HAVE_GLUON:
    GROUP_REGS = gl.constexpr(240)
    LOADER_REGS = gl.constexpr(24)
    # a tile's three pieces, each with its own barriers: latent columns 0..255 (V of group 0),
    # 256..511 (V of group 1), the rope columns 512..575 (P of the tile once its logits are done)
    LO = gl.constexpr(0)
    HI = gl.constexpr(1)
    ROPE = gl.constexpr(2)

    @gluon.jit
    def _tile_row(table, n0, live, PAGE: gl.constexpr):
        """The cache row of key n0 (its page from the block table)."""
        return gl.load(table + n0 // PAGE, mask=live, other=0).to(gl.int32) * PAGE + n0 % PAGE

    @gluon.jit
    def _copy_piece(kv_desc, kr_desc, full, kv_lo, kv_hi, k_r, st, piece: gl.constexpr, row, live,
                    HALF: gl.constexpr, L: gl.constexpr):
        """Start the copy of one piece of the latent tile at cache row ``row`` into ring stage ``st``."""
        bar = full.index(st * 3 + piece)
        if piece == ROPE:
            mbarrier.expect(bar, kr_desc.block_type.nbytes, pred=live)
            tma.async_copy_global_to_shared(kr_desc, [row, L], bar, k_r.index(st), pred=live)
        else:
            mbarrier.expect(bar, kv_desc.block_type.nbytes, pred=live)
            if piece == LO:
                tma.async_copy_global_to_shared(kv_desc, [row, 0], bar, kv_lo.index(st), pred=live)
            else:
                tma.async_copy_global_to_shared(kv_desc, [row, HALF], bar, kv_hi.index(st), pred=live)

    @gluon.jit
    def _loader(kv_desc, kr_desc, table, kv_lo, kv_hi, k_r, full, empty, k_start, n_tiles,
                PAGE: gl.constexpr, HALF: gl.constexpr, L: gl.constexpr, BLOCK_N: gl.constexpr):
        """Tiles 2.. (0 and 1 were started before the partitions): each piece of tile t goes to stage
        t % 2 as soon as every group that reads that piece of the stage's previous tile is done."""
        for t in range(2, n_tiles):
            st = t % 2
            ph = ((t // 2) - 1) & 1
            row = _tile_row(table, k_start + t * BLOCK_N, True, PAGE)
            for piece in gl.static_range(3):
                mbarrier.wait(empty.index(st * 3 + piece), ph)
                _copy_piece(kv_desc, kr_desc, full, kv_lo, kv_hi, k_r, st, piece, row, True, HALF, L)

    @gluon.jit
    def _zero_past(buf, n0, k_end, COLS: gl.constexpr, BLOCK_N: gl.constexpr, fix_layout: gl.constexpr):
        """Zero the rows of a latent tile at keys >= k_end, 64 columns at a time (few registers: the
        group's accumulator stays live meanwhile)."""
        keep = gl.expand_dims(n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, fix_layout)) < k_end, 1)
        for c in gl.static_range(0, COLS, 64):
            piece = buf.slice(c, 64, dim=1)
            piece.store(gl.where(keep, piece.load(fix_layout), 0.0).to(buf.dtype))

    @gluon.jit
    def _logits(q_lo, q_hi, q_r, kv_lo, kv_hi, k_r, full, st, ph, n0, k_end, qpos, first_masked, qk_scale_log2,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, fix_layout: gl.constexpr):
        """Scaled logits (log2 units) of the tile in stage ``st``, -inf where masked, each piece's
        product started as soon as that piece has landed; a partial tile's rows past the end are
        zeroed in shared memory first (as values they meet P = 0, and 0 x NaN is NaN)."""
        klo = kv_lo.index(st)
        khi = kv_hi.index(st)
        kr = k_r.index(st)
        if n0 + BLOCK_N > k_end:
            for piece in gl.static_range(3):
                mbarrier.wait(full.index(st * 3 + piece), ph)
            _zero_past(klo, n0, k_end, klo.shape[1], BLOCK_N, fix_layout)
            _zero_past(khi, n0, k_end, khi.shape[1], BLOCK_N, fix_layout)
            _zero_past(kr, n0, k_end, kr.shape[1], BLOCK_N, fix_layout)
            fence_async_shared()
            gl.thread_barrier()
        s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        mbarrier.wait(full.index(st * 3 + LO), ph)
        s = warpgroup_mma(q_lo, klo.permute((1, 0)), s, use_acc=False, is_async=True)
        mbarrier.wait(full.index(st * 3 + HI), ph)
        s = warpgroup_mma(q_hi, khi.permute((1, 0)), s, is_async=True)
        mbarrier.wait(full.index(st * 3 + ROPE), ph)
        s = warpgroup_mma(q_r, kr.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if n0 + BLOCK_N > first_masked:  # past the end or under the causal mask
            kpos = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            visible = (gl.expand_dims(kpos, 0) <= gl.expand_dims(qpos, 1)) & gl.expand_dims(kpos < k_end, 0)
            return gl.where(visible, s * qk_scale_log2, float("-inf"))
        return s * qk_scale_log2

    @gluon.jit
    def _publish(p, p_buf, m_new, m_buf, rs, rs_buf, bar):
        """P (16-bit) over the tile's rope columns, the row maximum and row sums beside it, then
        the arrival that lets the other group read them."""
        if p_buf is not None:
            p_buf.store(p.to(p_buf.dtype))
        m_buf.store(m_new)
        rs_buf.store(rs)
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(bar, count=1)

    @gluon.jit
    def _values(acc, p_buf, v, empty, st, V_PIECE: gl.constexpr):
        """acc += P V over one half of the latent columns; then the stage's V piece and its P (rope
        piece) are released by this group."""
        acc = warpgroup_mma(p_buf, v, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(st * 3 + V_PIECE), count=1)
        mbarrier.arrive(empty.index(st * 3 + ROPE), count=1)
        return acc

    @gluon.jit
    def _write_half(acc, l_i, m_i, stage, o_part, lse_part, prow0, n_rows, col0, write_lse,
                    L: gl.constexpr, BLOCK_M: gl.constexpr, HALF: gl.constexpr, o_layout: gl.constexpr,
                    row_s: gl.constexpr):
        """This group's half of the normalised partial result, staged in shared memory (``stage``:
        the group's own half of the latent ring, which only its own products read) and written as
        whole rows, 16 at a time; group 0 also writes the lse."""
        empty = l_i == 0.0
        inv = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
        stage.store(acc * gl.expand_dims(gl.convert_layout(inv, gl.SliceLayout(1, o_layout)), 1))
        gl.thread_barrier()
        rows_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])  # 512 B a warp a row
        r16 = gl.arange(0, 16, layout=gl.SliceLayout(1, rows_layout))
        cols = gl.expand_dims(col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, rows_layout)), 0)
        for r0 in gl.static_range(0, BLOCK_M, 16):
            r = r0 + r16
            ptr = o_part + gl.expand_dims(prow0 + r.to(gl.int64), 1) * L + cols
            gl.store(ptr, stage.slice(r0, 16, dim=0).load(rows_layout), mask=gl.expand_dims(r < n_rows, 1))
        if write_lse:
            rr = gl.arange(0, BLOCK_M, layout=row_s)
            lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * 0.6931471805599453)
            gl.store(lse_part + prow0 + rr.to(gl.int64), lse, mask=rr < n_rows)

    @gluon.jit
    def _group(ROLE: gl.constexpr, q_lo, q_hi, q_r, kv_lo, kv_hi, k_r, full, empty, x0, x1, m0_buf, rs0_buf,
               m1_buf, rs1_buf, o_part, lse_part, prow0, n_rows, qrow0, H, seq_len, nq, k_start, k_end, n_tiles,
               qk_scale_log2, L: gl.constexpr, HALF: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr):
        """One warp group's loop over pairs of tiles (ROLE 0: logits of a, columns 0..255; ROLE 1:
        logits of b, columns 256..511)."""
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HALF, 16])
        fix_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        qpos = seq_len - nq + (qrow0 + gl.arange(0, BLOCK_M, layout=row_s)) // H
        first_masked = gl.minimum(seq_len - nq + 1, k_end)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
        acc = gl.zeros([BLOCK_M, HALF], gl.float32, layout=o_layout)
        p_a = k_r.index(0)._reinterpret(kv_lo.dtype, [BLOCK_M, BLOCK_N], k_r.type.layout)
        p_b = k_r.index(1)._reinterpret(kv_lo.dtype, [BLOCK_M, BLOCK_N], k_r.type.layout)
        if ROLE == 0:
            v_a = kv_lo.index(0)
            v_b = kv_lo.index(1)
        else:
            v_a = kv_hi.index(0)
            v_b = kv_hi.index(1)
        n_pairs = (n_tiles + 1) // 2
        for j in range(n_pairs):
            ph = j & 1
            a0 = k_start + (2 * j) * BLOCK_N
            b_live = 2 * j + 1 < n_tiles
            if ROLE == 0:
                s = _logits(q_lo, q_hi, q_r, kv_lo, kv_hi, k_r, full, 0, ph, a0, k_end, qpos, first_masked,
                            qk_scale_log2, BLOCK_M, BLOCK_N, s_layout, fix_layout)
                m0 = gl.maximum(m_i, gl.max(s, 1))
                m0s = gl.where(m0 == float("-inf"), 0.0, m0)
                scale0 = gl.exp2(m_i - m0s)
                p = gl.exp2(s - gl.expand_dims(m0s, 1))
                rs0 = gl.sum(p, 1)
                _publish(p, p_a, m0, m0_buf, rs0, rs0_buf, x0)
                acc = _values(acc * gl.expand_dims(gl.convert_layout(scale0, row_o), 1), p_a, v_a, empty, 0, LO)
                mbarrier.wait(x1, ph)
                m1 = m1_buf.load(row_s)
                rs1 = rs1_buf.load(row_s)
                m1s = gl.where(m1 == float("-inf"), 0.0, m1)
                scale1 = gl.exp2(m0s - m1s)
                acc = acc * gl.expand_dims(gl.convert_layout(scale1, row_o), 1)
                if b_live:
                    acc = _values(acc, p_b, v_b, empty, 1, LO)
            else:
                s = gl.full([BLOCK_M, BLOCK_N], float("-inf"), gl.float32, layout=s_layout)
                if b_live:
                    s = _logits(q_lo, q_hi, q_r, kv_lo, kv_hi, k_r, full, 1, ph, a0 + BLOCK_N, k_end, qpos,
                                first_masked, qk_scale_log2, BLOCK_M, BLOCK_N, s_layout, fix_layout)
                mbarrier.wait(x0, ph)
                m0 = m0_buf.load(row_s)
                rs0 = rs0_buf.load(row_s)
                m0s = gl.where(m0 == float("-inf"), 0.0, m0)
                scale0 = gl.exp2(m_i - m0s)
                if b_live:
                    m1 = gl.maximum(m0, gl.max(s, 1))
                    m1s = gl.where(m1 == float("-inf"), 0.0, m1)
                    p = gl.exp2(s - gl.expand_dims(m1s, 1))
                    rs1 = gl.sum(p, 1)
                    _publish(p, p_b, m1, m1_buf, rs1, rs1_buf, x1)
                else:
                    m1 = m0
                    m1s = m0s
                    rs1 = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
                    _publish(None, None, m1, m1_buf, rs1, rs1_buf, x1)
                scale1 = gl.exp2(m0s - m1s)
                acc = _values(acc * gl.expand_dims(gl.convert_layout(scale0, row_o), 1), p_a, v_a, empty, 0, HI)
                acc = acc * gl.expand_dims(gl.convert_layout(scale1, row_o), 1)
                if b_live:
                    acc = _values(acc, p_b, v_b, empty, 1, HI)
            l_i = (l_i * scale0 + rs0) * scale1 + rs1
            m_i = m1
        # The group's half of the ring (kv_lo: group 0, kv_hi: group 1; two stages, 64 KB) holds the
        # result on its way out: only this group's products read that half once every logit product
        # is done, and the other group's last one finished before the exchange this group waited for.
        out_lay: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=4, order=[1, 0])
        if ROLE == 0:
            stage = kv_lo._reinterpret(gl.float32, [BLOCK_M, HALF], out_lay)
        else:
            stage = kv_hi._reinterpret(gl.float32, [BLOCK_M, HALF], out_lay)
        _write_half(acc, l_i, m_i, stage, o_part, lse_part, prow0, n_rows, ROLE * HALF, ROLE == 0,
                    L, BLOCK_M, HALF, o_layout, row_s)

    @gluon.jit(do_not_specialize=["n_qrows", "max_blocks", "keys_per_split"])
    def _mla_seesaw_kernel(q_lat, q_pe, kv_desc, kr_desc, block_table, seq_lens, o_part, lse_part,
                           n_qrows, M, H, nq, max_blocks, keys_per_split, qk_scale_log2,
                           L: gl.constexpr, R: gl.constexpr, PAGE: gl.constexpr, HALF: gl.constexpr,
                           BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
        gl.static_assert(L == 2 * HALF)
        gl.static_assert(PAGE % BLOCK_N == 0)
        gl.static_assert(R == BLOCK_N)  # P of a tile is written over its rope columns
        row_layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [4, 1], [1, 0])
        row_r: gl.constexpr = gl.SliceLayout(1, row_layout)
        col_r: gl.constexpr = gl.SliceLayout(0, row_layout)
        vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        dt: gl.constexpr = kv_desc.dtype

        mt, sp, b, seq_len, k_start, k_end, n_tiles, table = _program_keys(seq_lens, block_table, max_blocks,
                                                                           keys_per_split, M, H, nq, BLOCK_M,
                                                                           BLOCK_N)

        q_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, HALF], dt)
        qr_lay: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, R], dt)
        q_lo = gl.allocate_shared_memory(dt, [BLOCK_M, HALF], q_lay)
        q_hi = gl.allocate_shared_memory(dt, [BLOCK_M, HALF], q_lay)
        q_r = gl.allocate_shared_memory(dt, [BLOCK_M, R], qr_lay)
        kv_lo = gl.allocate_shared_memory(dt, [2, BLOCK_N, HALF], kv_desc.layout)
        kv_hi = gl.allocate_shared_memory(dt, [2, BLOCK_N, HALF], kv_desc.layout)
        k_r = gl.allocate_shared_memory(dt, [2, BLOCK_N, R], kr_desc.layout)
        m0_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        rs0_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        m1_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        rs1_buf = gl.allocate_shared_memory(gl.float32, [BLOCK_M], vec)
        full = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [6, 1], mbarrier.MBarrierLayout())
        x0 = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
        x1 = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout()).index(0)
        for i in gl.static_range(6):
            mbarrier.init(full.index(i), count=1)
            # a V piece is read by one group, the rope piece (P) by both
            mbarrier.init(empty.index(i), count=2 if i % 3 == ROPE else 1)
        mbarrier.init(x0, count=1)
        mbarrier.init(x1, count=1)

        # the first two tiles, then the queries (read in their own precision, cast here) while they land
        for t in gl.static_range(2):
            row = _tile_row(table, k_start + t * BLOCK_N, t < n_tiles, PAGE)
            for piece in gl.static_range(3):
                _copy_piece(kv_desc, kr_desc, full, kv_lo, kv_hi, k_r, t, piece, row, t < n_tiles, HALF, L)
        qrows = b * M + mt * BLOCK_M + gl.arange(0, BLOCK_M, layout=row_r).to(gl.int64)
        qmask = gl.expand_dims(qrows < n_qrows, 1)
        c_h = gl.expand_dims(gl.arange(0, HALF, layout=col_r), 0)
        c_r = gl.expand_dims(gl.arange(0, R, layout=col_r), 0)
        q_lo.store(gl.load(q_lat + gl.expand_dims(qrows, 1) * L + c_h, mask=qmask, other=0.0).to(dt))
        q_hi.store(gl.load(q_lat + gl.expand_dims(qrows, 1) * L + HALF + c_h, mask=qmask, other=0.0).to(dt))
        q_r.store(gl.load(q_pe + gl.expand_dims(qrows, 1) * R + c_r, mask=qmask, other=0.0).to(dt))
        fence_async_shared()
        gl.thread_barrier()

        prow0 = sp * n_qrows + b * M + mt * BLOCK_M  # this tile's first row among the partial results
        n_rows = gl.minimum(M - mt * BLOCK_M, BLOCK_M)
        qrow0 = mt * BLOCK_M
        gl.warp_specialize([
            (_group, (0, q_lo, q_hi, q_r, kv_lo, kv_hi, k_r, full, empty, x0, x1, m0_buf, rs0_buf, m1_buf, rs1_buf,
                       o_part, lse_part, prow0, n_rows, qrow0, H, seq_len, nq, k_start, k_end, n_tiles, qk_scale_log2,
                       L, HALF, BLOCK_M, BLOCK_N)),
            (_group, (1, q_lo, q_hi, q_r, kv_lo, kv_hi, k_r, full, empty, x0, x1, m0_buf, rs0_buf, m1_buf, rs1_buf,
                       o_part, lse_part, prow0, n_rows, qrow0, H, seq_len, nq, k_start, k_end, n_tiles, qk_scale_log2,
                       L, HALF, BLOCK_M, BLOCK_N)),
            (_loader, (kv_desc, kr_desc, table, kv_lo, kv_hi, k_r, full, empty, k_start, n_tiles, PAGE, HALF, L,
                       BLOCK_N)),
        ], [4, 1], [GROUP_REGS, LOADER_REGS])


def seesaw_applies(cache, L: int, R: int, block_n: int) -> bool:
    """Where the seesaw kernel can run: as the Gluon split kernel (``mla_gluon.gluon_applies``),
    and the rope width equal to the key tile (P takes the rope columns' place)."""
    from .mla_gluon import gluon_applies

    return HAVE_GLUON and R == block_n and gluon_applies(cache, L, R, block_n)


def launch_seesaw(q_lat, q_pe, cache, block_table, seq_lens, o_part, lse_part, M, H, nq, per, qk_scale_log2,
                  num_splits, block_m=64, block_n=64) -> None:
    """Launch the seesaw kernel: q_lat (B, M, L) and q_pe (B, M, R) contiguous, any float dtype
    (cast inside); partial results o_part (splits, B, M, L) / lse_part (splits, B, M), o_part[0]
    the result with one split (more: the caller merges them)."""
    from .mla_gluon import latent_descriptors

    B = q_lat.shape[0]
    L, R = q_lat.shape[-1], q_pe.shape[-1]
    half = L // 2
    kv_desc, kr_desc = latent_descriptors(cache, L, R, block_n)
    mtiles = (M + block_m - 1) // block_m
    _mla_seesaw_kernel[(mtiles, num_splits, B)](
        q_lat, q_pe, kv_desc, kr_desc, block_table, seq_lens, o_part, lse_part, B * M, M, H, nq,
        block_table.shape[1], per, qk_scale_log2,
        L=L, R=R, PAGE=cache.shape[1], HALF=half, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=4, maxnreg=LAUNCH_REGS)
