"""Kernel variants built before a run's loop, many at once, from a list an earlier run recorded.

Why: Triton builds a kernel variant the first time a launch needs it, inside the loop and one after
another (``device/builds.py``). Where Triton's disk cache is empty (a fresh machine, a new Triton)
that is most of a first run: nemotron_h_8b_mooncake's loop took 51.4 s the first time on a fresh
H100 (62.5 s end to end) against 9-10 s with the cache warm, 17 variants compiled one by one. Which variants a run needs follows
from its configuration (geometry, cache, provider, checks), not from its workload, so a run can
list the variants it loaded (``--kernel-variants FILE``), and a later run of the same configuration
builds that list up front, many at once in worker processes, into Triton's disk cache, where the
loop's launches then find them. The package ships such lists for its real-scale scenarios
(``kernel_variants.json``).

A variant is described by what Triton keeps of a build (the compiled kernel's source record:
signature, constexprs, attributes; its options and target) and rebuilt with ``triton.compile`` from
that description: the same inputs give the same cache key, so the launch loads it. A variant that no
longer builds (its kernel changed or went since the list was made) is counted and skipped; the loop
then builds what it needs, as it does without a list.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import sys
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from time import perf_counter
from typing import Any, Iterable, Optional

from ..errors import InputError
from ..hostmem import usable_cores

FORMAT = "hybridsim kernel variants 1"
SHIPPED = Path(__file__).with_name("kernel_variants.json")
PREFIX = "hybridsim."  # only our own kernels: a worker imports a kernel's module by its name
_NOT_JSON = object()


# ----------------------------------------------------------------------------- what a run needs

def config_key(scenario: dict, kernels: str, check: str, bugs: Iterable[str] = ()) -> str:
    """What decides a run's kernel variants: the scenario's model, cache, scheduler, speculative
    decoding and faults (not its name, seed, workload or step limit), the provider, the check level
    and the injected bugs."""
    config = {k: v for k, v in scenario.items() if k not in ("name", "seed", "workload", "execution")}
    blob = json.dumps({"config": config, "kernels": kernels, "check": check, "bugs": sorted(bugs)},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def entry_key(config: str, triton_version: str, target: list) -> str:
    """A list's key in a file: the configuration, Triton's version and the card's target."""
    return f"{config} triton-{triton_version} {'-'.join(str(t) for t in target)}"


# ----------------------------------------------------------------------------- describing a variant

def _encode(value: Any) -> Any:
    """A constexpr as JSON, or _NOT_JSON where it has no faithful form (a layout object, a function)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    name = type(value).__name__
    if name == "dtype" and type(value).__module__.startswith("triton"):
        return {"dtype": str(value)}
    if name == "constexpr" and hasattr(value, "value"):
        inner = _encode(value.value)
        return _NOT_JSON if inner is _NOT_JSON else {"constexpr": inner}
    return _NOT_JSON


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "dtype" in value:
        import triton.language as tl
        return tl.dtype(value["dtype"])
    if isinstance(value, dict) and "constexpr" in value:
        import triton.language as tl
        return tl.constexpr(_decode(value["constexpr"]))
    return value


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def _option_names(target) -> tuple[str, ...]:
    """The build options a variant's metadata repeats (its other entries are results: its name, hash,
    shared memory), less ``extern_libs``: a path on the recording machine, and Triton fills in its own
    libdevice where none is given (its cache key hashes the file, not the path)."""
    import dataclasses
    from triton.compiler.compiler import make_backend

    opts = make_backend(target).parse_options({})
    return tuple(f.name for f in dataclasses.fields(opts) if f.name != "extern_libs")


def describe(kernel_name: str, compiled) -> Optional[dict]:
    """One built variant as a JSON-ready description (``kernel_name``: 'module:qualname'), or None
    where Triton kept no source record or a constexpr has no JSON form."""
    src, md = getattr(compiled, "src", None), getattr(compiled, "metadata", None)
    if src is None or md is None or not hasattr(src, "signature") or not hasattr(md, "_asdict"):
        return None
    constants = []
    for k, v in sorted(src.constants.items()):
        enc = _encode(v)
        if enc is _NOT_JSON:
            return None
        constants.append([list(k), enc])
    meta = md._asdict()
    target = meta.pop("target", None)
    if target is None:
        return None
    options = {k: meta[k] for k in _option_names(target) if k in meta and _jsonable(meta[k])}
    entry = {"kernel": kernel_name, "gluon": type(src).__name__ == "GluonASTSource",
             "signature": dict(src.signature), "constants": constants,
             "attrs": [[list(k), v] for k, v in sorted(src.attrs.items())], "options": options,
             "target": [target.backend, target.arch, target.warp_size]}
    return entry if _jsonable(entry) else None


def loaded_variants() -> list[dict]:
    """Every variant of hybridsim's kernels this process holds (built or loaded), described."""
    from .builds import held_variants

    out, seen = [], set()
    for mod_name, obj, built in held_variants((PREFIX,)):
        for compiled in built:
            d = describe(f"{mod_name}:{obj.fn.__qualname__}", compiled)
            if d is not None and (tag := json.dumps(d, sort_keys=True)) not in seen:
                seen.add(tag)
                out.append(d)
    return out


# ----------------------------------------------------------------------------- building one (a worker)

def _tuples(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def build(entry: dict) -> tuple[Optional[str], float]:
    """Build one described variant into Triton's disk cache (no GPU needed: the target is given).
    Returns None or why it could not be built, and the seconds it took (the worker's imports included)."""
    t0 = perf_counter()
    why = _build(entry)
    return why, perf_counter() - t0


def _source(entry: dict):
    """What ``triton.compile`` takes for a described variant: its source record, target and options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, _, qualname = entry["kernel"].partition(":")
    fn: Any = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    source = ASTSource
    if entry.get("gluon"):
        from triton.experimental.gluon._runtime import GluonASTSource
        source = GluonASTSource
    signature = {k: _tuples(v) for k, v in entry["signature"].items()}
    constants = {tuple(k): _decode(v) for k, v in entry["constants"]}
    attrs = {tuple(k): v for k, v in entry["attrs"]}
    options = {k: _tuples(v) for k, v in entry["options"].items()}
    return source(fn, signature, constants, attrs), GPUTarget(*entry["target"]), options


def _build(entry: dict) -> Optional[str]:
    try:
        import triton

        src, target, options = _source(entry)
        compiled = triton.compile(src, target=target, options=options)
    except Exception as e:  # (a list older than the code: the loop builds what it needs)
        return f"{entry.get('kernel', '?')}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    _build_launcher(compiled)
    return None


def in_cache(entry: dict) -> bool:
    """Whether Triton's disk cache already holds this variant (as ``triton.compile`` looks for it:
    the same key, its metadata file present). False where that cannot be told: then it is built,
    which finds it at once if it was there."""
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.compiler.compiler import make_backend
        from triton.runtime.cache import get_cache_key, get_cache_manager

        src, target, options = _source(entry)
        backend = make_backend(target)
        opts = backend.parse_options(dict(options, **src.parse_options()))
        key = get_cache_key(src, backend, opts, get_cache_invalidating_env_vars())
        name = f"{src.name[:150]}.json"
        group = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest()).get_group(name) or {}
        return group.get(name) is not None
    except Exception:
        return False


def _build_launcher(compiled) -> None:
    """The variant's host-side launcher too (C, compiled once a signature into the same cache): a
    launch builds it the first time otherwise. Best effort: it needs the CUDA driver library, and
    the loop builds it where this could not.

    The driver's helpers (``CudaUtils``) come first: a launcher module, when Python first loads it,
    keeps the type that Triton's driver module names for tensor descriptors at that moment, which is
    None until the helpers are loaded; Python never loads that module again in the process, so a
    launcher loaded first here would refuse every descriptor the run's own launches pass ("object must
    be of type PyCUtensorMap")."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
        if not driver_helpers():
            return
        CudaLauncher(compiled.src, compiled.metadata)
    except Exception:
        pass


def driver_helpers() -> bool:
    """Load Triton's CUDA driver helpers (built once a machine) if they are not loaded yet; whether
    they are. Each worker asks before it loads a launcher (``_build_launcher``); the first one loads
    them (two at once load the same module: the same types)."""
    try:
        import triton.backends.nvidia.driver as nv
        if nv.PyCUtensorMap is None:
            nv.CudaUtils()
        return nv.PyCUtensorMap is not None
    except Exception:
        return False


# ----------------------------------------------------------------------------- building many

@dataclass
class PrebuildReport:
    listed: int
    built: int
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    workers: int = 0
    source: str = ""
    slowest: list = field(default_factory=list)  # [(kernel, seconds)], longest first: what bounds ``seconds``
    cached: int = 0  # listed variants Triton's cache held already (not built again)
    kind: str = "threads"  # the workers: "threads" or "processes"

    def note(self) -> Optional[str]:
        """What the run's notes say: nothing where every listed variant was in the cache already."""
        if not self.built and not self.failed:
            return None
        workers = self.kind if self.workers != 1 else {"threads": "thread", "processes": "process"}[self.kind]
        s = (f"built {self.built:,} of {self.listed:,} kernel variants ahead of the loop in {self.seconds:.1f} s "
             f"({self.workers} {workers}"
             + (f"; {self.cached:,} {'was' if self.cached == 1 else 'were'} in Triton's cache" if self.cached else "")
             + f"; the list: {self.source})")
        if self.failed:
            s += (f"; {len(self.failed):,} could not be built (the kernels changed since the list was made; the loop "
                  f"builds what it needs): {self.failed[0]}")
        return s

    def as_dict(self) -> dict:
        return {"listed": self.listed, "built": self.built, "cached": self.cached, "failed": self.failed,
                "seconds": round(self.seconds, 3),
                "workers": self.workers, "kind": self.kind, "source": self.source,
                "slowest": [[k, round(t, 2)] for k, t in self.slowest]}


class Prebuild:
    """Variants building in worker processes (or threads) while the caller goes on; ``wait`` before the loop.

    Processes forked from the run itself where the system forks (Linux): each starts with the run's
    imports (Triton, the kernels' modules) in its memory, imports nothing again and touches no GPU (a
    description names its target). Threads share one interpreter, and Triton's code generation and
    passes hold it: on an H200's host nemotron_h_8b_mooncake's 24 variants took 10.9-11.4 s in 16 threads
    where one at a time they sum to 32.9 s (the slowest 4.6 s), and a trivial kernel started last took 7 s
    (session 43, ``bench/probes/startup_timeline.py``). Session 36's processes (14.5 s against 9.8 on an
    H100's host, ``bench/probes/prebuild_workers.py``) came from a fork server that imported torch and the
    kernels' modules first. ``kind`` "threads": the old way (and the way where fork is missing)."""

    def __init__(self, entries: list[dict], source: str, workers: Optional[int] = None, cached: int = 0,
                 kind: Optional[str] = None):
        self.entries = entries
        self.source = source
        self.cached = cached
        self.workers = max(1, min(len(entries), workers or usable_cores()))
        self.t0 = perf_counter()
        self.pool, self.kind = _pool(self.workers, kind or WORKERS)
        with warnings.catch_warnings():  # (Python 3.12 warns of forking a process that has threads: the
            warnings.simplefilter("ignore", DeprecationWarning)  # workers only compile and write files)
            self.futures: list[Future] = [self.pool.submit(build, e) for e in entries]

    def abandon(self) -> None:
        """The run stops before its loop: queued builds are dropped (the ones under way finish,
        a few seconds at most: a worker cannot be stopped mid-build). Each queued build is cancelled here:
        a process pool's shutdown leaves that to its manager thread, and a later shutdown call would
        take the order back."""
        for f in self.futures:
            f.cancel()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def wait(self) -> PrebuildReport:
        failed, took = [], []
        for e, f in zip(self.entries, self.futures):
            try:
                why, seconds = f.result()
                took.append((e["kernel"], seconds))
            except Exception as err:  # (a worker process lost; ``build`` itself returns its failures)
                why = f"{e.get('kernel', '?')}: {type(err).__name__}: {err}"
            if why:
                failed.append(why)
        self.pool.shutdown()
        return PrebuildReport(len(self.entries) + self.cached, len(self.entries) - len(failed), failed,
                              perf_counter() - self.t0, self.workers, self.source,
                              sorted(took, key=lambda kt: -kt[1])[:5], self.cached, self.kind)


WORKERS = "processes"  # ``Prebuild``'s workers by default


def _quiet_on_interrupt() -> None:
    """A worker process ends at Ctrl-C as the system ends a process, without Python's traceback: the
    terminal interrupts the run and its workers together, and the run says what happened once. Only
    where the run itself takes Ctrl-C (Python's handler, inherited): a run that ignores it (started in
    the background, under nohup) keeps its workers ignoring it too, or they alone would end."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def _pool(workers: int, kind: str):
    """The workers' pool and its kind: processes forked from this one where the system can fork, else threads."""
    if kind == "processes":
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        try:
            return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"),
                                       initializer=_quiet_on_interrupt), "processes"
        except ValueError:  # (no fork here: threads)
            pass
    return ThreadPoolExecutor(workers, thread_name_prefix="hybridsim-prebuild"), "threads"


# ----------------------------------------------------------------------------- lists on disk

def read_lists(path: Path, flag: str = "--kernel-variants") -> dict:
    """A kernel variants file's lists ({} where the file does not exist yet). A file that is not
    one is bad input, named with the flag that gave it."""
    from ..errors import read_text

    if not path.exists():
        return {}
    where = f"{flag}: {path}"
    try:
        data = json.loads(read_text(path))
    except InputError as e:
        raise InputError(e.message, where) from None
    except json.JSONDecodeError as e:
        raise InputError(f"not a kernel variants file: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})",
                         where) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("lists"), dict):
        raise InputError(f"not a kernel variants file (it needs \"format\": {FORMAT!r} and \"lists\")", where)
    for key, lst in data["lists"].items():
        if not isinstance(lst, dict) or not isinstance(lst.get("variants"), list) or not all(
                isinstance(v, dict) and isinstance(v.get("kernel"), str) for v in lst["variants"]):
            raise InputError(f"list {key!r} is not a list of described kernel variants", where)
    return data["lists"]


def lookup(key: str, sources: Iterable[tuple[dict, str]]) -> tuple[list[dict], str]:
    """The variants listed for ``key`` in the first of ``sources`` (lists as ``read_lists`` gives them,
    and where they came from) that has it, and which one that was."""
    for lists, where in sources:
        lst = lists.get(key)
        if lst is not None:
            return lst["variants"], where
    return [], ""


def dumps(doc: dict) -> str:
    """A kernel variants file's text: one variant a line (a list's change reads as lines in a diff)."""
    lists = []
    for key, lst in doc["lists"].items():
        rows = ",\n".join("   " + json.dumps(v) for v in lst["variants"])  # (a signature keeps its order)
        lists.append(f"  {json.dumps(key)}: {{\"label\": {json.dumps(lst['label'])}, \"variants\": [\n{rows}\n  ]}}")
    return "{\"format\": " + json.dumps(doc["format"]) + ", \"lists\": {\n" + ",\n".join(lists) + "\n}}\n"


def with_variants(lists: dict, key: str, label: str, variants: list[dict]) -> tuple[dict, int, int]:
    """A kernel variants file's document whose list for ``key`` is ``variants`` (other lists kept), with
    how many of them the old list lacked and how many of its variants are gone. The list is what the
    last recorded run used, not a union of every run's: a variant the code no longer builds does not
    stay in it, to be built before every later run for nothing."""
    old = {json.dumps(v, sort_keys=True) for v in (lists.get(key) or {}).get("variants", [])}
    now = {json.dumps(v, sort_keys=True) for v in variants}
    merged = dict(lists)
    merged[key] = {"label": label, "variants": list(variants)}
    return {"format": FORMAT, "lists": dict(sorted(merged.items()))}, len(now - old), len(old - now)
