"""Sweeps: the cell builder and its validation, the local pool and Ray giving the same rows,
--resume, killed workers, failing cells' traces, and golden traces fanned out (replay -j)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from hybridsim.errors import EnvironmentProblem, InputError
from hybridsim.golden import check_traces
from hybridsim.replay import replay_trace
from hybridsim.sweep import load_sweep, run_sweep
from hybridsim.sweep.cell import TIMINGS, CellTask, run_cell
from hybridsim.sweep.jobs import Job
from hybridsim.sweep.pool import run_local

from .cli_inproc import hsi
from .conftest import REPO, tiny_scenario
from .test_cli import hs

# Ray instances, worker pools and signals: these tests start processes on every core and watch them
# (a sweep's workers, Ray's daemons, what is left once it stops), so `make test` runs them on their
# own after the rest, which runs two tests at a time (pytest-xdist, -n 2)
pytestmark = pytest.mark.serial

BASE = tiny_scenario(n=4, pmax=80, omax=10, acc="{kind: bernoulli, rate: 0.7}")
GRID = """base: base.yaml
grid:
  cache.block_size: [16, 32]
  spec_decode.num_speculative_tokens: [0, 2]
{extra}"""


def sweep_dir(tmp_path: Path, extra: str = "", base: str = BASE) -> Path:
    d = tmp_path / "sw"
    d.mkdir(exist_ok=True)
    (d / "base.yaml").write_text(base)
    (d / "sweep.yaml").write_text(GRID.format(extra=extra))
    return d / "sweep.yaml"


def measured(df: pd.DataFrame) -> pd.DataFrame:
    """A results frame without its timing columns, in cell order."""
    return df.drop(columns=list(TIMINGS)).sort_values("cell").reset_index(drop=True)


# ----------------------------------------------------------------------------- builder


def test_shipped_grid_expands_to_16_validated_cells():
    sw = load_sweep(REPO / "scenarios/sweeps/tiny_grid.yaml")
    assert sw.keys == ["cache.block_size", "spec_decode.num_speculative_tokens", "cache.num_blocks",
                       "scheduler.max_num_seqs"]
    assert len(sw.cells) == 16 and len({c.label for c in sw.cells}) == 16
    seen = set()
    for c in sw.cells:
        s = c.loaded().scenario
        assert (s.cache.block_size, s.spec_decode.num_speculative_tokens, s.cache.num_blocks,
                s.scheduler.max_num_seqs, s.seed) == (*c.values.values(), c.seed)
        assert (s.cache.num_blocks, s.scheduler.max_num_seqs) in {(160, 8), (96, 4)}  # zip: together
        seen.add((s.cache.block_size, s.spec_decode.num_speculative_tokens, s.cache.num_blocks, s.seed))
        assert s.workload.num_requests == 32  # the base's, untouched
    assert len(seen) == 16
    assert sw.cells[0].label == "block_size=16 num_speculative_tokens=0 num_blocks=160 max_num_seqs=8 seed=0"


def test_exclude_and_seeds(tmp_path):
    sw = load_sweep(sweep_dir(tmp_path, "seeds: [3, 4, 5]\nexclude:\n  - {cache.block_size: 32, "
                                        "spec_decode.num_speculative_tokens: 2}\n"))
    assert len(sw.cells) == 9
    assert {c.seed for c in sw.cells} == {3, 4, 5}
    assert not any(c.values == {"cache.block_size": 32, "spec_decode.num_speculative_tokens": 2} for c in sw.cells)


@pytest.mark.parametrize("extra, base, where, words", [
    # a cell the scenario rules refuse: named by cell and key, at the sweep file's line of the key
    ("  cache.mamba_cache_mode: [align, all]\n", BASE, "sweep.yaml:3",
     ["cell 4 (block_size=16 num_speculative_tokens=2 mamba_cache_mode=all)", "not supported", "exclude:"]),
    ("  cache.blok_size: [16]\n", BASE, "sweep.yaml:5", ["cell 1 (", "cache.blok_size: unknown key"]),
    ("  cache.num_blocks: [256, 3]\n", BASE, "sweep.yaml:5", ["cell 2 (", "num_blocks=3", "cache.num_blocks:"]),
    ("zip:\n  - {cache.num_blocks: [256, 300], scheduler.max_num_seqs: [4]}\n", BASE, "sweep.yaml:6",
     ["zip[0]", "the same non-zero length"]),
    ("colour: red\n", BASE, "sweep.yaml:5", ["colour: unknown key"]),
    ("  seed: [1, 2]\n", BASE, "sweep.yaml:5", ["seeds: list"]),
    ("  model.preset: [tiny-hybrid, no-such-model]\n", BASE, "sweep.yaml:5", ["cell 2 (", "model: unknown preset"]),
    ("inject_bug: [no_such_bug]\n", BASE, "sweep.yaml:5", ["inject_bug:"]),
    # a bug in a layer kind a cell's model lacks would change nothing in that cell
    ("  model.preset: [tiny-hybrid, tiny-mla]\ninject_bug: [temporal_without_bias]\n", BASE, "sweep.yaml:6",
     ["preset=tiny-mla", "inject_bug: temporal_without_bias breaks Mamba layers"]),
])
def test_bad_cell_is_refused_with_one_message(tmp_path, extra, base, where, words):
    path = sweep_dir(tmp_path, extra, base)
    with pytest.raises(InputError) as e:
        load_sweep(path)
    msg = str(e.value)
    assert e.value.where is not None and e.value.where.endswith(where) or where in msg, msg
    for w in words:
        assert w in msg, msg


def test_cross_field_rule_names_the_cell_and_the_swept_key(tmp_path):
    d = tmp_path / "sw"
    d.mkdir()
    (d / "base.yaml").write_text(tiny_scenario(n=4, mode="all"))
    (d / "s.yaml").write_text("base: base.yaml\nseeds: [0]\ngrid:\n  cache.block_size: [16, 24]\n")
    with pytest.raises(InputError) as e:
        load_sweep(d / "s.yaml")
    assert e.value.where.endswith("s.yaml:4"), e.value.where
    assert e.value.message.startswith("cell 2 (block_size=24 seed=0): cache.block_size: mamba_cache_mode all "
                                      "writes a state every block"), e.value.message


def test_cli_refuses_a_bad_cell_and_keeps_existing_results(tmp_path):
    path = sweep_dir(tmp_path, "  cache.num_blocks: [256, 3]\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_text("earlier,rows\n")
    r = hsi("sweep", path, "--out", out, "--resume")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("error:") == 1 and "cell 2 (" in r.stderr and "cache.num_blocks" in r.stderr
    assert (out / "results.csv").read_text() == "earlier,rows\n"  # nothing ran, nothing was touched
    r = hsi("sweep", sweep_dir(tmp_path), "--out", out)  # an existing results.csv needs --resume
    assert r.returncode == 2 and "--resume" in r.stderr and (out / "results.csv").read_text() == "earlier,rows\n"
    r = hsi("sweep", sweep_dir(tmp_path), "--out", out, "--resume")  # another sweep's file is not appended to
    assert r.returncode == 2 and "another sweep" in r.stderr and (out / "results.csv").read_text() == "earlier,rows\n"


def test_missing_ray_says_how_to_install(monkeypatch):
    import sys

    from hybridsim.sweep.ray_pool import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(EnvironmentProblem, match=r"pip install 'hybridsim\[ray\]'"):
        import_ray()


def test_cli_ray_without_ray_is_an_environment_problem(tmp_path):
    import subprocess
    import sys

    shadow = tmp_path / "noray" / "ray"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no ray in this environment')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(shadow.parent)])}
    r = subprocess.run([sys.executable, "-m", "hybridsim", "sweep", sweep_dir(tmp_path), "--out", tmp_path / "out",
                        "--ray", "auto"], capture_output=True, text=True, cwd=REPO, env=env)
    assert r.returncode == 3 and "Traceback" not in r.stderr, r.stderr
    assert "pip install 'hybridsim[ray]'" in r.stderr.replace("\n", "")
    assert not (tmp_path / "out" / "results.csv").exists()


# ----------------------------------------------------------------------------- local pool and Ray


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory):
    path = sweep_dir(tmp_path_factory.mktemp("local"))
    return path, run_sweep(load_sweep(path), path.parent / "out", workers=2)


def test_local_pool_rows_are_real_and_deterministic(local_rows):
    path, res = local_rows
    df = res.frame
    assert res.exit_code == 0 and len(df) == 4 and set(df["outcome"]) == {"pass"}
    assert (df["checks_run"] > 300).all() and (df["checks_failed"] == 0).all()
    assert (df["steps"] > 0).all() and (df["requests"] == 4).all() and (df["finished"] == 4).all()
    assert (df["peak_blocks"] > 0).all() and (df["attempts"] == 1).all()
    # the same cell run in this process gives the same row
    cell = load_sweep(path).cells[3]
    row = run_cell(CellTask(cell))
    want = df[df["cell"] == cell.label].iloc[0]
    for k, v in row.items():
        if k not in TIMINGS:
            assert str(want[k]) == str(v), k


class TestOnOneRayInstance:
    """The tests that join a Ray instance started in this process share one; it stops once they are
    done, so its processes do not idle through the rest of the module (two cores, shared)."""

    @pytest.fixture(scope="class")
    @classmethod
    def ray_instance(cls):
        import ray  # the test extra installs Ray: an import error here is a failure, not a skip

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        yield ray
        ray.shutdown()

    def test_ray_gives_the_local_rows(self, ray_instance, local_rows, tmp_path):
        path = sweep_dir(tmp_path)
        res = run_sweep(load_sweep(path), tmp_path / "out", ray="auto")
        assert res.backend.startswith("Ray") and ray_instance.is_initialized()  # joined, not shut down
        pd.testing.assert_frame_equal(measured(res.frame), measured(local_rows[1].frame))

    def test_ray_task_lost_twice_is_a_died_row(self, ray_instance, tmp_path):
        path = sweep_dir(tmp_path, "seeds: [0, 1]\nexclude:\n  - {cache.block_size: 32}\n")
        res = run_sweep(load_sweep(path), tmp_path / "out", ray="auto", cell_fn=_kill_self_on_seed_1)
        df = res.frame
        assert len(df) == 4 and res.exit_code == 3
        dead = df[df["seed"] == 1]
        assert set(dead["outcome"]) == {"died"} and dead["error"].str.contains("Ray worker died twice").all()
        assert set(df[df["seed"] == 0]["outcome"]) == {"pass"}


def test_a_ray_instance_the_sweep_starts_gives_the_local_rows(local_rows, tmp_path):
    """``--ray auto`` with no Ray running: the sweep starts a local instance whose workers inherit
    this source tree's import path (no runtime_env: the workers Ray starts with it serve at once),
    from a folder where nothing else would find the package."""
    import subprocess
    import sys

    path = sweep_dir(tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from hybridsim.cli import main; "
            "sys.argv = ['hybridsim'] + sys.argv[2:]; main()")
    r = subprocess.run([sys.executable, "-c", code, str(REPO), "sweep", str(path), "--out", str(tmp_path / "out"),
                        "--ray", "auto"], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = pd.read_csv(tmp_path / "out" / "results.csv")
    want = pd.read_csv(local_rows[0].parent / "out" / "results.csv")
    pd.testing.assert_frame_equal(measured(got), measured(want))


def test_a_local_ray_instance_started_here_hands_its_workers_the_import_path(tmp_path):
    """The workers of an instance the backend starts see this source tree through PYTHONPATH,
    inherited (an instance it joins gets it as a runtime_env instead). Started in the background
    (the caller's thread goes on), it runs jobs and stops cleanly: its autoscaler monitor first,
    while the GCS still answers (Ray's own order costs a second), then every process it started."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    code = ("import os, sys; sys.path.insert(0, sys.argv[1])\n"
            "import ray\n"
            "from hybridsim.sweep.ray_pool import RayBackend, _stop_autoscaler_monitor\n"
            "from hybridsim.sweep.jobs import Job\n"
            "b = RayBackend(None, background=True)\n"
            "[o] = list(b.run([Job('0', os.getenv, 'PYTHONPATH')]))\n"
            "node = ray._private.worker._global_node\n"
            "procs = {t: [i.process for i in infos] for t, infos in node.all_processes.items()}\n"
            "_stop_autoscaler_monitor(ray)\n"
            "monitor_gone = all(p.poll() is not None for p in procs['monitor'])\n"
            "gcs_alive = all(p.poll() is None for p in procs['gcs_server'])\n"
            "b.close()\n"
            "left = [t for t, ps in procs.items() for p in ps if p.poll() is None]\n"
            "print(b.inherited, b._runtime_env(), o.kind, o.value, monitor_gone, gcs_alive, left, ray.is_initialized())\n")
    r = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["True", "None", "ok", str(REPO), "True", "True", "[]", "False"], r.stdout


def test_ray_auto_joining_an_instance_left_by_ray_start_hands_tasks_the_import_path(tmp_path):
    """`--ray auto` joins a local instance started earlier with `ray start --head`. Its workers were
    started by `ray start`, not by us, so they get this source tree as a runtime_env; closing the
    backend disconnects and leaves that instance running (it is not ours to stop)."""
    import subprocess
    import sys
    import time

    if Path("/tmp/ray/ray_current_cluster").exists():
        pytest.skip("a Ray instance started with `ray start` runs on this machine: this test would join it")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RAY_ADDRESS")}
    t0 = time.time() - 1
    up = subprocess.run([str(Path(sys.executable).with_name("ray")), "start", "--head", "--num-cpus", "1",
                         "--include-dashboard=false"], capture_output=True, text=True, cwd=tmp_path, env=env,
                        timeout=120)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        code = ("import os, sys; sys.path.insert(0, sys.argv[1])\n"
                "import ray\n"
                "from hybridsim.sweep.ray_pool import RayBackend\n"
                "from hybridsim.sweep.jobs import Job\n"
                "b = RayBackend(None)\n"
                "[o] = list(b.run([Job('0', os.getenv, 'PYTHONPATH')]))\n"
                "print(b.own, b.inherited, o.kind, o.value)\n"
                "b.close()\n"
                "ray.init(address='auto', log_to_driver=False)\n"  # (still there: this joins it again)
                "print(ray.cluster_resources().get('CPU'))\n")
        r = subprocess.run([sys.executable, "-c", code, str(REPO)], capture_output=True, text=True, cwd=tmp_path,
                           env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.split() == ["False", "False", "ok", str(REPO), "1.0"], r.stdout
    finally:  # (not `ray stop`: that stops every Ray instance on the machine)
        _stop_ray_sessions(_ray_since(t0)[0])
        Path("/tmp/ray/ray_current_cluster").unlink(missing_ok=True)


def _stop_ray_sessions(sessions: list[str]) -> None:
    """Stop the processes of these Ray sessions: those naming the session (GCS, raylet, monitor) and
    every process below them (agents and workers, which rename themselves `ray::...`)."""
    import time

    named = set()
    for p in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (p / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if sessions and any(s in cmd for s in sessions):
            named.add(int(p.name))
    pids = set().union(named, *(_descendants(p) for p in named))
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        t0 = time.monotonic()
        while any(_alive(p) for p in pids) and time.monotonic() - t0 < 5:
            time.sleep(0.1)


def test_the_driver_of_a_sweep_or_fanned_out_replay_never_imports_torch(tmp_path):
    """The driver names cells (or golden traces) to its workers and writes rows; torch (a second of
    imports on the dev machine) loads only where they run, so the workers' own start-up, or Ray's,
    is not slowed by it and the first results come sooner. Bugs to inject validate without it too."""
    import subprocess
    import sys

    path = sweep_dir(tmp_path, "inject_bug: [rejected_state_kept]\n")
    code = ("import sys\n"
            "import hybridsim.cli, hybridsim.sweep.run, hybridsim.sweep.ray_pool, hybridsim.sweep.report\n"
            "import hybridsim.report\n"
            "from hybridsim.sweep import load_sweep\n"
            "from hybridsim.sweep.cell import CellTask, run_cell\n"
            "from hybridsim.golden import GoldenTask, check_one, trace_files\n"
            "from hybridsim.bugs import check_bugs\n"
            "sw = load_sweep(sys.argv[1])\n"
            "assert sw.bugs and check_bugs(['lse_base2'])\n"
            "golden = [GoldenTask(t, False, {}) for t in trace_files([__import__('pathlib').Path('traces')])]\n"
            "import pickle; pickle.dumps((run_cell, [CellTask(c) for c in sw.cells], check_one, golden))\n"
            "print(sorted(m for m in ('torch', 'hybridsim.execute', 'hybridsim.kernels') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "[]", r.stdout


def _ray_since(t0: float) -> tuple[list[str], list[str]]:
    """The Ray sessions started after ``t0``, and the command lines of running processes of theirs."""
    from datetime import datetime

    root = Path("/tmp/ray")
    sessions = []
    for d in root.glob("session_2*") if root.exists() else []:  # session_2026-11-26_20-01-04_032830_7547
        try:
            started = datetime.strptime(d.name[len("session_"):].rsplit("_", 1)[0], "%Y-%m-%d_%H-%M-%S_%f")
        except ValueError:
            continue
        if started.timestamp() >= t0:
            sessions.append(d.name)
    found = []
    for p in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(s in cmd for s in sessions):
            found.append(cmd[:200])
    return sessions, found


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (workers, a forkserver, Ray's processes and their workers)."""
    parent = {}
    for p in Path("/proc").glob("[0-9]*"):
        try:
            stat = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if stat[0] != "Z":
            parent[int(p.name)] = int(stat[1])
    found, grew = {pid}, True
    while grew:
        new = {c for c, pp in parent.items() if pp in found and c not in found}
        found |= new
        grew = bool(new)
    return found - {pid}


def _wait_for_descendants(p, n: int) -> set[int]:
    """Wait (up to a minute) until the running command ``p`` has ``n`` live processes below it."""
    import time

    below: set[int] = set()
    t0 = time.monotonic()
    while p.poll() is None and len(below) < n and time.monotonic() - t0 < 60:
        below = _descendants(p.pid)
        time.sleep(0.05)
    assert p.poll() is None and len(below) >= n, p.communicate()[1][-3000:]
    return below


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_cli_bad_input_after_ray_started_says_so_and_stops_ray(tmp_path):
    """Ray starts in the background once the cells are valid; a refusal after that (an existing
    results.csv without --resume) is still one message, exit 2, and no Ray process is left."""
    import time

    path = sweep_dir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_text("earlier,rows\n")
    t0 = time.time() - 1
    r = hs("sweep", path, "--out", out, "--ray", "auto")
    assert r.returncode == 2 and r.stderr.count("error:") == 1 and "--resume" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and (out / "results.csv").read_text() == "earlier,rows\n"
    time.sleep(0.5)  # (a killed process leaves /proc a moment later)
    sessions, left = _ray_since(t0)
    assert len(sessions) == 1 and left == []  # (Ray had started, and stopped)


@pytest.mark.parametrize("backend, sig", [(["--workers", "2"], "SIGTERM"), (["--ray", "auto"], "SIGTERM"),
                                          (["--workers", "2"], "SIGINT")], ids=["pool", "ray", "pool-ctrl-c"])
def test_cli_sweep_stopped_by_a_signal_keeps_its_rows_and_stops_its_workers(tmp_path, backend, sig):
    """SIGTERM mid-sweep (a scheduler's time limit), or Ctrl-C (SIGINT to the whole process group,
    workers included): the rows written so far stay, results.parquet holds them too, no worker or Ray
    process outlives the sweep, no worker prints a traceback, and the exit status says why. The
    signal comes as a row lands, when the driver starts the next worker (a worker started but not
    yet recorded used to outlive it and die on a broken pipe: 4 times in 8)."""
    import subprocess
    import sys
    import time

    path = sweep_dir(tmp_path, "seeds: [0, 1, 2, 3]\n")
    out = tmp_path / "out"
    t0 = time.time() - 1
    p = subprocess.Popen([sys.executable, "-m", "hybridsim", "sweep", str(path), "--out", str(out), *backend, "-q"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=_ctrl_c_as_at_a_terminal)
    csv = out / "results.csv"
    while p.poll() is None and not (csv.exists() and len(csv.read_text().splitlines()) >= 2):
        time.sleep(0.002)
    assert p.poll() is None, p.communicate()[1][-3000:]  # (16 cells: still running after the first row)
    below = _descendants(p.pid)
    assert below  # (its workers, and Ray's processes)
    signum = getattr(signal, sig)
    if signum == signal.SIGINT:
        os.killpg(p.pid, signum)  # (what a terminal does)
    else:
        p.send_signal(signum)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signum and "Traceback" not in err, err[-3000:]
    rows = pd.read_csv(csv)
    assert 1 <= len(rows) < 16 and set(rows["outcome"]) == {"pass"}
    parquet_matches_csv(out)
    time.sleep(0.5)
    assert _ray_since(t0)[1] == [] and [q for q in below if _alive(q)] == []


def _ctrl_c_as_at_a_terminal() -> None:
    """A command a shell starts in the background (`make test &`, nohup) inherits SIGINT ignored, as
    POSIX has it; at a terminal Ctrl-C reaches it. The test means the terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigterm_while_a_worker_starts_still_stops_that_worker(monkeypatch):
    """The exact race: SIGTERM lands just after a worker process started, before the driver has
    recorded it. The exit waits until it has, so the driver's clean-up stops that worker too."""
    import multiprocessing.process as mpp
    import time

    from hybridsim.sweep import jobs

    started = []
    real_start = mpp.BaseProcess.start

    def start_then_sigterm(self):
        real_start(self)
        started.append(self)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(mpp.BaseProcess, "start", start_then_sigterm)
    before = signal.signal(signal.SIGTERM, jobs._raise_exit)
    try:
        with pytest.raises(SystemExit) as e:
            list(run_local([Job("slow", time.sleep, 60)], workers=1))
    finally:
        signal.signal(signal.SIGTERM, before)
    assert e.value.code == 128 + signal.SIGTERM
    assert len(started) == 1 and not started[0].is_alive() and started[0].exitcode == -signal.SIGKILL


@pytest.mark.parametrize("sig, raised", [("SIGTERM", SystemExit), ("SIGINT", KeyboardInterrupt)])
def test_a_held_signal_is_raised_when_the_section_ends(sig, raised):
    from hybridsim.sweep import jobs

    signum = getattr(signal, sig)
    before = signal.signal(signum, jobs._raise_exit)
    reached = False
    try:
        with pytest.raises(raised) as e:
            with jobs.signals_held():
                with jobs.signals_held():  # (nested: only the outermost end raises)
                    os.kill(os.getpid(), signum)
                    for _ in range(1000):  # (the handler has run by now, and only noted it)
                        pass
                reached = True
        assert reached and (raised is KeyboardInterrupt or e.value.code == 143)
        with jobs.signals_held():  # (a section without a signal ends quietly)
            pass
    finally:
        signal.signal(signum, before)


def test_a_driver_killed_outright_leaves_no_job_running():
    """SIGKILL (or the kernel's out-of-memory killer) gives the driver no chance to stop its jobs:
    each ends when its pipe from the driver closes."""
    import subprocess
    import sys
    import time

    script = ("import time\n"
              "from hybridsim.sweep.jobs import Job\n"
              "from hybridsim.sweep.pool import run_local\n"
              "print(list(run_local([Job(str(i), time.sleep, 120) for i in range(2)], workers=2)))\n")
    p = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    below = _wait_for_descendants(p, 3)  # (a forkserver, two jobs)
    p.kill()
    p.communicate(timeout=60)
    t0 = time.monotonic()
    while [q for q in below if _alive(q)] and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert [q for q in below if _alive(q)] == []  # (within seconds, not the jobs' 120 s)


def test_replay_fanned_out_and_stopped_by_sigterm_stops_its_workers():
    import subprocess
    import sys
    import time

    p = subprocess.Popen([sys.executable, "-m", "hybridsim", "replay", "traces/", "--check", "-j", "2", "-q"],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    below = _wait_for_descendants(p, 3)  # (a forkserver, two replays)
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    time.sleep(0.5)
    assert [q for q in below if _alive(q)] == []


def test_resume_runs_only_the_missing_cells(local_rows, tmp_path):
    path = sweep_dir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    full = (local_rows[0].parent / "out" / "results.csv").read_text().splitlines(keepends=True)
    torn = full[-1][: len(full[-1]) // 2]  # an interrupted write
    (out / "results.csv").write_text("".join(full[:3]) + torn)
    started = []
    res = run_sweep(load_sweep(path), out, workers=2, resume=True, on_start=lambda todo, done: started.append((todo, done)))
    assert started == [(2, 2)] and res.ran == 2 and res.skipped == 2
    assert (out / "results.csv").read_text().startswith("".join(full[:3]))  # earlier rows kept byte for byte
    pd.testing.assert_frame_equal(measured(res.frame), measured(local_rows[1].frame))
    assert len(parquet_matches_csv(out)) == 4  # the resumed rows and the new ones
    res = run_sweep(load_sweep(path), out, workers=2, resume=True)
    assert res.ran == 0 and len(res.frame) == 4


def _gpu_seen(arg: tuple[float, str]) -> tuple:
    """A job: the GPU it was given, its process, and when it ran; with a marker path, its first
    attempt kills its worker."""
    import time

    seconds, marker = arg
    if marker and not os.path.exists(marker):
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.time()
    time.sleep(seconds)
    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.getpid(), t0, time.time()


def test_local_pool_runs_gpu_jobs_one_per_gpu_in_a_worker_that_keeps_the_gpu(monkeypatch, tmp_path):
    """Jobs that run kernels on a GPU get one GPU each, as their only visible device, never two at
    once on one GPU (each would plan its memory on the whole card), and run one after another in
    that GPU's own worker process (CUDA's context and the loaded kernels are kept). Jobs that need
    no GPU go ahead of GPU jobs waiting for one, each in a fresh process, and see the driver's
    devices. A GPU worker that dies costs its job one retry, in a fresh worker; the rest go on."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    dies = str(tmp_path / "died-once")
    # (GPU jobs of 1 s: a CPU job's fresh process must start before the first of them ends, and on a
    # busy 2-core machine a process start once took longer than the 0.4 s they had)
    jobs = ([Job(f"g{i}", _gpu_seen, (1.0, dies if i == 2 else ""), gpu=True) for i in range(6)]
            + [Job(f"c{i}", _gpu_seen, (0.4, "")) for i in range(2)])
    outcomes = {o.key: o for o in run_local(jobs, workers=4, gpus=["3", "7"])}
    got = {k: o.value for k, o in outcomes.items()}
    assert all(o.kind == "ok" for o in outcomes.values())
    assert outcomes["g2"].attempts == 2 and all(o.attempts == 1 for k, o in outcomes.items() if k != "g2")
    cpu = [got[f"c{i}"] for i in range(2)]
    assert all(gpu is None for gpu, *_ in cpu) and len({pid for _, pid, _, _ in cpu}) == 2
    spans = sorted((got[f"g{i}"] for i in range(6)), key=lambda v: v[2])
    assert {gpu for gpu, *_ in spans} == {"3", "7"}
    for gpu in ("3", "7"):
        mine = [(a, b) for g, _, a, b in spans if g == gpu]
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(mine, mine[1:])), mine  # one at a time
    pids = {pid for _, pid, _, _ in spans}
    assert len(pids) == 3 and not pids & {pid for _, pid, _, _ in cpu}  # (two workers, one replaced once)
    first_gpu_end = min(b for *_, b in spans)
    assert all(c[2] < first_gpu_end for c in cpu)  # (they did not wait behind GPU jobs)
    assert [q for q in pids if _alive(q)] == []


def test_per_gpu_lets_that_many_gpu_jobs_share_a_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    jobs = [Job(f"g{i}", _gpu_seen, (0.5, ""), gpu=True) for i in range(6)]
    got = [o.value for o in run_local(jobs, workers=4, gpus=["5"], per_gpu=2)]
    assert {gpu for gpu, *_ in got} == {"5"} and len({pid for _, pid, _, _ in got}) == 2
    edges = sorted([(a, 1) for *_, a, _ in got] + [(b, -1) for *_, b in got])
    at_once = max(sum(d for _, d in edges[: i + 1]) for i in range(len(edges)))
    assert at_once == 2


def test_a_run_on_a_gpu_is_told_by_its_execution_settings(tmp_path):
    """Sweep cells and golden replays ask for a GPU by one rule: checks on, device cuda or auto, where
    an unset device or check is the schema's default (auto, full)."""
    from hybridsim.sweep.jobs import runs_on_gpu

    assert runs_on_gpu({}) and runs_on_gpu({"device": "cuda", "check": "sampled"})
    assert not runs_on_gpu({"device": "cpu"}) and not runs_on_gpu({"check": "off"})
    cells = load_sweep(sweep_dir(tmp_path, "  execution.device: [cpu, auto]\n")).cells
    assert [runs_on_gpu(c.raw["execution"]) for c in cells] == [c.values["execution.device"] == "auto" for c in cells]


def test_visible_gpus_reads_cuda_visible_devices_as_cuda_does(monkeypatch):
    from hybridsim.sweep.pool import visible_gpus

    for env, want in (("0,1", ["0", "1"]), ("", []), ("2, -1, 3", ["2"]), ("GPU-8f1c,GPU-77aa", ["GPU-8f1c", "GPU-77aa"])):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
        assert visible_gpus() == want, env
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    listed = Path("/proc/driver/nvidia/gpus")
    assert visible_gpus() == [str(i) for i in range(len(os.listdir(listed)) if listed.is_dir() else 0)]


def _kill_self_on_seed_1(task: CellTask) -> dict:
    if task.cell.seed == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    return run_cell(task)


def test_a_killed_worker_loses_no_other_cell(tmp_path):
    path = sweep_dir(tmp_path, "seeds: [0, 1]\nexclude:\n  - {cache.block_size: 32}\n")  # (two cells a seed)
    res = run_sweep(load_sweep(path), tmp_path / "out", workers=2, cell_fn=_kill_self_on_seed_1)
    df = res.frame
    assert len(df) == 4 and res.exit_code == 3
    dead = df[df["seed"] == 1]
    assert set(dead["outcome"]) == {"died"} and (dead["attempts"] == 2).all()
    assert dead["error"].str.contains("died 2 times").all() and dead["error"].str.contains("signal 9").all()
    alive = df[df["seed"] == 0]
    assert set(alive["outcome"]) == {"pass"} and (alive["checks_run"] > 300).all()
    pq = parquet_matches_csv(tmp_path / "out")  # (died rows: no counts, an error text)
    assert pq[pq["seed"] == 1]["steps"].isna().all() and pq[pq["seed"] == 1]["error"].str.contains("signal 9").all()


def _die_once(arg: tuple[str, str]) -> str:
    marker, key = arg
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(7)
    return key


def test_pool_retries_a_dead_worker_once(tmp_path):
    jobs = [Job("a", _die_once, (str(tmp_path / "a"), "a")), Job("b", _die_once, (str(tmp_path / "b"), "b"))]
    got = {o.key: o for o in run_local(jobs, 2)}
    assert {k: (o.kind, o.value, o.attempts) for k, o in got.items()} == {"a": ("ok", "a", 2), "b": ("ok", "b", 2)}


def _threads_when_alone(arg: tuple[str, float]) -> int:
    """A job's torch threads: at once (``quick``), or once it is the only job left (up to a bound)."""
    import time

    import torch

    name, bound = arg
    if name == "quick":
        return torch.get_num_threads()
    t0 = time.monotonic()
    while torch.get_num_threads() == 1 and time.monotonic() - t0 < bound:
        time.sleep(0.01)
    return torch.get_num_threads()


def test_the_last_running_job_gets_the_free_cores(monkeypatch):
    import hybridsim.sweep.pool as pool

    monkeypatch.setattr(pool, "default_workers", lambda: 2)  # (the driver's view; the machine may have 1 core)
    jobs = [Job("long", _threads_when_alone, ("long", 60.0)), Job("quick", _threads_when_alone, ("quick", 0.0))]
    got = {o.key: o.value for o in run_local(jobs, 2)}
    assert got == {"quick": 1, "long": 2}  # one thread each while both run; two for the one left
    jobs = [Job("long", _threads_when_alone, ("long", 1.0)), Job("quick", _threads_when_alone, ("quick", 0.0))]
    assert {o.key: o.value for o in run_local(jobs, 1)} == {"quick": 1, "long": 1}  # -j 1: one core, one thread


def test_failing_cells_write_traces_that_replay_the_failure(tmp_path):
    path = sweep_dir(tmp_path, "inject_bug: [rejected_state_kept]\n")
    out = tmp_path / "out"
    res = run_sweep(load_sweep(path), out, workers=2, record_failures=True)
    df = res.frame.set_index("cell")
    assert res.exit_code == 1
    failing = df[df["exit_code"] == 1]
    assert len(failing) == 2 and (failing["spec_decode.num_speculative_tokens"] == 2).all()  # drafts break it
    assert set(df[df["exit_code"] == 0]["spec_decode.num_speculative_tokens"]) == {0}
    for cell, r in failing.iterrows():
        assert r["first_divergence"].startswith("step ") and r["checks_failed"] > 0
        trace = out / r["trace"]
        rep = replay_trace(trace, bugs={"rejected_state_kept"})
        assert rep.failed and rep.steps == r["steps"]
        assert r["failed_checks"].split()[0] in {t.name for t in rep.checks.tallies.values() if t.failures}
    assert not df[df["exit_code"] == 0]["trace"].any()
    pq = parquet_matches_csv(out).set_index("cell")
    assert list(pq.loc[failing.index, "trace"]) == list(failing["trace"])


# ----------------------------------------------------------------------------- CLI and replay -j


def test_summary_tables_fit_80_columns():
    from hybridsim.sweep.report import failing_table, outcome_table, slowest_table

    from .test_report_width import render

    label = "block_size=16 num_speculative_tokens=3 mamba_cache_mode=align num_blocks=96 seed=12"
    df = pd.DataFrame([{"cell": f"{label}{i}", "outcome": o, "exit_code": c, "checks_run": 12345, "checks_failed": f,
                        "wall_s": 1.5 + i, "steps": 300, "plan_s": 0.02, "error": "" if c < 3 else "the worker "
                        "process died 2 times (killed by signal 9)", "trace": "failures/003_" + label + ".jsonl" if c == 1
                        else "", "first_divergence": "step 12 r3 ssm.running_state" if c == 1 else ""}
                       for i, (o, c, f) in enumerate([("pass", 0, 0), ("FAIL", 1, 4), ("died", 3, 0)])])
    lines = render(outcome_table(df, "cells by outcome"))
    assert any("│ FAIL " in line and "12,345" in line for line in lines)
    render(slowest_table(df))
    text = "\n".join(render(failing_table(df)))
    assert "signal 9" in text and "ssm.running_state" in text
    assert failing_table(df[df["exit_code"] == 0]) is None



def test_cli_sweep_writes_rows_and_a_summary(tmp_path):
    path = sweep_dir(tmp_path, "exclude:\n  - {spec_decode.num_speculative_tokens: 2}\n")
    r = hs("sweep", path, "--out", tmp_path / "out", "--workers", "2")
    assert r.returncode == 0, r.stderr
    assert "cells by outcome" in r.stdout and "slowest cells" in r.stdout
    df = pd.read_csv(tmp_path / "out" / "results.csv")
    assert list(df["cache.block_size"]) in ([16, 32], [32, 16]) and set(df["exit_code"]) == {0}
    r = hsi("sweep", path, "--out", tmp_path / "out2", "--ray", "auto", "--workers", "2")
    assert r.returncode == 2 and "not both" in r.stderr


def test_replay_check_fans_out_with_the_same_rows(tmp_path):
    d = tmp_path / "golden"
    d.mkdir()
    for name in ("spec_padding", "spec_decode"):
        for suffix in (".jsonl", ".expected.json"):
            shutil.copy(REPO / "traces" / f"{name}{suffix}", d / f"{name}{suffix}")
    (d / "spec_decode.expected.json").write_text(
        (d / "spec_decode.expected.json").read_text().replace('"steps": 35', '"steps": 36'))
    serial = check_traces([d], jobs=1)
    fanned = check_traces([d], jobs=2)
    untimed = lambda rows: [{k: v for k, v in r.__dict__.items() if k != "wall_s"} for r in rows]  # noqa: E731
    assert untimed(fanned) == untimed(serial) and all(r.wall_s > 0 for r in fanned)
    assert [r.result for r in fanned] == ["FAIL", "pass"] and fanned[0].differences == ["steps: 36 -> 35"]
    r = hsi("replay", d / "spec_padding.jsonl", "-j", "2")
    assert r.returncode == 2 and "--check" in r.stderr


def test_cli_replay_on_ray_starts_it_after_the_traces_are_found_and_stops_it(tmp_path):
    """`replay --check --ray auto`: Ray starts in the background once the traces are listed (a missing
    one is refused first, and no Ray starts), the rows are the serial ones, nothing of Ray is left."""
    import time

    d = tmp_path / "golden"
    d.mkdir()
    for suffix in (".jsonl", ".expected.json"):
        shutil.copy(REPO / "traces" / f"spec_padding{suffix}", d / f"spec_padding{suffix}")
    t0 = time.time() - 1
    r = hs("replay", tmp_path / "missing.jsonl", "--check", "--ray", "auto")
    assert r.returncode == 2 and "missing.jsonl" in r.stderr.replace("\n", "") and "Traceback" not in r.stderr, r.stderr
    assert _ray_since(t0)[0] == []
    r = hs("replay", d, "--check", "--ray", "auto")
    assert r.returncode == 0 and "spec_padding.jsonl" in r.stdout and "pass" in r.stdout, r.stderr[-3000:]
    time.sleep(0.5)
    sessions, left = _ray_since(t0)
    assert len(sessions) == 1 and left == []


# ----------------------------------------------------------------------------- results.parquet


def _same(got, want: str) -> bool:
    """A parquet value against the text results.csv has for it."""
    if want == "":
        return got == "" or pd.isna(got)
    if isinstance(got, str) or isinstance(got, (bool, np.bool_)):
        return str(got) == want
    return float(got) == float(want)


def parquet_matches_csv(out: Path) -> pd.DataFrame:
    """results.parquet read back with pandas: results.csv's columns, rows in its order, the same values,
    numbers as numbers."""
    pq = pd.read_parquet(out / "results.parquet")
    csv = pd.read_csv(out / "results.csv", dtype=str, keep_default_na=False)
    assert list(pq.columns) == list(csv.columns) and len(pq) == len(csv) > 0
    for i in range(len(csv)):
        for c in csv.columns:
            assert _same(pq.iloc[i][c], csv.iloc[i][c]), (i, c, pq.iloc[i][c], csv.iloc[i][c])
    for c in ("exit_code", "attempts", "seed"):
        assert pq[c].dtype.kind in "iu", (c, pq[c].dtype)
    for c in ("cell", "outcome", "failed_checks", "first_divergence", "error", "trace"):
        assert pq[c].map(type).eq(str).all(), c  # texts, missing as "" (as SweepResult.frame has them)
    return pq


def test_parquet_holds_the_csv_rows(local_rows):
    path, res = local_rows
    out = path.parent / "out"
    pq = parquet_matches_csv(out)
    pd.testing.assert_frame_equal(pq, res.frame)
    assert res.notes == [] and (pq["checks_run"] > 300).all()
    assert not (out / "results.parquet.partial").exists()


def test_without_pyarrow_the_sweep_says_so_and_drops_a_stale_parquet(tmp_path, monkeypatch):
    path = sweep_dir(tmp_path, "seeds: [0, 1]\nexclude:\n  - {cache.block_size: 32}\n"
                               "  - {spec_decode.num_speculative_tokens: 2}\n")
    out = tmp_path / "out"
    sw = load_sweep(path)
    with monkeypatch.context() as m:  # a sweep of the first cell alone: its parquet written
        m.setattr(sw, "cells", sw.cells[:1])
        res = run_sweep(sw, out, workers=1)
    assert res.notes == [] and len(pd.read_parquet(out / "results.parquet")) == 1
    def no_engine(engine):  # what pandas raises without pyarrow or fastparquet (the CLI test below has neither)
        raise ImportError("Unable to find a usable engine; tried using: 'pyarrow', 'fastparquet'.")

    monkeypatch.setattr("pandas.io.parquet.get_engine", no_engine)
    res = run_sweep(load_sweep(path), out, workers=1, resume=True)
    assert res.exit_code == 0 and len(res.frame) == 2 and res.ran == 1
    assert len(res.notes) == 1 and res.notes[0].startswith("results.parquet not written: pandas needs pyarrow")
    assert "hybridsim[parquet]" in res.notes[0] and "out of date, was removed" in res.notes[0]
    assert not (out / "results.parquet").exists() and not (out / "results.parquet.partial").exists()
    res = run_sweep(load_sweep(path), out, workers=1, resume=True)  # nothing left to remove: the plain note
    assert res.ran == 0 and len(res.notes) == 1 and "removed" not in res.notes[0]


def test_cli_without_pyarrow_writes_the_csv_and_says_so_once(tmp_path):
    import subprocess
    import sys

    shadow = tmp_path / "noparquet"
    for mod in ("pyarrow", "fastparquet"):
        (shadow / mod).mkdir(parents=True)
        (shadow / mod / "__init__.py").write_text(f"raise ImportError('no {mod} in this environment')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(shadow)])}
    path = sweep_dir(tmp_path, "exclude:\n  - {cache.block_size: 32}\n  - {spec_decode.num_speculative_tokens: 2}\n")
    r = subprocess.run([sys.executable, "-m", "hybridsim", "sweep", path, "--out", tmp_path / "out", "-j", "1"],
                       capture_output=True, text=True, cwd=REPO, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    text = " ".join((r.stdout + r.stderr).split())
    assert text.count("results.parquet not written") == 1, text
    assert "pip install 'hybridsim[parquet]'" in text
    assert len(pd.read_csv(tmp_path / "out" / "results.csv")) == 1
    assert not (tmp_path / "out" / "results.parquet").exists()
