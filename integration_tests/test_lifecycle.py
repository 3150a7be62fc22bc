"""The launchers' one watch loop (`prism_plugin.runtime.lifecycle`) with real processes: tier (c), 2 real ranks,
FileStore rendezvous, bounded waits.

Each program writes ``<dir>/pids-<rank>.json`` (its pid and its own child's) once it is emulated, then loops in
Python (so the SIGTERM handler runs at once). The tests wait for those files, act, and check that every pid
is gone: the ranks are their own process groups and the launcher signals the groups.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from integration_tests.summary_schema import assert_published_schema
from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.launch.launcher import LaunchSpec, launch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
START_S = 90.0  # two torch start-ups on a loaded 2-core machine take 5-20 s; Megatron's imports more
PROGRAM = """
import json, os, signal, subprocess, sys, time
from pathlib import Path
import torch.distributed as dist

if "PRISM_CONFIG" in os.environ:
    dist.init_process_group("gloo")  # prism run: this starts the emulation; the wrapper already did
rank = int(os.environ["RANK"])
mode = os.environ.get("MODE", "loop")
if mode == "ignore-term" and rank == 1:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
out = Path(os.environ["PIDS_DIR"])
print(f"rank {rank} ready", flush=True)  # before the pid file: a test that signals once it sees the file finds the line
(out / f"pids-{rank}.json.tmp").write_text(json.dumps({"rank": os.getpid(), "child": child.pid}))
os.replace(out / f"pids-{rank}.json.tmp", out / f"pids-{rank}.json")
if mode == "ignore-term" and rank == 0:
    while not (out / "pids-1.json").exists():
        time.sleep(0.02)
    sys.exit(3)
while True:
    time.sleep(0.02)
"""


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie awaiting its parent's wait counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _wait_for_pids(folder: Path, ranks: tuple[int, ...], launcher: subprocess.Popen[str] | None) -> dict[int, dict]:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        files = [folder / f"pids-{r}.json" for r in ranks]
        if all(f.exists() for f in files):
            return {r: json.loads(f.read_text()) for r, f in zip(ranks, files, strict=True)}
        if launcher is not None and launcher.poll() is not None:
            raise AssertionError(f"the launcher ended early ({launcher.returncode}): {launcher.communicate()}")
        time.sleep(0.05)
    raise AssertionError(f"the ranks did not start within {START_S} s")


def _all_gone(pids: dict[int, dict], within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    every = [p for entry in pids.values() for p in entry.values()]
    while any(_alive(p) for p in every):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PIDS_DIR=str(tmp_path), OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **extra)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "PRISM_CONFIG", "PRISM_STORE_FILE"):
        env.pop(name, None)
    return env


def _prism_run(tmp_path: Path, **extra: str) -> subprocess.Popen[str]:
    script = tmp_path / "loop.py"
    script.write_text(PROGRAM)
    cmd = [sys.executable, "-m", "prism_plugin.cli.main", "run", "--world-size", "4", "--real-ranks", "0,1",
           "--gpus-per-node", "2", "--output", str(tmp_path / "out"), "--", str(script)]
    return subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path, **extra), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _stop(launcher: subprocess.Popen[str], sig: int) -> tuple[float, str, str]:
    """Send `sig` to the launcher; (seconds until it ended, its stdout, its stderr)."""
    sent = time.monotonic()
    launcher.send_signal(sig)
    out, err = launcher.communicate(timeout=30)
    return time.monotonic() - sent, out, err


def test_sigterm_to_prism_run_ends_both_ranks_and_their_children(tmp_path: Path) -> None:
    launcher = _prism_run(tmp_path)
    pids = _wait_for_pids(tmp_path, (0, 1), launcher)
    elapsed, out, err = _stop(launcher, signal.SIGTERM)
    assert launcher.returncode == 143, err[-3000:]  # 128 + SIGTERM
    assert "prism run: received SIGTERM; forwarding it to the 2 running real rank(s)" in err
    assert _all_gone(pids, within_s=2.0), pids
    assert elapsed < 8.0  # measured 0.2-1 s: the ranks' SystemExit path, well inside the 5 s grace
    for rank in (0, 1):  # each terminated rank still wrote its summary, and flushed its stdout
        summary = json.loads((tmp_path / "out" / f"rank{rank}.summary.json").read_text())
        assert_published_schema(summary)
        assert summary["rank"] == rank and summary["exit_code"] == 143
        assert f"rank {rank} ready" in out
    assert out.count("PRISM_SUMMARY ") == 2
    assert not list((tmp_path / "out").glob("store-*")), "the launcher removes its store file"


LOADER_PROGRAM = """
import os, sys, time
from pathlib import Path
import torch, torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

class Endless(Dataset):
    def __len__(self):
        return 10 ** 9
    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.zeros(4)

dist.init_process_group("gloo")
for i, batch in enumerate(DataLoader(Endless(), batch_size=2, num_workers=2)):
    dist.all_reduce(batch)
    if i == 2:
        (Path(os.environ["PIDS_DIR"]) / f"pids-{dist.get_rank()}.json").write_text('{"rank": %d}' % os.getpid())
"""


def test_sigterm_to_a_rank_with_dataloader_workers_prints_no_worker_traceback(tmp_path: Path) -> None:
    """The whole process group gets SIGTERM, the DataLoader's workers with it; torch's SIGCHLD handler would then
    raise "DataLoader worker ... is killed by signal" in the rank's teardown (one traceback per iterator)."""
    script = tmp_path / "loader.py"
    script.write_text(LOADER_PROGRAM)
    cmd = [sys.executable, "-m", "prism_plugin.cli.main", "run", "--world-size", "4", "--real-ranks", "0",
           "--output", str(tmp_path / "out"), "--", str(script)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    _wait_for_pids(tmp_path, (0,), launcher)
    _, _, err = _stop(launcher, signal.SIGTERM)
    assert launcher.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "DataLoader worker" not in err, err[-3000:]
    assert json.loads((tmp_path / "out" / "rank0.summary.json").read_text())["exit_code"] == 143


def test_rank_killed_by_sigkill_is_reported_as_137_and_the_survivor_writes_its_summary(tmp_path: Path) -> None:
    launcher = _prism_run(tmp_path)
    pids = _wait_for_pids(tmp_path, (0, 1), launcher)
    os.kill(pids[0]["rank"], signal.SIGKILL)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 137, err[-3000:]
    assert "prism run: real rank 0 (process 0) ended with killed by signal 9 (SIGKILL, exit code 137); " \
           "stopping the other 1 real rank(s)" in err
    assert _all_gone(pids, within_s=2.0), pids  # the killed rank's own child goes with its group
    survivor = json.loads((tmp_path / "out" / "rank1.summary.json").read_text())
    assert survivor["exit_code"] == 143 and survivor["world_size"] == 4
    assert not (tmp_path / "out" / "rank0.summary.json").exists()


def test_rank_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path: Path, capfd) -> None:
    script = tmp_path / "loop.py"
    script.write_text(PROGRAM)
    config = EmulationConfig(world=VirtualWorld(world_size=4, real_ranks=(0, 1), gpus_per_node=2), timeout_s=30.0)
    os.environ.update(PIDS_DIR=str(tmp_path), MODE="ignore-term")
    try:
        start = time.monotonic()
        rc = launch(LaunchSpec(config=config, target=[str(script)], grace_s=1.0), timeout_s=START_S + 30)
        elapsed = time.monotonic() - start
    finally:
        os.environ.pop("PIDS_DIR")
        os.environ.pop("MODE")
    err = capfd.readouterr().err
    assert rc == 3  # the first failure's exit code, not the SIGKILL that ended the other rank
    assert "prism run: real rank 0 (process 0) ended with exit code 3; stopping the other 1 real rank(s)" in err
    assert "prism run: real rank 1 (process 1) did not stop within 1 s; sending SIGKILL" in err
    pids = {r: json.loads((tmp_path / f"pids-{r}.json").read_text()) for r in (0, 1)}
    assert _all_gone(pids, within_s=2.0), pids
    assert elapsed < START_S


def test_sigterm_to_the_prism_megatron_self_launch_parent(tmp_path: Path) -> None:
    """``prism megatron`` without torchrun starts its K processes through the same loop (a plain script: the
    wrapper activates the emulation and installs the Megatron adapter, the script needs no model)."""
    script = tmp_path / "loop.py"
    script.write_text(PROGRAM)
    out_dir, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "prism_plugin.cli.main", "megatron", str(script), "--transformer-impl", "local",
           "--prism-world-size", "4", "--prism-real-ranks", "0,3", "--prism-gpus-per-node", "2",
           "--prism-output", str(out_dir)]
    launcher = subprocess.Popen(cmd, cwd=ROOT, env=_env(tmp_path, TMPDIR=str(tmp)), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    pids = _wait_for_pids(tmp_path, (0, 3), launcher)
    elapsed, out, err = _stop(launcher, signal.SIGTERM)
    assert launcher.returncode == 143, err[-3000:]
    assert "prism megatron: received SIGTERM; forwarding it to the 2 running real rank(s)" in err
    assert _all_gone(pids, within_s=2.0), pids
    assert elapsed < 8.0
    for rank in (0, 3):
        summary = json.loads((out_dir / f"rank{rank}.summary.json").read_text())
        assert summary["exit_code"] == 143 and summary["megatron"]["cpu_mode"] in (True, False)
    assert not list(tmp.glob("prism-megatron-*")), "the self-launch removes its temporary store directory"


EMULATED_JOB = """
import json, os, time
from pathlib import Path
out = Path(os.environ["PIDS_DIR"])
(out / "pids-0.json.tmp").write_text(json.dumps({"rank": os.getpid()}))
os.replace(out / "pids-0.json.tmp", out / "pids-0.json")
while True:
    time.sleep(0.02)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_prism_emulate_takes_its_profiling_run_with_it(tmp_path: Path, sig: int) -> None:
    """SIGKILL to `prism emulate` left its profiling runs running; now each run dies with it (a parent-death
    signal), and SIGTERM stops the run's process group and exits 143."""
    script = tmp_path / "job.py"
    script.write_text(EMULATED_JOB)
    cmd = [sys.executable, "-m", "prism_plugin.cli.main", "emulate", "--world-size", "8", "--out",
           str(tmp_path / "out"), "--", str(script)]
    emulate = subprocess.Popen(cmd, cwd=tmp_path, env=_env(tmp_path), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    pids = _wait_for_pids(tmp_path, (0,), emulate)
    _seconds, _out, _err = _stop(emulate, sig)
    assert emulate.returncode == (-9 if sig == signal.SIGKILL else 143)
    assert _all_gone(pids, within_s=10.0), f"the profiling run {pids} outlived prism emulate"
