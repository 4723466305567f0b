"""What the MLA probes share: DeepSeek-V3 decode inputs and loading a copy of the Gluon kernel module."""
import importlib.util

import torch

H, L, R, PAGE = 128, 512, 64, 64  # DeepSeek-V3 absorbed decode, page 64
SCALE = 0.1352338


def deepseek_inputs(B: int, ctx: int):
    """(q_lat fp32, q_pe fp32, bf16 latent cache, shuffled block table, lengths): B requests of ctx keys."""
    blocks = ctx // PAGE
    cache = torch.randn(B * blocks + 1, PAGE, L + R, dtype=torch.bfloat16, device="cuda")
    table = (torch.randperm(B * blocks, device="cuda") + 1).view(B, blocks)
    lens = torch.full((B,), ctx, device="cuda")
    return torch.randn(B, 1, H, L, device="cuda"), torch.randn(B, 1, H, R, device="cuda"), cache, table, lens


def load_module(path: str, name: str):
    """Import a Python file as a module of its own (a kernel version beside the installed one)."""
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
