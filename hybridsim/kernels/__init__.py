"""The kernels and their providers (``reference``, ``triton``, ``vllm``); the registry that finds
providers by name, plugins included, is ``hybridsim.kernel_registry`` (torch-free)."""

from ..kernel_registry import OPS, get_kernels, op_sources, provider_names, providers  # noqa: F401
