"""The MLA probe's latent entries of many tokens in one launch (``kernels/probe_latents.py``): bit for bit
``MLAStack.latents`` / ``latents_at`` (float64 and float32), for padded batches of rows and for packed
keys with their own positions, at DeepSeek-like widths and at ones that are not powers of two."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from . import kernel_env  # noqa: F401  (the interpreter where there is no GPU: first)
from hybridsim.kernels.probe_latents import latent_rows  # noqa: E402
from hybridsim.layers.mla import LATENT_SHIFT, ROPE_SHIFT, MLAProbe, MLAStack  # noqa: E402
from hybridsim.model import MLAGeometry  # noqa: E402

INTERPRETER = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter test (CPU); -m gpu runs it compiled")
DEVICES = [pytest.param("cpu", marks=INTERPRETER),
           pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs a GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("geo", [
    MLAGeometry(layers=2, heads=2, kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32),
    MLAGeometry(layers=3, heads=2, kv_lora_rank=48, qk_rope_head_dim=12, qk_nope_head_dim=16, v_head_dim=16)],
    ids=["wide", "odd-widths"])
def test_latent_rows_are_the_stacks_latents(device, geo):
    st = MLAStack([MLAProbe(geo, layer, seed=5) for layer in range(geo.layers)], device)
    g = np.random.default_rng(3)
    R = geo.qk_rope_head_dim
    tok = torch.from_numpy(g.integers(0, 10 ** 7, size=(3, 37))).to(device)  # padded rows, positions 0..36
    got = latent_rows(st.key1, st.key2, R, tok, torch.arange(37, device=device), 37, LATENT_SHIFT, ROPE_SHIFT)
    want = st.latents(tok, 37)
    assert got.shape == want.shape == (geo.layers, 3, 37, geo.kv_lora_rank + R) and got.dtype == torch.float64
    assert torch.equal(got, want) and bool(want[..., -R:].abs().max() > 0)
    flat = torch.from_numpy(g.integers(0, 10 ** 7, size=50)).to(device)  # packed keys, positions of their own
    pos = torch.from_numpy(g.integers(0, 5000, size=50)).to(device)
    got32 = latent_rows(st.key1, st.key2, R, flat, pos, 5000, LATENT_SHIFT, ROPE_SHIFT, torch.float32)
    assert got32.dtype == torch.float32 and torch.equal(got32, st.latents_at(flat, pos, 5000).to(torch.float32))


_COMPILE_FOR_HOPPER = """
import os, re, subprocess, tempfile
import triton
from triton import compile as build
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hybridsim.kernels.probe_latents import _latent_rows_kernel as k

const = dict(LR=512, R=64, T1=4093, T2=509, KV_SCALE=2.0 ** -7, ROPE_SCALE=2.0 ** -17, BT=16, BL=128, RH=32)
sig = {n: "constexpr" if n in const else "*i64" if n in ("tok", "pos") else "i32" if n in ("n_tok", "P")
       else "*fp64" for n in k.arg_names}
out = build(ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in const.items()}),
            target=GPUTarget("cuda", 90, 64), options={"num_warps": 4})
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(out.asm["cubin"])
    f.flush()
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
print(*re.search(r"REG:(\\d+) STACK:(\\d+)", usage).groups())
"""


def test_latent_rows_compile_for_hopper_at_deepseek_shapes():
    """Without a GPU: the kernel builds for sm_90 at DeepSeek-V3's widths (float64 tables and entries)
    with no local memory (nothing spilled). A process of its own: this module runs Triton's interpreter."""
    from .helpers import compile_for_hopper
    regs, stack = map(int, compile_for_hopper(_COMPILE_FOR_HOPPER).split())
    assert 0 < regs <= 255 and stack == 0
