from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import hybridsim  # noqa: F401  (first: it sets GOMP_SPINCOUNT before any test module imports torch)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"  # the trace slices and vLLM recordings the repository ships (data/SOURCES.md)
SCENARIOS = sorted((REPO / "scenarios").glob("*.yaml"))
RECORDINGS = sorted((DATA / "vllm-recorded").glob("*.jsonl"))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n 2` (make test) on two cores: each worker keeps to one torch thread, so the two
    # share the cores instead of four threads contending for them (processes a test starts, sweep
    # workers and the like, set their own)
    import torch

    torch.set_num_threads(1)


TINY = """
name: {name}
seed: {seed}
model: {{preset: {preset}}}
cache: {{block_size: {bs}, num_blocks: {blocks}, enable_prefix_caching: {caching}, mamba_cache_mode: {mode}}}
scheduler: {{max_num_batched_tokens: {budget}, max_num_seqs: {seqs}, max_model_len: {max_len}}}
spec_decode: {{num_speculative_tokens: {spec}, acceptance: {acc}}}
workload:
  kind: synthetic
  num_requests: {n}
  arrival: {{kind: fixed, per_step: {per_step}}}
  prompt_len: {{dist: uniform, min: {pmin}, max: {pmax}}}
  output_len: {{dist: uniform, min: {omin}, max: {omax}}}
  shared_prefix: {{len: {prefix}, fraction: {frac}}}
"""


def tiny_scenario(faults: str | None = None, execution: str | None = None, **kw) -> str:
    """A tiny scenario's YAML; ``faults`` and ``execution`` (flow mappings or lists) are added only
    when given, so a test may still append its own."""
    d = dict(name="t", seed=0, preset="tiny-hybrid", bs=16, blocks=256, caching="true", mode="align", budget=128,
             seqs=8, max_len=1024, spec=0, acc="{kind: none}", n=8, per_step=2, pmin=20, pmax=200, omin=4, omax=30,
             prefix=48, frac=0.5)
    d.update(kw)
    extra = "".join(f"{key}: {v}\n" for key, v in (("faults", faults), ("execution", execution)) if v is not None)
    return TINY.format(**d) + extra


def pytest_runtest_setup(item):
    """Triton's interpreter (the CPU tests' kernels) computes an int32 overflow check around every
    integer add, sub and mul, then hands it to ``device_assert``, which drops it unless the options
    say ``debug`` (never, in the interpreter): half of a kernel's interpreted time, thrown away.
    Once a test module has set TRITON_INTERPRET (Triton must not be imported before that, or its
    own library functions stay compiled-only), the interpreter's options skip that work; with
    ``debug`` on the checks would be kept, so they are left alone."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "interpreter_builder", None)
    opts = getattr(builder, "options", None)
    if opts is not None and getattr(opts, "sanitize_overflow", False) and not getattr(opts, "debug", True):
        builder.options = dataclasses.replace(opts, sanitize_overflow=False)
    _patch_lang_once_a_launch(interpreter)
    _np_dtypes_once(interpreter)


def _np_dtypes_once(interpreter) -> None:
    """The interpreter finds a Triton type's numpy dtype through a table it builds again at every
    call (about three calls an operation: 5% of an interpreted Mamba scan): kept, one lookup a
    type (a block's is its elements'). Types that cannot be keys go to Triton's function."""
    find = getattr(interpreter, "_get_np_dtype", None)
    if find is None or getattr(find, "kept", False):
        return
    import triton.language as tl

    kept: dict = {}

    def np_dtype(tt_dtype):
        key = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return kept[key]
        except KeyError:
            kept[key] = found = find(key)
            return found
        except TypeError:
            return find(tt_dtype)

    np_dtype.kept = True
    interpreter._get_np_dtype = np_dtype


def _patch_lang_once_a_launch(interpreter) -> None:
    """The interpreter swaps ``triton.language``'s builtins for its own at a launch's start (and
    puts them back at its end), then does it again at every call of a ``@triton.jit`` helper
    inside the launch: a walk over every member of ``tl``, ``tl.tensor`` and ``tl.math`` that
    finds them swapped already, a third of a kernel's interpreted time (the dense attention
    kernels call six helpers a key block). Within a launch a helper whose language modules are
    swapped already skips that walk; a helper seeing a module the launch did not swap (Triton's
    own ``tl.core`` helpers) swaps it as before, once a launch. Where Triton's internals differ,
    nothing is changed."""
    executor = getattr(interpreter, "GridExecutor", None)
    patch, scope_cls = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "_LangPatchScope", None)
    if getattr(patch, "once_a_launch", False) or executor is None or patch is None or scope_cls is None:
        return
    import inspect

    import triton.language as tl

    launch: dict = {"swapped": None, "starting": False}  # the modules swapped in the running launch
    seen: dict = {}

    def langs(fn) -> frozenset:
        if fn not in seen:
            seen[fn] = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[fn]

    def patch_lang(fn):
        swapped = launch["swapped"]
        mods = langs(fn)
        if swapped is not None and mods <= swapped:
            return scope_cls()  # (a helper's swaps are never put back: nothing to restore)
        scope = patch(fn)
        if launch["starting"]:
            launch["starting"], launch["swapped"] = False, mods
        elif swapped is not None:
            launch["swapped"] = swapped | mods
        return scope

    run = executor.__call__

    def call(self, *args, **kwargs):
        launch["swapped"], launch["starting"] = None, True
        try:
            return run(self, *args, **kwargs)
        finally:
            launch["swapped"], launch["starting"] = None, False

    patch_lang.once_a_launch = True
    interpreter._patch_lang = patch_lang
    executor.__call__ = call
