"""Named model geometries.

``tiny-*`` presets are small enough to execute every step on a CPU in seconds.
The real presets copy published configuration values; ``source`` says where
each came from, and ``note`` says what is uncertain.
"""

from __future__ import annotations

from typing import Any

from .model import ModelGeometry

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-hybrid": {
        "source": "hybridsim tiny test model (Mamba2-style probe + GQA attention)",
        "mamba": dict(layers=2, heads=4, head_dim=16, d_state=16, n_groups=1, conv_kernel=4,
                      chunk_size=16, state_dtype="float32", conv_dtype="float32"),
        "attention": dict(layers=1, heads=4, kv_heads=2, head_dim=16, dtype="float32"),
    },
    "tiny-mla": {
        "source": "hybridsim tiny test model (MLA only)",
        "mla": dict(layers=2, heads=8, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                    v_head_dim=32, q_lora_rank=None, dtype="float32"),
    },
    "tiny-hybrid-mla": {
        "source": "hybridsim tiny test model (Mamba2-style probe + MLA)",
        "mamba": dict(layers=2, heads=4, head_dim=16, d_state=16, n_groups=1, conv_kernel=4,
                      chunk_size=16, state_dtype="float32", conv_dtype="float32"),
        "mla": dict(layers=1, heads=8, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
                    v_head_dim=32, q_lora_rank=None, dtype="float32"),
    },
    "nemotron-h-8b": {
        "source": "HF nvidia/Nemotron-H-8B-Base-8K config.json (hybrid_override_pattern: 24 M, 4 *, "
                  "mamba_num_heads 128, mamba_head_dim 64, ssm_state_size 128, n_groups 8, conv_kernel 4, "
                  "chunk_size 128; 32 heads, 8 kv heads, head_dim 128); SSM cache float32 as vLLM's default",
        "mamba": dict(layers=24, heads=128, head_dim=64, d_state=128, n_groups=8, conv_kernel=4,
                      chunk_size=128, state_dtype="float32", conv_dtype="bfloat16"),
        "attention": dict(layers=4, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16"),
    },
    "jamba-1.5-mini": {
        "source": "HF ai21labs/AI21-Jamba-1.5-Mini config.json (32 layers, attention period 8 offset 4, "
                  "mamba_expand 2 x hidden 4096 = 8192, mamba_d_state 16, mamba_d_conv 4; 32 heads, 8 kv heads)",
        "note": "Mamba1: the probe treats heads x head_dim = 8192 as the intermediate size",
        "mamba": dict(kind="mamba1", layers=28, heads=128, head_dim=64, d_state=16, n_groups=1,
                      conv_kernel=4, chunk_size=256, state_dtype="float32", conv_dtype="bfloat16"),
        "attention": dict(layers=4, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16"),
    },
    "granite-4.0-h-small": {
        "source": "HF ibm-granite/granite-4.0-h-small config.json (40 layers, 36 mamba / 4 attention, "
                  "mamba_n_heads 128, mamba_d_head 64, mamba_d_state 128, mamba_n_groups 1, conv 4, chunk 256)",
        "note": "kv heads 8 taken from the config as mirrored in third-party tests; verify against the HF file",
        "mamba": dict(layers=36, heads=128, head_dim=64, d_state=128, n_groups=1, conv_kernel=4,
                      chunk_size=256, state_dtype="float32", conv_dtype="bfloat16"),
        "attention": dict(layers=4, heads=32, kv_heads=8, head_dim=128, dtype="bfloat16"),
    },
    "qwen3-next-80b": {
        "source": "HF Qwen/Qwen3-Next-80B-A3B-Instruct config.json (48 layers, full attention every 4th; "
                  "linear_num_key_heads 16, linear_num_value_heads 32, key/value head dim 128, conv 4; "
                  "16 attention heads, 2 kv heads, head_dim 256)",
        "note": "gated delta net: heads/head_dim are value heads/dim, n_groups/d_state are key heads/dim",
        "mamba": dict(kind="gdn", layers=36, heads=32, head_dim=128, d_state=128, n_groups=16,
                      conv_kernel=4, chunk_size=64, state_dtype="float32", conv_dtype="bfloat16"),
        "attention": dict(layers=12, heads=16, kv_heads=2, head_dim=256, dtype="bfloat16"),
    },
    "deepseek-v3": {
        "source": "HF deepseek-ai/DeepSeek-V3 config.json (61 layers, 128 heads, q_lora_rank 1536, "
                  "kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128, v_head_dim 128); "
                  "softmax scale with YaRN mscale (factor 40): 0.1352338",
        "mla": dict(layers=61, heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                    v_head_dim=128, q_lora_rank=1536, dtype="bfloat16", softmax_scale=0.1352338),
    },
}


def preset_names() -> list[str]:
    return list(PRESETS)


def preset_fields(name: str) -> dict[str, Any]:
    """The raw fields of a preset (geometry dicts plus source/note)."""
    return PRESETS[name]


def build_preset(name: str) -> ModelGeometry:
    spec = PRESETS[name]
    return ModelGeometry(
        name=name,
        source=spec["source"],
        mamba=spec.get("mamba"),
        attention=spec.get("attention"),
        mla=spec.get("mla"),
    )
