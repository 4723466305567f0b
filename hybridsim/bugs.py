"""The bugs a run can inject (``--inject-bug``): what each breaks and the check expected to catch it.

Torch-free, so that validating a command's flags and a sweep's cells (in a driver that never
executes a step) does not load the engine.
"""

from __future__ import annotations

from .config import Scenario
from .errors import InputError

# name -> (what it breaks, the check expected to catch it)
BUGS: dict[str, tuple[str, str]] = {
    "stale_state_index": ("requests force-preempted by reset_prefix_cache keep their old state index "
                          "(resumed ids not cleaned up)", "ssm.running_state"),
    "no_conv_shift_on_accept": ("conv windows are copied without the accept-bias shift", "ssm.running_state"),
    "temporal_without_bias": ("the temporal state is copied from the running column, ignoring the accept bias",
                              "ssm.running_state"),
    "align_precopy_skipped": ("align mode never copies the state into the new running block", "ssm.output"),
    "chunk_crosses_boundary": ("Mamba2 prefill chunks ignore the chunk_size grid of absolute positions",
                               "mamba.chunk_meta"),
    "rejected_state_kept": ("after a partly rejected draft run, the state after the last draft is kept",
                            "ssm.running_state"),
    "int32_block_offset": ("state-page addresses computed as block_id x page_bytes in 32-bit arithmetic: "
                           "pages past 2 GiB wrap onto other pages", "ssm.running_state"),
    "ctx_chunk_unaligned": ("MLA prefill context chunks start off page boundaries", "mla.output"),
    "lse_base2": ("partial attentions merged with exp2 against natural-log lse", "mla.output"),
    "lse_unmasked": ("an empty context partial (lse -inf) is merged without sanitising", "mla.output"),
    "attn_hit_not_cut": ("the attention group keeps the blocks of its own, longer prefix hit instead of cutting "
                         "them back to the Mamba-aligned hit: the request recomputes into blocks others hold",
                         "attn.cached_blocks"),
    "free_shared_block": ("freeing a request's attention blocks ignores the reference count: a block another "
                          "request still holds goes back to the free queue and is handed out again",
                          "attn.cached_blocks"),
    "slot_off_by_one": ("the slot mapping sends the first token of each block through the previous block-table "
                        "column", "attn.output"),
    "rejected_kv_visible": ("the step after a partly rejected draft run still counts the rejected drafts in the "
                            "row's sequence length: its queries see K/V past the row's end", "attn.output"),
    "paged_attn_past_end": ("the paged-attention loop runs one block-table column past the row's last block "
                            "without masking it", "attn.output"),
    # partial-block prefix hits (a prefix_match_unit below the block size)
    "block_copy_after_writes": ("the private copy of a partly hit block is made after the step's writes, not "
                                "before: the hit's tokens are read from an empty copy", "attn.cached_blocks"),
    "block_copy_wrong_source": ("every private copy of a step reads the step's first source page (the "
                                "source index is never advanced): a hit's K/V come from another group's block",
                                "attn.cached_blocks"),
    "partial_hit_not_copied": ("a prefix hit that ends inside a block takes that block itself, not a private "
                               "copy: the request writes past the hit into a block others hold",
                               "attn.cached_blocks"),
    "unit_checkpoint_at_block": ("a chunk exporting the Mamba state at the prompt's unit checkpoint writes the "
                                 "state at the block boundary before it", "ssm.cached_blocks"),
}


def check_bugs(names: list[str]) -> set[str]:
    unknown = [n for n in names if n not in BUGS]
    if unknown:
        raise InputError(f"unknown bug {unknown[0]!r}; `hybridsim run --list-bugs` lists them", "--inject-bug")
    return set(names)


_BUG_LAYERS = {"ssm": "mamba", "mamba": "mamba", "attn": "attention", "mla": "mla"}  # check prefix -> layer kind
_LAYER_NAMES = {"mamba": "Mamba", "attention": "GQA attention", "mla": "MLA"}


def inapplicable_bugs(s: Scenario, bugs: set[str]) -> list[str]:
    """One sentence per bug in a layer kind the model does not have: such a bug changes nothing."""
    geo = s.geometry()
    have = [kind for kind in ("mamba", "attention", "mla") if getattr(geo, kind) is not None]
    out = []
    for name in sorted(bugs):
        kind = _BUG_LAYERS[BUGS[name][1].split(".")[0]]
        if kind not in have:
            out.append(f"{name} breaks {_LAYER_NAMES[kind]} layers, and scenario {s.name!r} has none (its layers: "
                       f"{', '.join(_LAYER_NAMES[k] for k in have)})")
    return out


def check_bugs_apply(s: Scenario, bugs: set[str], where: str = "--inject-bug") -> None:
    """A bug that could change nothing in this model makes a run that passes and proves nothing:
    refused (exit 2), naming the kinds of layer the model has."""
    missing = inapplicable_bugs(s, bugs)
    if missing:
        raise InputError(f"{missing[0]}; `hybridsim run --list-bugs` says what each bug breaks", where)
