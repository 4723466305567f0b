"""The ``vllm`` provider: the installed vLLM's own kernels, op by op, under hybridsim's checks.

Each binding adapts hybridsim's tensors to the engine's layouts and calls the engine's function
as installed (imported, never copied): the fused post-process Mamba state copy, the Triton MLA
decode, the lse merge, the paged-attention kernel and the K/V cache write. An op the installed
vLLM lacks, or cannot load here (its compiled ops need the torch it was built for), and every call
that asks for an injected kernel bug (the bug lives in hybridsim's own kernel), runs hybridsim's
Triton op instead; ``op_sources`` and ``call_counts`` say which code each op ran, and the run
prints them.

On a machine without CUDA the engine's Triton kernels run under the Triton interpreter, as
hybridsim's do. vLLM disables Triton where it finds no active GPU driver, unless
``CUDA_VISIBLE_DEVICES`` is set and empty (its rule for workers that have not yet seen their
device): on such a machine that is how it is imported here, and nothing else changes.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from math import prod

import torch

from ..device.transfer import upload
from .triton_kernels import TritonKernels

SUPPORTED = ("0.33.",)  # vLLM releases whose kernel signatures these bindings follow
INSTALL = ("install vLLM 0.33 beside this torch (on a CPU machine bench/peer_setup.sh makes a venv with it; "
           "elsewhere `pip install vllm==0.33.0`)")

# op -> (module, function) of the engine's kernel the binding calls
ENGINE_OPS = {
    "state_copy": ("vllm.v1.worker.mamba_utils", "postprocess_mamba_fused_kernel"),
    "mla_decode": ("vllm.v1.attention.ops.triton_decode_attention", "decode_attention_fwd"),
    "merge_states": ("vllm.v1.attention.ops.triton_merge_attn_states", "merge_attn_states"),
    "paged_attention": ("vllm.v1.attention.ops.triton_unified_attention", "unified_attention"),
    "reshape_and_cache": ("vllm.v1.attention.ops.triton_reshape_and_cache_flash", "triton_reshape_and_cache_flash"),
}
# ops the engine has only as compiled code (or not at all): hybridsim's op runs, for this reason
NOT_BOUND = {
    "mamba_scan": "no engine counterpart: the Mamba probe layer is hybridsim's",
    "concat_and_cache": "the engine's latent-cache write (concat_and_cache_mla) is a compiled op, not bound",
    "gather_cache": "the engine's context gather (gather_and_maybe_dequant_cache) is a compiled op, not bound",
    "attention_partial": "the engine's prefill attention is FlashAttention's compiled kernel, not bound",
}
STATE_COPY_TILES = 16  # the temporal-copy tiles per (request, state), as the engine launches it
_ENCODED_BLOCK = 64  # the block size the state-copy decisions are encoded against (see _copy_decisions)


def vllm_version() -> str:
    """The installed vLLM's version; ImportError saying how to install it where there is none,
    or naming it where it is one these bindings do not follow."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        raise ImportError(f"vLLM is not installed: {INSTALL}")
    try:
        v = version("vllm")
    except PackageNotFoundError:  # the package without its metadata (its files copied onto a machine)
        import vllm

        v = getattr(vllm, "__version__", "unknown")
    if not v.startswith(SUPPORTED):
        raise ImportError(f"vLLM {v} is installed; hybridsim's bindings follow vLLM "
                          f"{', '.join(s.rstrip('.') for s in SUPPORTED)} only: {INSTALL}")
    return v


COMPILED_EXTENSION = "vllm._C_stable_libtorch"


def _compiled_extension_stand_in() -> str | None:
    """vLLM's CUDA platform module imports its compiled extension only to register the compiled ops,
    and fails where that extension cannot load: built for another torch (vLLM 0.33's for torch 2.14),
    or absent where only the Python files were installed. None of the kernels bound here is a
    compiled op, so an empty module stands in for the extension (as vLLM's own ROCm platform goes on
    without it); the reason is returned, and the provider shows it beside every op."""
    if not torch.cuda.is_available() or COMPILED_EXTENSION in sys.modules:
        return None
    try:
        importlib.import_module(COMPILED_EXTENSION)
        return None
    except ImportError as e:
        sys.modules[COMPILED_EXTENSION] = types.ModuleType(COMPILED_EXTENSION)
        return (f"vLLM's compiled extension does not load here ({type(e).__name__}: {str(e).splitlines()[0][:100]}): "
                f"its compiled ops are absent, and none is bound")


def _import_engine_triton() -> str | None:
    """Import vLLM's Triton switch; None where its Triton is on, else why it is off."""
    no_gpu = not torch.cuda.is_available() and "CUDA_VISIBLE_DEVICES" not in os.environ
    if no_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        tu = importlib.import_module("vllm.triton_utils")
    finally:
        if no_gpu:
            del os.environ["CUDA_VISIBLE_DEVICES"]
    if tu.HAS_TRITON:
        return None
    try:
        from triton.backends import backends  # noqa: F401
    except ImportError as e:
        return f"vLLM turned its Triton kernels off: `from triton.backends import backends` failed ({e})"
    return "vLLM turned its Triton kernels off (vllm.triton_utils.HAS_TRITON is False: no single active GPU driver)"


class VllmKernels(TritonKernels):
    name = "vllm"

    def __init__(self, poison: bool = False):
        super().__init__(poison)
        self.version = vllm_version()
        self.fns: dict[str, object] = {}
        self.why_not: dict[str, str] = dict(NOT_BOUND)
        self.stand_in = _compiled_extension_stand_in()
        off = _import_engine_triton()
        for op, (mod, fn) in ENGINE_OPS.items():
            if off is not None:
                self.why_not[op] = off
                continue
            try:
                self.fns[op] = getattr(importlib.import_module(mod), fn)
            except (ImportError, AttributeError) as e:
                self.why_not[op] = f"{mod}.{fn} cannot be loaded here ({type(e).__name__}: {e})"
        self.calls: dict[str, list[int]] = {}  # op -> [engine calls, hybridsim calls]
        self.fallback_reasons: dict[str, int] = {}  # why state copies ran hybridsim's op -> calls
        self.tried: set[str] = set()  # ops whose engine function has run once (``_first_call``)
        self.split_note: str | None = None  # why MLA decode uses a fixed split count, where it does

    # ------------------------------------------------------------------ provenance
    def op_sources(self) -> dict[str, str]:
        out = {}
        from . import OPS

        for op in OPS:
            if op in self.fns:
                mod, fn = ENGINE_OPS[op]
                out[op] = f"vLLM {self.version}: {mod}.{fn}" + (
                    f" ({self.split_note})" if op == "mla_decode" and self.split_note else "")
            else:
                out[op] = f"hybridsim triton ({self.why_not.get(op, 'not bound')})"
        return out

    def call_counts(self) -> dict[str, tuple[int, int]]:
        return {op: (a, b) for op, (a, b) in self.calls.items()}

    def _count(self, op: str, engine: bool) -> None:
        c = self.calls.setdefault(op, [0, 0])
        c[0 if engine else 1] += 1

    def _first_call(self, op: str, call) -> bool:
        """Run an op's engine binding. Its first call may find that the engine function cannot run
        here (its wrapper asks the GPU for its compute capability, say): then the op is hybridsim's
        from now on, with the reason kept, and False tells the caller to run its own op (which
        rewrites whatever the failed call wrote). A later failure is raised: it is a finding."""
        first = op not in self.tried  # (an empty call counts but does not run the function)
        self.tried.add(op)
        try:
            call()
        except Exception as e:  # noqa: BLE001 (any failure of a first call means "cannot run here")
            if not first:
                raise
            mod, fn = ENGINE_OPS[op]
            self.why_not[op] = f"{mod}.{fn} cannot run here ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
            del self.fns[op]
            return False
        self._count(op, True)
        return True

    # ------------------------------------------------------------------ Mamba state copies
    def prepare_state_copy(self, conv, temporal, table, items):
        """The host side of a state-copy call (reading the items back, uploading the engine's
        counters, tables and state metadata), done before the call's timing starts: the engine
        keeps all of these on the device already, so only the kernel is timed."""
        if "state_copy" in self.fns:
            self._prepared_copy = ((id(conv), id(temporal), id(table), id(items)), (table, items),
                                   self._copy_decisions(conv, temporal, table, items))

    def state_copy(self, conv, temporal, table, items):
        kept = getattr(self, "_prepared_copy", None)
        self._prepared_copy = None
        if kept is not None and kept[0] == (id(conv), id(temporal), id(table), id(items)):
            enc = kept[2]
        else:
            enc = self._copy_decisions(conv, temporal, table, items) if "state_copy" in self.fns else "not bound"
        if isinstance(enc, str):
            self._count("state_copy", False)
            self.fallback_reasons[enc] = self.fallback_reasons.get(enc, 0) + 1
            return super().state_copy(conv, temporal, table, items)
        self._count("state_copy", True)
        n_copies, states, decisions, tables = enc
        accepted, src_col, scheduled, computed, drafts = decisions
        ptrs = upload([t.data_ptr() for t in tables], conv.device)
        accepted_out = accepted.clone()
        grid = (n_copies, states[0].numel(), STATE_COPY_TILES)
        self.fns["state_copy"][grid](
            accepted, src_col, scheduled, computed, drafts, ptrs, tables[0].stride(0), *states, accepted_out, None,
            n_copies, block_size=_ENCODED_BLOCK, COPY_BLOCK_SIZE=1024, CONV_STATE_DIM_FIRST=False,
            TEMPORAL_TILES=STATE_COPY_TILES)

    @staticmethod
    def _copy_decisions(conv, temporal, table, items):
        """hybridsim's copies as the engine kernel's inputs, or the reason they cannot be.

        The executor gives one item per (copy, layer); a layer's slot in the caches is shared by
        the same-numbered layer of every Mamba group (as the engine shares its tensors), and its
        block row is its group's. The engine's kernel launches (request, state) programs over
        per-group block tables and decides each request's copy from its step counters. Here the
        k-th item of every slot is one engine request (the executor lists a copy's layers in the
        same order for every copy, so these are one copy, in one Mamba group each), each slot one
        group with its own block table, and the counters are those from which the engine's rule
        picks exactly the copy hybridsim's plan asks for: running state at (dst + 1) * B - offset,
        one more accepted token than the offset, source column ``src`` (B a block size of 64:
        offsets stay below it). The engine then reads the temporal state from column src + offset;
        a copy whose temporal source is elsewhere (an injected bookkeeping bug) is not one the
        engine can make, and the call runs hybridsim's op.
        """
        it = items.to("cpu", torch.int64)
        n = it.shape[0]
        if n == 0:
            return "an empty call"
        slots = sorted(set(it[:, 1].tolist()))
        per_slot = [it[it[:, 1] == j] for j in slots]
        if any(len(p) != len(per_slot[0]) for p in per_slot):
            return "slots with different copy counts"
        cols = torch.stack([p[:, 2:] for p in per_slot])  # (slots, copies, 4): src, dst, temporal src, offset
        if not torch.equal(cols, cols[:1].expand_as(cols)):
            return "copies listed in different orders per slot"
        src, dst, tsrc, off = cols[0].unbind(1)
        if not torch.equal(tsrc, src + off):
            return "a temporal source other than conv source + offset (only an injected bug makes one)"
        if bool((off < 0).any()) or bool((off >= _ENCODED_BLOCK).any()) or int(dst.max()) >= (1 << 31) // _ENCODED_BLOCK - 1:
            return "an offset or column outside what the encoding holds"
        if conv.stride(3) != 1 or conv.stride(2) != conv.shape[3] or not _page_contiguous(temporal):
            return "a state page that is not one dense run"
        dev = conv.device
        running = (dst + 1) * _ENCODED_BLOCK - off
        zeros = torch.zeros_like(src)
        decisions = tuple(upload(v, dev, torch.int32) for v in (off + 1, src, zeros, running, zeros))
        tab = table.to("cpu", torch.int32)  # (a host table: each slot's rows picked here, uploaded without waiting)
        tables = [upload(tab.index_select(0, p[:, 0]), dev, torch.int32) for p in per_slot]
        esz_c, esz_t = conv.element_size(), temporal.element_size()
        base, stride, esize, inner, width, group = [], [], [], [], [], []
        for g, slot in enumerate(slots):
            base += [conv.data_ptr() + slot * conv.stride(0) * esz_c, temporal.data_ptr() + slot * temporal.stride(0) * esz_t]
            stride += [conv.stride(1) * esz_c, temporal.stride(1) * esz_t]
            esize += [esz_c, esz_t]
            inner += [conv.shape[3], prod(temporal.shape[2:])]
            width += [conv.shape[2], 0]
            group += [g, g]
        states = [upload(v, dev) for v in (base, stride, esize, inner, width, group)]
        states.insert(6, upload([0] * len(base), dev, torch.int32))  # DS conv row counts: 0, the single-region copy
        states.insert(7, upload([0] * len(base), dev))
        return len(src), states, decisions, tables

    # ------------------------------------------------------------------ attention pieces
    def merge_states(self, o_a, lse_a, o_b, lse_b, base2_bug=False, unguarded=False):
        if base2_bug or unguarded or "merge_states" not in self.fns:  # (an injected bug lives in hybridsim's op)
            self._count("merge_states", False)
            return super().merge_states(o_a, lse_a, o_b, lse_b, base2_bug, unguarded)
        self._count("merge_states", True)
        D = o_a.shape[-1]
        out = self._out(o_a.shape, torch.float32, o_a.device)
        lse = self._out(lse_a.shape, torch.float32, lse_a.device)
        if lse_a.numel():
            self.fns["merge_states"](out.view(-1, 1, D), o_a.float().reshape(-1, 1, D).contiguous(),
                                     lse_a.float().reshape(1, -1).contiguous(), o_b.float().reshape(-1, 1, D).contiguous(),
                                     lse_b.float().reshape(1, -1).contiguous(), lse.view(1, -1))
        return out, lse

    def mla_decode(self, q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits=0,
                   max_seq_len=None, **tuning):
        """The engine's Triton MLA decode: one query row per (request, query token), a row's keys
        ending at its own position (how the engine's backend lays out multi-token decodes)."""
        if "mla_decode" not in self.fns:
            self._count("mla_decode", False)
            return super().mla_decode(q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits,
                                      max_seq_len, **tuning)
        self._count("mla_decode", True)
        B, nq, H, L = q_lat.shape
        dev = cache.device
        low = cache.dtype in (torch.bfloat16, torch.float16)
        q = torch.cat([q_lat, q_pe.to(q_lat.dtype)], dim=-1).to(cache.dtype if low else torch.float32)
        q = q.reshape(B * nq, H, -1).contiguous()
        table, lens, splits = self.prepare_mla_decode(q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale,
                                                      num_splits, max_seq_len)
        o = self._out((B * nq, H, L), torch.float32, dev)
        lse = self._out((B * nq, H), torch.float32, dev)
        logits = torch.empty((B * nq, H, splits, L + 1), dtype=torch.float32, device=dev)
        kv = cache.unsqueeze(2)  # (blocks, page, 1 head, L + R)
        one = self._unit_scale(dev)  # (the engine passes its layer's scales; unscaled: a bf16 cache)
        self.fns["mla_decode"](q, kv, kv[..., :L], o, lse, table, lens, logits, splits,
                               float(scale), cache.shape[1], k_scale=one, v_scale=one, is_mla=True)
        return o.view(B, nq, H, L), lse.view(B, nq, H)

    def prepare_mla_decode(self, q_lat, q_pe, cache, block_table, seq_lens, kv_lora_rank, scale, num_splits=0,
                           max_seq_len=None, **_):
        """The engine's decode metadata for a call (int32 block table and per-row key extents, one
        row per query token; the split count), made before the call's timing starts and kept for
        the call (keyed by identity)."""
        key = (id(block_table), id(seq_lens), q_lat.shape[1], num_splits, max_seq_len)
        kept = getattr(self, "_mla_meta", None)
        if kept is None or kept[0] != key:
            dev, nq = cache.device, q_lat.shape[1]
            lens = (seq_lens.to(dev, torch.int32) if seq_lens.device == dev else upload(seq_lens, dev, torch.int32))
            table = (block_table.to(dev, torch.int32) if block_table.device == dev
                     else upload(block_table, dev, torch.int32))
            if nq > 1:
                table = table.repeat_interleave(nq, dim=0)
                lens = (lens[:, None] + torch.arange(1 - nq, 1, device=dev, dtype=torch.int32)).flatten().clamp_min(0)
            splits = num_splits if num_splits > 0 else self._mla_splits(
                int(seq_lens.max()) if max_seq_len is None else int(max_seq_len), dev)
            self._mla_meta = kept = (key, (table.contiguous(), lens.contiguous(), splits), (block_table, seq_lens))
        return kept[1]

    def _unit_scale(self, dev: torch.device) -> torch.Tensor:
        """A float32 1.0 kept on the device (made per call, it would be an upload that waits for
        the device's queue)."""
        kept = getattr(self, "_ones", {})
        if dev not in kept:
            kept[dev] = torch.ones((), dtype=torch.float32, device=dev)
            self._ones = kept
        return kept[dev]

    def _mla_splits(self, max_len: int, dev: torch.device) -> int:
        """The split count the engine's Triton MLA backend picks for this length and card (its own
        function where its backend module loads; else 4, and the op's source says so)."""
        if not hasattr(self, "_split_rule"):
            try:
                from vllm.v1.attention.backends.mla.triton_mla import _compute_num_kv_splits

                self._split_rule = _compute_num_kv_splits
            except Exception as e:  # noqa: BLE001 (the backend module pulls in much of the engine)
                self._split_rule = None
                self.split_note = f"4 splits (the engine's split rule did not load: {e})"
        if self._split_rule is None:
            return 4
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 4
        return max(1, int(self._split_rule(max(1, max_len), sms)))

    def reshape_and_cache(self, key, value, slots, k_cache, v_cache):
        if "reshape_and_cache" not in self.fns:
            self._count("reshape_and_cache", False)
            return super().reshape_and_cache(key, value, slots, k_cache, v_cache)
        if key.shape[0] == 0:
            return self._count("reshape_and_cache", True)
        one = self._unit_scale(k_cache.device)
        fn = self.fns["reshape_and_cache"]
        if not self._first_call("reshape_and_cache", lambda: fn(
                key.to(k_cache.device, k_cache.dtype), value.to(v_cache.device, v_cache.dtype), k_cache, v_cache,
                slots.to(k_cache.device, torch.int64), "auto", one, one)):
            self._count("reshape_and_cache", False)
            super().reshape_and_cache(key, value, slots, k_cache, v_cache)

    def paged_attention(self, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale,
                        max_seq_len=None, num_splits=0, past_end_bug=False, **tuning):
        if past_end_bug or "paged_attention" not in self.fns:
            self._count("paged_attention", False)
            return super().paged_attention(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale,
                                           max_seq_len, num_splits, past_end_bug, **tuning)
        self._count("paged_attention", True)
        dev = k_cache.device
        out = self._out(q.shape, torch.float32, dev)
        if q.shape[0] == 0:
            return out
        qsl_d, lens_d, table_d, max_q, max_k = self.prepare_paged_attention(q, k_cache, v_cache, block_table,
                                                                            query_start_loc, seq_lens, scale)
        low = k_cache.dtype in (torch.bfloat16, torch.float16)
        self.fns["paged_attention"](
            q=q.to(dev, k_cache.dtype if low else torch.float32).contiguous(), k=k_cache, v=v_cache, out=out,
            cu_seqlens_q=qsl_d, max_seqlen_q=max_q, seqused_k=lens_d, max_seqlen_k=max_k,
            softmax_scale=float(scale), causal=True, window_size=(-1, -1), block_table=table_d, softcap=0.0,
            q_descale=None, k_descale=None, v_descale=None)
        return out

    def prepare_paged_attention(self, q, k_cache, v_cache, block_table, query_start_loc, seq_lens, scale, *_, **__):
        """The engine's metadata for a step's rows (int32 lengths and table on the device, the
        longest query and key extents), made once and shared by the layers of the step (the same
        length tensors: keyed by identity, the entry keeping them alive)."""
        key = (id(query_start_loc), id(seq_lens), id(block_table), k_cache.device)
        kept = getattr(self, "_paged_meta", None)
        if kept is None or kept[0] != key:
            dev = k_cache.device
            qsl = query_start_loc.to("cpu", torch.int64)
            lens = seq_lens.to("cpu", torch.int64)
            max_q = int((qsl[1:] - qsl[:-1]).max()) if len(lens) else 0
            max_k = int(lens.max()) if len(lens) else 0
            table = (block_table.to(dev, torch.int32) if block_table.device == dev
                     else upload(block_table, dev, torch.int32)).contiguous()
            meta = (upload(qsl, dev, torch.int32), upload(lens, dev, torch.int32), table, max_q, max_k)
            self._paged_meta = kept = (key, meta, (query_start_loc, seq_lens, block_table))
        return kept[1]


def _page_contiguous(t: torch.Tensor) -> bool:
    """Each page of ``t`` (layers, pages, ...) one dense run of elements."""
    expect = 1
    for size, stride in zip(reversed(t.shape[2:]), reversed(t.stride()[2:])):
        if size != 1 and stride != expect:
            return False
        expect *= size
    return True
