"""A kernel module's source with some of its text replaced, compiled as a module of its own: what the probes
that time a kernel with a part changed or left out load (Triton reads a kernel's source from its file, so the
copy is written to one). Not product code: a probe's variants are measurements, never shipped."""
from __future__ import annotations

import importlib.util
import os
import tempfile


def module_source(mod) -> str:
    """``mod``'s source with its relative imports made absolute (the copy lives outside the package)."""
    with open(mod.__file__) as f:
        src = f.read()
    return src.replace("from ..", "from hybridsim.").replace("from .", f"from {mod.__package__}.")


def load_source(tag: str, source: str):
    """``source`` written to a file of its own and imported as module ``patched_{tag}``."""
    path = os.path.join(tempfile.gettempdir(), f"patched_{tag}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"patched_{tag}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def patched(mod, tag: str, replacements: list[tuple[str, str]]):
    """``mod`` with each (old, new) replacement made; an AssertionError names the first old text the module no
    longer has (the kernel changed: the probe's patch needs updating)."""
    src = module_source(mod)
    for old, new in replacements:
        assert old in src, f"{mod.__name__} changed: update the {tag} patch ({old[:60]!r}...)"
        src = src.replace(old, new)
    return load_source(tag, src)
