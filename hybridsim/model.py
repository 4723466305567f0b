"""Model geometry: the state and cache shapes a scenario's model implies.

Only what the cache and the probe layers need is modelled: layer counts, state
shapes and dtypes. Sizes follow the formulas of research/vllm-hybrid.md §1.5/§7
(Mamba2, Mamba1, gated delta net) and research/mla.md §0 (MLA latent cache).
"""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

DType = Literal["float32", "bfloat16", "float16", "float64"]
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MambaGeometry(_Strict):
    """Recurrent layers. ``kind`` picks the state-shape formula."""

    kind: Literal["mamba2", "mamba1", "gdn"] = Field("mamba2", description="state formula: mamba2 | mamba1 | gdn")
    layers: int = Field(..., ge=1, description="number of recurrent layers")
    heads: int = Field(..., ge=1, description="SSM heads (GDN: value heads)")
    head_dim: int = Field(..., ge=1, description="per-head dim P (GDN: value dim)")
    d_state: int = Field(..., ge=1, description="state size N (GDN: key dim)")
    n_groups: int = Field(1, ge=1, description="B/C groups G (GDN: key heads)")
    conv_kernel: int = Field(4, ge=2, description="causal conv width K")
    chunk_size: int = Field(16, ge=1, description="Mamba2 scan chunk size")
    state_dtype: DType = Field("float32", description="temporal (SSM) state dtype")
    conv_dtype: DType = Field("float32", description="conv window dtype")

    @model_validator(mode="after")
    def _heads_divisible(self) -> "MambaGeometry":
        if self.kind == "mamba2" and self.heads % self.n_groups != 0:
            raise ValueError(f"heads ({self.heads}) must be a multiple of n_groups ({self.n_groups})")
        return self

    def conv_dim(self) -> int:
        if self.kind == "mamba2":
            return self.heads * self.head_dim + 2 * self.n_groups * self.d_state
        if self.kind == "gdn":
            return 2 * self.n_groups * self.d_state + self.heads * self.head_dim
        return self.heads * self.head_dim  # mamba1: intermediate size

    def conv_rows(self, num_spec: int) -> int:
        """Conv window rows: K-1 plus one per draft (not for Mamba1, as upstream)."""
        return self.conv_kernel - 1 + (0 if self.kind == "mamba1" else num_spec)

    def conv_bytes(self, num_spec: int = 0) -> int:
        return self.conv_rows(num_spec) * self.conv_dim() * DTYPE_BYTES[self.conv_dtype]

    def temporal_shape(self) -> tuple[int, ...]:
        if self.kind == "mamba1":
            return (self.heads * self.head_dim, self.d_state)
        return (self.heads, self.head_dim, self.d_state)

    def temporal_bytes(self) -> int:
        n = 1
        for d in self.temporal_shape():
            n *= d
        return n * DTYPE_BYTES[self.state_dtype]

    def state_bytes(self, num_spec: int = 0) -> int:
        """Bytes of one request's state in one layer (conv + temporal)."""
        return self.conv_bytes(num_spec) + self.temporal_bytes()


class AttentionGeometry(_Strict):
    """Standard (GQA) attention layers of a hybrid model."""

    layers: int = Field(..., ge=1)
    heads: int = Field(..., ge=1, description="query heads")
    kv_heads: int = Field(..., ge=1)
    head_dim: int = Field(..., ge=1)
    dtype: DType = "bfloat16"

    @model_validator(mode="after")
    def _grouped_heads(self) -> "AttentionGeometry":
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (RoPE rotates pairs)")
        return self

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.heads // self.kv_heads

    def scale(self) -> float:
        return self.head_dim ** -0.5

    def page_bytes(self, block_size: int) -> int:
        """One layer's page of one block: K and V of ``block_size`` tokens."""
        return block_size * self.bytes_per_token()

    def bytes_per_token(self) -> int:
        """Per layer, K and V."""
        return 2 * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


class MLAGeometry(_Strict):
    """Multi-head latent attention layers (latent cache = kv_lora_rank + rope dims)."""

    layers: int = Field(..., ge=1)
    heads: int = Field(..., ge=1)
    kv_lora_rank: int = Field(..., ge=1)
    qk_rope_head_dim: int = Field(..., ge=2)
    qk_nope_head_dim: int = Field(..., ge=1)
    v_head_dim: int = Field(..., ge=1)
    q_lora_rank: Optional[int] = Field(None, ge=1)
    dtype: DType = "float32"
    softmax_scale: Optional[float] = Field(
        None, gt=0, description="pre-absorption scale; default 1/sqrt(nope+rope)"
    )

    @model_validator(mode="after")
    def _rope_even(self) -> "MLAGeometry":
        if self.qk_rope_head_dim % 2:
            raise ValueError("qk_rope_head_dim must be even (RoPE rotates pairs)")
        return self

    def entry_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def bytes_per_token(self) -> int:
        return self.entry_dim() * DTYPE_BYTES[self.dtype]

    def scale(self) -> float:
        if self.softmax_scale is not None:
            return self.softmax_scale
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5


class ModelGeometry(_Strict):
    """A model as the cache sees it: any of Mamba, attention and MLA layers."""

    name: str = "custom"
    source: str = "user-defined"
    mamba: Optional[MambaGeometry] = None
    attention: Optional[AttentionGeometry] = None
    mla: Optional[MLAGeometry] = None

    @model_validator(mode="after")
    def _has_layers(self) -> "ModelGeometry":
        if self.mamba is None and self.attention is None and self.mla is None:
            raise ValueError("a model needs at least one of mamba, attention, mla")
        return self

    @property
    def is_hybrid(self) -> bool:
        return self.mamba is not None

    def attention_bytes_per_token(self) -> int:
        """All attention-like layers together (what one token costs in KV)."""
        total = 0
        if self.attention is not None:
            total += self.attention.layers * self.attention.bytes_per_token()
        if self.mla is not None:
            total += self.mla.layers * self.mla.bytes_per_token()
        return total

    def mamba_bytes_per_request(self, num_spec: int = 0) -> int:
        """Running state of one request over all recurrent layers."""
        if self.mamba is None:
            return 0
        return self.mamba.layers * self.mamba.state_bytes(num_spec)
