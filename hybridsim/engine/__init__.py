"""Execution: metadata, state bookkeeping, caches, and the executor."""
