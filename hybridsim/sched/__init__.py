"""Scheduler and KV cache manager (blocks, never tensors)."""
