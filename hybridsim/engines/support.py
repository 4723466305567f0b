"""Whether an engine's scheduler can plan a run here: installed, a supported version, and a
scenario it can honour. Asked before anything is built, so a refusal is one message and an
exit code (3: the environment; 2: the scenario or a flag), never a traceback half-way."""

from __future__ import annotations

from typing import Optional

from ..config import VLLM_NO_MODE_ALL, LoadedScenario
from ..errors import EnvironmentProblem, InputError

SUPPORTED_VLLM = ("0.33",)  # release series whose V1 scheduler this driver speaks to
INSTALL_HINT = ("install it beside hybridsim: bench/peer_setup.sh makes .peer-venv with vLLM 0.33 and "
                "hybridsim's dependencies (or, in this Python: pip install vllm==0.33.0)")


def require_vllm() -> str:
    """vLLM's version when a supported one is importable here; else EnvironmentProblem (exit 3)."""
    try:
        import vllm
    except ImportError:
        raise EnvironmentProblem(f"--scheduler vllm needs vLLM {SUPPORTED_VLLM[-1]} and this Python has no vllm "
                                 f"package; {INSTALL_HINT}") from None
    version = str(getattr(vllm, "__version__", "unknown"))
    if not any(version == s or version.startswith(s + ".") for s in SUPPORTED_VLLM):
        raise EnvironmentProblem(f"--scheduler vllm: vLLM {version} is installed; hybridsim drives vLLM "
                                 f"{', '.join(SUPPORTED_VLLM)} only; {INSTALL_HINT}")
    try:
        import vllm.v1.core.sched.scheduler  # noqa: F401
    except Exception as e:  # (a partial install: a dependency of its scheduler modules is missing)
        raise EnvironmentProblem(f"--scheduler vllm: vLLM {version}'s scheduler does not import here "
                                 f"({type(e).__name__}: {e}); {INSTALL_HINT}") from None
    return version


def vllm_refusals(loaded: LoadedScenario, bugs: Optional[set[str]] = None) -> None:
    """InputError (exit 2) naming the first scenario key or flag vLLM's scheduler cannot honour."""
    s = loaded.scenario
    geo = s.geometry()
    if geo.mamba is not None and s.cache.resolved_mode() == "all":
        raise InputError(f"cache.mamba_cache_mode: {VLLM_NO_MODE_ALL}", loaded.where("cache", "mamba_cache_mode"))
    S = s.spec_decode.num_speculative_tokens
    thr = s.scheduler.long_prefill_token_threshold
    align_split = geo.mamba is not None and s.cache.resolved_mode() == "align" and s.cache.enable_prefix_caching
    if S and 0 < thr < 1 + S and not align_split:
        raise InputError(f"scheduler.long_prefill_token_threshold: {thr} is below 1 + num_speculative_tokens "
                         f"({1 + S}); vLLM 0.33's scheduler then fails an assertion when it pads a one-token "
                         "admission to a draft row the threshold cuts (docs/fidelity.md, point 12); raise it, or "
                         "plan with hybridsim's scheduler", loaded.where("scheduler", "long_prefill_token_threshold"))
    if bugs:
        from ..sched.injected import SCHEDULER_BUGS

        ours = sorted(set(bugs) & set(SCHEDULER_BUGS))
        if ours:
            raise InputError(f"{ours[0]} breaks hybridsim's own scheduler, which does not plan under --scheduler "
                             "vllm (the executor's bugs still apply)", "--inject-bug")
