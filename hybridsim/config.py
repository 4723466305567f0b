"""Scenario files: schema, YAML loading, validation with file:line context.

The keys here are a contract (SPEC §4): keys may be added, never renamed or
dropped. Every error names the key path and the YAML line it came from.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from .errors import InputError, read_text
from .model import AttentionGeometry, MambaGeometry, MLAGeometry, ModelGeometry
from .presets import PRESETS, build_preset


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ----------------------------------------------------------------------------- model


class LayoutGroupSection(_Strict):
    """One KV-cache group as a recording lists it (``model.kv_cache_groups``)."""

    kind: Literal["mamba", "attention", "mla"]
    layers: int = Field(..., ge=0, description="the target model's layers in the group")
    draft_layers: int = Field(0, ge=0, description="the drafter's (MTP / EAGLE) layers in the group")

    @model_validator(mode="after")
    def _not_empty(self) -> "LayoutGroupSection":
        if self.layers + self.draft_layers == 0:
            raise ValueError("a group holds at least one layer")
        return self


class ModelSection(_Strict):
    """A preset, explicit geometry, or a preset with some sections overridden."""

    preset: Optional[str] = Field(None, description="name from `hybridsim presets`")
    mamba: Optional[dict[str, Any]] = Field(None, description="Mamba geometry (or overrides of the preset's)")
    attention: Optional[dict[str, Any]] = Field(None, description="GQA attention geometry (or overrides)")
    mla: Optional[dict[str, Any]] = Field(None, description="MLA geometry (or overrides)")
    layer_pattern: Optional[str] = Field(
        None, min_length=1, description="the target's layers in model order, one letter each: M Mamba, A attention, "
                                        "L MLA (the engine groups layers in this order); default Mamba, attention, MLA")
    kv_cache_groups: Optional[list[LayoutGroupSection]] = Field(
        None, min_length=1, description="the KV-cache groups as given (a recording's layout) instead of formed "
                                        "by the engine's rules (sched/groups.py)")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """Leave the layout keys out when unset: dumps of scenarios that do not use them stay
        byte for byte what they were."""
        d = handler(self)
        for key in ("layer_pattern", "kv_cache_groups"):
            if d.get(key, 0) is None:
                del d[key]
        return d

    @model_validator(mode="after")
    def _known_preset(self) -> "ModelSection":
        if self.preset is not None and self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; known: {', '.join(PRESETS)}")
        if self.preset is None and not (self.mamba or self.attention or self.mla):
            raise ValueError("give a preset or at least one of mamba, attention, mla")
        return self

    def geometry(self) -> ModelGeometry:
        base: dict[str, Any] = {}
        name, source = "custom", "user-defined"
        if self.preset is not None:
            g = build_preset(self.preset)
            name, source = g.name, g.source
            base = {k: (getattr(g, k).model_dump() if getattr(g, k) else None)
                    for k in ("mamba", "attention", "mla")}
        merged = {}
        for key, cls in (("mamba", MambaGeometry), ("attention", AttentionGeometry), ("mla", MLAGeometry)):
            override = getattr(self, key)
            section = dict(base.get(key) or {})
            if override is not None:
                section.update(override)
                if self.preset is not None:
                    name = f"{self.preset}+overrides"
            try:
                merged[key] = cls(**section) if section else None
            except ValidationError as e:  # (named where it is: model.<section>.<key>)
                err = e.errors()[0]
                msg = err["msg"][len("Value error, "):] if err["msg"].startswith("Value error, ") else err["msg"]
                raise _CrossFieldError(("model", key, *err["loc"]), msg) from None
        return ModelGeometry(name=name, source=source, **merged)


# ----------------------------------------------------------------------------- cache / scheduler


MAX_PROMPT_TOKENS = 1 << 27  # a synthetic workload's prompts at most (about 5 GB as Python token lists)
MAX_BLOCKS = 1 << 24  # a pool past any one engine's (268M tokens at block 16); bigger ones would not fit in memory


class CacheSection(_Strict):
    block_size: int = Field(16, ge=1, description="tokens per block (attention and, in align/all, Mamba)")
    num_blocks: int = Field(..., ge=2, le=MAX_BLOCKS, description="blocks in the shared pool, including the null "
                            "block 0; at most 2**24 (268M tokens at block 16; the planner keeps a ref count and a "
                            "prefix key per block)")
    enable_prefix_caching: bool = True
    mamba_cache_mode: Optional[Literal["none", "align", "all"]] = Field(
        None, description="none | align | all; default align with prefix caching, else none")
    prefix_match_unit: Optional[int] = Field(
        None, ge=1, description="tokens per prefix hash (vLLM's prefix_match_unit): below block_size, prefix hits "
                                "may end inside a block (align-mode Mamba only); default block_size")
    page_size_bytes: Optional[int] = Field(
        None, ge=1, description="modelled bytes per Mamba state page (engines pad pages to one unified "
                                "size, often MBs); default: the natural state size")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """Leave ``prefix_match_unit`` out when unset: scenario dumps (trace headers, sweep
        cells) of scenarios that do not use it stay byte for byte what they were."""
        d = handler(self)
        if d.get("prefix_match_unit", 0) is None:
            del d["prefix_match_unit"]
        return d

    def resolved_mode(self) -> str:
        if self.mamba_cache_mode is not None:
            return self.mamba_cache_mode
        return "align" if self.enable_prefix_caching else "none"


class SchedulerSection(_Strict):
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_num_seqs: int = Field(8, ge=1)
    max_model_len: int = Field(4096, ge=2)
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = Field(0, ge=0)
    policy: Literal["fcfs", "priority"] = "fcfs"


# ----------------------------------------------------------------------------- spec decode


class BernoulliAcceptance(_Strict):
    kind: Literal["bernoulli"]
    rate: float = Field(..., ge=0.0, le=1.0, description="chance each draft matches, given the previous did")


class PatternAcceptance(_Strict):
    kind: Literal["pattern"]
    accepted: list[Annotated[int, Field(ge=0)]] = Field(..., min_length=1,
                                                         description="accepted drafts per decode step, cycled")


class NoAcceptance(_Strict):
    kind: Literal["none"]


Acceptance = Annotated[Union[BernoulliAcceptance, PatternAcceptance, NoAcceptance], Field(discriminator="kind")]


class SpecDecodeSection(_Strict):
    num_speculative_tokens: int = Field(0, ge=0)
    acceptance: Acceptance = Field(default_factory=lambda: NoAcceptance(kind="none"))
    # the drafter: ngram (no model, no KV cache of its own) or a draft model whose attention
    # layers take blocks from the same pool as a KV-cache group of their own (MTP: layers built
    # like the target's attention; EAGLE: a separate head)
    method: Literal["ngram", "mtp", "eagle"] = "ngram"
    num_draft_layers: Optional[int] = Field(None, ge=1, description="the drafter's attention layers (mtp, eagle)")

    @model_validator(mode="after")
    def _pattern_fits(self) -> "SpecDecodeSection":
        if isinstance(self.acceptance, PatternAcceptance):
            too_big = [a for a in self.acceptance.accepted if a > self.num_speculative_tokens]
            if too_big:
                raise ValueError(f"acceptance.accepted has {too_big[0]}, more than "
                                 f"num_speculative_tokens ({self.num_speculative_tokens})")
        if self.method == "ngram" and self.num_draft_layers is not None:
            raise ValueError("num_draft_layers is for a draft model (method mtp or eagle); "
                             "the ngram drafter has no layers")
        if self.method != "ngram" and self.num_speculative_tokens == 0:
            raise ValueError(f"method {self.method} drafts tokens: num_speculative_tokens must be at least 1")
        return self

    @property
    def draft_layers(self) -> int:
        """The draft model's attention layers (0: ngram, no KV-cache group of its own)."""
        return 0 if self.method == "ngram" else (self.num_draft_layers or 1)

    @property
    def lookahead_slots(self) -> int:
        """KV slots past the scheduled tokens the draft model writes (vLLM 0.33's
        ``num_lookahead_tokens``: one per draft for MTP and EAGLE, none for ngram)."""
        return self.num_speculative_tokens if self.method != "ngram" else 0

    @property
    def prefill_lookahead(self) -> int:
        """Prompt tokens past a chunk the drafter reads (``num_prefill_lookahead_tokens``): one
        for EAGLE and one-module MTP, one per draft for MTP with several modules."""
        if self.method == "ngram":
            return 0
        if self.method == "mtp" and min(self.draft_layers, self.num_speculative_tokens) > 1:
            return self.num_speculative_tokens
        return 1


# ----------------------------------------------------------------------------- workload


class UniformDist(_Strict):
    dist: Literal["uniform"]
    min: int = Field(..., ge=1)
    max: int = Field(..., ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> "UniformDist":
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) is larger than max ({self.max})")
        return self

    @property
    def upper(self) -> int:
        return self.max


class FixedDist(_Strict):
    dist: Literal["fixed"]
    value: int = Field(..., ge=1)

    @property
    def upper(self) -> int:
        return self.value


class ChoiceDist(_Strict):
    dist: Literal["choice"]
    values: list[Annotated[int, Field(ge=1)]] = Field(..., min_length=1)

    @property
    def upper(self) -> int:
        return max(self.values)


LengthDist = Annotated[Union[UniformDist, FixedDist, ChoiceDist], Field(discriminator="dist")]


class PoissonArrival(_Strict):
    kind: Literal["poisson"]
    rate_per_step: float = Field(..., gt=0)


class FixedArrival(_Strict):
    kind: Literal["fixed"]
    per_step: int = Field(..., ge=1, description="requests arriving at each step")


class StepsArrival(_Strict):
    kind: Literal["steps"]
    steps: list[Annotated[int, Field(ge=0)]] = Field(..., min_length=1, description="arrival step per request")


class TimestampArrival(_Strict):
    kind: Literal["timestamps"]
    step_seconds: float = Field(0.05, gt=0, description="seconds of trace time one step stands for")


Arrival = Annotated[Union[PoissonArrival, FixedArrival, StepsArrival, TimestampArrival],
                    Field(discriminator="kind")]


class SharedPrefix(_Strict):
    """Requests drawn with ``fraction`` start with a common prefix; a prompt shorter than
    the prefix shares all of it but its last token."""

    len: int = Field(..., ge=1)
    fraction: float = Field(..., ge=0.0, le=1.0)
    count: int = Field(1, ge=1, description="distinct prefixes, assigned round-robin")


class SyntheticWorkload(_Strict):
    kind: Literal["synthetic"]
    num_requests: int = Field(..., ge=1)
    arrival: Arrival = Field(default_factory=lambda: FixedArrival(kind="fixed", per_step=1))
    prompt_len: LengthDist
    output_len: LengthDist
    shared_prefix: Optional[SharedPrefix] = None
    vocab_size: int = Field(32000, ge=16)
    priorities: int = Field(1, ge=1, description="priority levels drawn uniformly (policy: priority)")

    @model_validator(mode="after")
    def _steps_match(self) -> "SyntheticWorkload":
        if isinstance(self.arrival, TimestampArrival):
            raise ValueError("arrival kind 'timestamps' needs a trace workload")
        if isinstance(self.arrival, StepsArrival) and len(self.arrival.steps) != self.num_requests:
            raise ValueError(f"arrival.steps has {len(self.arrival.steps)} entries for "
                             f"{self.num_requests} requests")
        return self


class TraceWorkload(_Strict):
    kind: Literal["trace"]
    format: Literal["mooncake", "azure", "burstgpt", "vidur", "llmservingsim", "hybridsim", "vllm-recorded"]
    path: str
    limit: Optional[int] = Field(None, ge=1, description="first N requests")
    length_scale: float = Field(1.0, gt=0, description="multiplies prompt and output lengths")
    time_scale: float = Field(1.0, gt=0, description="multiplies inter-arrival times")
    hash_block_size: int = Field(512, ge=1, description="mooncake: tokens per hash id before scaling")
    arrival: Arrival = Field(default_factory=lambda: TimestampArrival(kind="timestamps"))
    vocab_size: int = Field(32000, ge=16)


Workload = Annotated[Union[SyntheticWorkload, TraceWorkload], Field(discriminator="kind")]


# ----------------------------------------------------------------------------- faults / execution


class ResetPrefixCacheFault(_Strict):
    at_step: int = Field(..., ge=0)
    kind: Literal["reset_prefix_cache"]


class PreemptFault(_Strict):
    at_step: int = Field(..., ge=0)
    kind: Literal["preempt"]
    requests: list[str] = Field(..., min_length=1)


Fault = Annotated[Union[ResetPrefixCacheFault, PreemptFault], Field(discriminator="kind")]


class ExecutionSection(_Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    kernels: str = Field("auto", description="auto | reference | triton | vllm, or a plugin's provider "
                         "(`hybridsim kernels` lists them)")
    check: Literal["full", "sampled", "off"] = "full"
    scheduler: Literal["hybridsim", "vllm"] = Field(
        "hybridsim", description="whose scheduler plans the steps: hybridsim's, or the installed vLLM's own V1 "
        "scheduler driven live (README: Running the engine's own scheduler)")
    max_steps: int = Field(5000, ge=1)
    mla_workspace_tokens: int = Field(
        256, ge=1, le=1 << 20, description="tokens of cached context the MLA prefill path up-projects at once "
        "(rounded down to whole blocks; vLLM sizes its workspace at 8 x max_model_len up to 128k tokens; small "
        "values exercise the chunked log-sum-exp merge)")

    @field_validator("kernels")
    @classmethod
    def _known_provider(cls, v: str) -> str:
        from .kernel_registry import provider_names

        names = ("auto", *provider_names())
        if v not in names:
            raise ValueError(f"no kernel provider {v!r}; this environment has: {', '.join(names)}")
        return v

    @field_validator("check", mode="before")
    @classmethod
    def _yaml_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare `off` as false
        return "off" if v is False else v

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """Leave ``scheduler`` out at its default: scenario dumps (trace headers, sweep cells) of
        scenarios that do not set it stay byte for byte what they were."""
        d = handler(self)
        if d.get("scheduler") == "hybridsim":
            del d["scheduler"]
        return d


# ----------------------------------------------------------------------------- scenario


class Scenario(_Strict):
    name: str = Field(..., min_length=1)
    seed: int = 0
    model: ModelSection
    cache: CacheSection
    scheduler: SchedulerSection = Field(default_factory=SchedulerSection)
    spec_decode: SpecDecodeSection = Field(default_factory=SpecDecodeSection)
    workload: Workload
    faults: list[Fault] = Field(default_factory=list)
    execution: ExecutionSection = Field(default_factory=ExecutionSection)

    @model_validator(mode="after")
    def _cross_field(self) -> "Scenario":
        for path, msg in cross_field_problems(self):
            raise _CrossFieldError(path, msg)
        return self

    def geometry(self) -> ModelGeometry:
        return self.model.geometry()

    def cannot_execute(self) -> Optional[str]:
        """Why this scenario can be planned but not executed (checks on), or None."""
        if (self.cache.resolved_mode() == "all" and self.spec_decode.num_speculative_tokens > 0
                and self.geometry().mamba is not None):
            return ("executing mamba_cache_mode all with speculative decoding is not supported yet "
                    "(plan it with --check off)")
        return None


class _CrossFieldError(ValueError):
    def __init__(self, path: tuple, msg: str):
        super().__init__(msg)
        self.path = path


VLLM_NO_MODE_ALL = ("all: vLLM 0.33's scheduler (execution.scheduler: vllm) has no such mode (its config accepts "
                    "align and none); plan it with hybridsim's scheduler")


def peak_tokens(s: "Scenario", prompt: int, output: int) -> int:
    """The most tokens a request's blocks cover at once (computed plus scheduled, drafts
    included): it holds at most ``prompt + output - 1`` tokens while it runs, drafts ``S`` more,
    and the scheduler never lets it pass ``max_model_len - 1``. Admission's room for a resumed
    request's whole sequence counts no more than that."""
    return min(s.scheduler.max_model_len - 1, prompt + output - 1 + s.spec_decode.num_speculative_tokens)


def min_blocks_per_request(s: "Scenario", tokens: int) -> int:
    """Blocks one request of ``tokens`` tokens needs at its peak, all groups together."""
    from .sched.groups import scenario_groups  # local: sched depends on config, not the reverse at import

    groups = scenario_groups(s)
    return sum(g.peak_blocks(tokens, s.scheduler.max_model_len) for g in groups)


def blocks_problem(s: "Scenario", tokens: int) -> str | None:
    """Why the pool cannot hold one request of ``tokens`` tokens (None if it can)."""
    need = min_blocks_per_request(s, tokens)
    if need <= s.cache.num_blocks - 1:
        return None
    return (f"the longest request needs {need} blocks over all KV groups at its peak ({tokens} tokens in "
            f"the cache, {s.spec_decode.num_speculative_tokens} draft tokens included) but the pool has "
            f"{s.cache.num_blocks - 1} usable (block 0 is the null block)")


def cross_field_problems(s: Scenario) -> list[tuple[tuple, str]]:
    """Rules spanning several keys; each problem is (key path, message)."""
    out: list[tuple[tuple, str]] = []
    geo = s.geometry()
    from .sched.groups import layout_problem  # local: sched depends on config

    layout = layout_problem(s)
    if layout is not None:
        return [layout]  # (the rules below size the pool from the layout)
    mode = s.cache.resolved_mode()
    bs = s.cache.block_size
    S = s.spec_decode.num_speculative_tokens
    sched = s.scheduler
    if sched.long_prefill_token_threshold > sched.max_model_len:
        out.append((("scheduler", "long_prefill_token_threshold"),
                    f"{sched.long_prefill_token_threshold} is more than max_model_len ({sched.max_model_len}); "
                    "the engine refuses that"))
    unit = s.cache.prefix_match_unit
    if unit is not None and unit != bs:
        if bs % unit:
            out.append((("cache", "prefix_match_unit"),
                        f"{unit} does not divide block_size ({bs}); prefix hashes cover whole units of a block"))
        elif geo.mamba is None or geo.attention is None and geo.mla is None or mode != "align" \
                or not s.cache.enable_prefix_caching:
            out.append((("cache", "prefix_match_unit"),
                        f"{unit} is below block_size ({bs}): partial-block prefix hits need a hybrid model with "
                        "mamba_cache_mode align and prefix caching on (leave it out otherwise)"))
    if geo.mamba is not None:
        if s.cache.mamba_cache_mode in ("align", "all") and not s.cache.enable_prefix_caching:
            out.append((("cache", "mamba_cache_mode"),
                        f"mamba_cache_mode {mode!r} caches states for prefix hits; it needs "
                        "enable_prefix_caching: true (or use none)"))
        if mode == "align" and not sched.enable_chunked_prefill:
            out.append((("scheduler", "enable_chunked_prefill"),
                        "mamba_cache_mode align needs chunked prefill (chunks end on block boundaries)"))
        if mode == "align" and sched.max_num_batched_tokens < bs:
            out.append((("scheduler", "max_num_batched_tokens"),
                        f"align mode rounds prefill chunks down to whole blocks: a budget of "
                        f"{sched.max_num_batched_tokens} tokens is less than one block ({bs})"))
        if mode == "all" and bs % geo.mamba.chunk_size != 0:
            out.append((("cache", "block_size"),
                        f"mamba_cache_mode all writes a state every block: block_size ({bs}) must be a "
                        f"multiple of model.mamba.chunk_size ({geo.mamba.chunk_size})"))
    if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < sched.max_model_len:
        out.append((("scheduler", "max_num_batched_tokens"),
                    f"without chunked prefill a whole prompt must fit the budget: "
                    f"max_num_batched_tokens ({sched.max_num_batched_tokens}) < max_model_len "
                    f"({sched.max_model_len})"))
    if S > 0 and S + 1 > sched.max_num_batched_tokens:
        out.append((("spec_decode", "num_speculative_tokens"),
                    f"{S} drafts plus the bonus token exceed max_num_batched_tokens "
                    f"({sched.max_num_batched_tokens})"))
    if S > 0 and S >= sched.max_model_len:
        out.append((("spec_decode", "num_speculative_tokens"), "more drafts than max_model_len allows"))
    if s.cache.enable_prefix_caching and s.spec_decode.prefill_lookahead > bs:
        out.append((("spec_decode", "num_speculative_tokens"),
                    f"MTP with {s.spec_decode.draft_layers} modules reads {S} prompt tokens past a chunk; with "
                    f"prefix caching the engine needs block_size ({bs}) at least that"))
    wl = s.workload
    if isinstance(wl, SyntheticWorkload):
        if wl.shared_prefix is not None and wl.shared_prefix.len >= sched.max_model_len:
            out.append((("workload", "shared_prefix", "len"),
                        f"a {wl.shared_prefix.len}-token prefix does not fit max_model_len ({sched.max_model_len})"))
        if wl.prompt_len.upper >= sched.max_model_len:
            out.append((("workload", "prompt_len"),
                        f"prompts up to {wl.prompt_len.upper} tokens do not fit max_model_len "
                        f"({sched.max_model_len}); the engine needs room for one output token"))
    if isinstance(wl, SyntheticWorkload) and wl.num_requests * wl.prompt_len.upper > MAX_PROMPT_TOKENS:
        out.append((("workload", "num_requests"),
                    f"{wl.num_requests:,} requests of up to {wl.prompt_len.upper:,} prompt tokens may add up to "
                    f"more than {MAX_PROMPT_TOKENS:,} tokens, which the workload builder cannot hold in memory"))
    if isinstance(wl, SyntheticWorkload):
        problem = blocks_problem(s, peak_tokens(s, wl.prompt_len.upper, wl.output_len.upper))
        if problem:
            out.append((("cache", "num_blocks"), problem))
    if sched.policy == "priority" and isinstance(wl, TraceWorkload):
        pass  # trace requests get priority 0; allowed
    if s.execution.scheduler == "vllm" and geo.mamba is not None and mode == "all":
        out.append((("cache", "mamba_cache_mode"), VLLM_NO_MODE_ALL))
    for i, f in enumerate(s.faults):
        if f.at_step >= s.execution.max_steps:
            out.append((("faults", i, "at_step"),
                        f"step {f.at_step} is past execution.max_steps ({s.execution.max_steps})"))
    return out


# ----------------------------------------------------------------------------- loading


class _LineMap:
    """Line numbers (1-based) of every key path in a YAML document."""

    def __init__(self, text: str, source: str):
        self.source = source
        self.lines: dict[tuple, int] = {}
        from .safe_load import compose_yaml

        node = compose_yaml(text, source)  # (hostile documents refused: safe_load)
        if node is not None:
            self._walk(node, ())

    def _walk(self, node: yaml.Node, path: tuple) -> None:
        self.lines[path] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            seen: set = set()
            for k, v in node.value:
                key = k.value
                if key in seen:
                    raise InputError(f"key {'.'.join(map(str, path + (key,)))!r} appears twice",
                                     f"{self.source}:{k.start_mark.line + 1}")
                seen.add(key)
                self.lines[path + (key,)] = k.start_mark.line + 1
                self._walk(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self._walk(v, path + (i,))

    def where(self, path: tuple) -> str:
        p = tuple(path)
        while p and p not in self.lines:
            p = p[:-1]
        line = self.lines.get(p)
        return f"{self.source}:{line}" if line else self.source


def _data_path(raw: Any, loc: tuple) -> tuple:
    """Drop pydantic's union tags from an error location, keeping real keys."""
    out: list = []
    cur = raw
    for part in loc:
        if isinstance(cur, dict) and part in cur:
            out.append(part)
            cur = cur[part]
        elif isinstance(cur, list) and isinstance(part, int) and part < len(cur):
            out.append(part)
            cur = cur[part]
        elif isinstance(cur, dict) and isinstance(part, str) and part not in cur and not out[-1:] == [part]:
            # either a union tag (skip) or a missing/unknown key (keep, the message says which)
            if part in _UNION_TAGS:
                continue
            out.append(part)
            cur = None
        else:
            continue
    return tuple(out)


_UNION_TAGS = {"synthetic", "trace", "bernoulli", "pattern", "none", "uniform", "fixed", "choice",
               "poisson", "steps", "timestamps", "reset_prefix_cache", "preempt"}


def _format_pydantic(e: ValidationError, raw: Any, lines: _LineMap) -> InputError:
    errors = e.errors()
    # a misspelt key is both unknown and (its right spelling) missing: name the misspelling
    err = next((x for x in errors if x["type"] == "extra_forbidden"), errors[0])
    path = _data_path(raw, tuple(err["loc"]))
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    ctx_err = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_err, _CrossFieldError):
        path = ctx_err.path
        msg = str(ctx_err)
    told = 1  # problems this message tells of
    if err["type"] == "extra_forbidden":
        msg = "unknown key (not part of the scenario schema; check spelling)"
        parent = tuple(err["loc"][:-1])
        missing = [str(x["loc"][-1]) for x in errors
                   if x["type"] == "missing" and tuple(x["loc"][:-1]) == parent]
        close = difflib.get_close_matches(str(err["loc"][-1]), missing, n=1)
        if close:
            msg = f"unknown key (did you mean {close[0]}? it is missing)"
            told = 2
        elif missing:  # not a near spelling, but the key it stands for is likely among these
            msg = f"unknown key (not part of the scenario schema; missing here: {', '.join(missing)})"
            told = 1 + len(missing)
    elif err["type"] == "missing":
        msg = "required key is missing"
    elif err["type"] == "union_tag_invalid":
        msg = msg.replace("Input tag", "value")
    key = ".".join(str(p) for p in path) or "(top level)"
    more = f" (and {len(errors) - told} more problem(s))" if len(errors) > told else ""
    return InputError(f"{key}: {msg}{more}", lines.where(path))


def parse_scenario(text: str, source: str = "<scenario>", base_dir: Path | None = None) -> "LoadedScenario":
    from .safe_load import load_yaml

    lines = _LineMap(text, source)
    raw = load_yaml(text, source)
    if not isinstance(raw, dict):
        raise InputError("a scenario is a YAML mapping (name, model, cache, workload, ...)", source)
    try:
        scenario = Scenario.model_validate(raw)
    except ValidationError as e:
        raise _format_pydantic(e, raw, lines) from None
    except _CrossFieldError as e:  # pragma: no cover - pydantic wraps these
        raise InputError(f"{'.'.join(map(str, e.path))}: {e}", lines.where(e.path)) from None
    return LoadedScenario(scenario=scenario, base_dir=base_dir or Path("."), source=source, lines=lines)


def load_scenario(path: str | Path) -> "LoadedScenario":
    p = Path(path)
    if not p.exists():
        raise InputError("no such file", str(p))
    if p.is_dir():
        raise InputError("is a folder, not a scenario file", str(p))
    return parse_scenario(read_text(p), str(p), p.parent)


class LoadedScenario:
    """A validated scenario plus where it came from (for relative paths and messages)."""

    def __init__(self, scenario: Scenario, base_dir: Path, source: str, lines: _LineMap):
        self.scenario = scenario
        self.base_dir = base_dir
        self.source = source
        self.lines = lines

    def where(self, *path: Any) -> str:
        return self.lines.where(tuple(path))

    def resolve_path(self, p: str) -> Path:
        q = Path(p)
        return q if q.is_absolute() else (self.base_dir / q)


__all__ = ["Scenario", "LoadedScenario", "load_scenario", "parse_scenario"]
