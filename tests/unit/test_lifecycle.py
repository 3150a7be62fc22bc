"""`prism_plugin.runtime.lifecycle` without an emulation: store selection, summary writing, the run's order of
steps (session functions replaced by fakes), exit codes, and the watch loop on tiny non-torch children."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from prism_plugin.config.emulation import ConfigError, EmulationConfig, VirtualWorld
from prism_plugin.launch.processes import RealProcess, exit_code_of, launch_processes
from prism_plugin.runtime import lifecycle
from prism_plugin.runtime.lifecycle import EmulatedRun, real_store, write_summary

_STORE_ENV = ("PRISM_STORE_FILE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture
def no_store_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _STORE_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# -- real_store ---------------------------------------------------------------------------------------
def test_one_real_rank_needs_no_store(no_store_env: pytest.MonkeyPatch) -> None:
    assert real_store(1, 0) is None
    assert real_store(1, 0, store=dist.HashStore()) is None  # one real rank never has an inner real group


def test_a_passed_store_wins_over_the_environment(no_store_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    no_store_env.setenv("PRISM_STORE_FILE", str(tmp_path / "store"))
    mine = dist.HashStore()
    assert real_store(2, 1, store=mine) is mine


def test_prism_store_file_gives_a_file_store(no_store_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    no_store_env.setenv("PRISM_STORE_FILE", str(tmp_path / "store"))
    no_store_env.setenv("MASTER_ADDR", "127.0.0.1")  # the launcher's own variables do not win over the file
    no_store_env.setenv("MASTER_PORT", "1")
    store = real_store(2, 0)
    assert isinstance(store, dist.FileStore)
    store.set("k", "v")
    assert dist.FileStore(str(tmp_path / "store"), 2).get("k") == b"v"


def test_file_init_method_gives_a_file_store(no_store_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    store = real_store(3, 2, init_method=f"file://{tmp_path / 'rdv'}")
    assert isinstance(store, dist.FileStore)
    store.set("a", "1")
    assert (tmp_path / "rdv").exists()


def test_master_addr_gives_the_launchers_store_under_a_prefix(no_store_env: pytest.MonkeyPatch) -> None:
    no_store_env.setenv("MASTER_ADDR", "127.0.0.1")
    no_store_env.setenv("MASTER_PORT", "29999")
    launcher_store = dist.HashStore()
    calls: list[tuple[str, dict[str, Any]]] = []

    def rendezvous(url: str, **kwargs: Any) -> Any:
        calls.append((url, kwargs))
        yield launcher_store, kwargs["rank"], kwargs["world_size"]

    no_store_env.setattr(dist, "rendezvous", rendezvous)
    store = real_store(2, 1)
    assert calls == [("env://", {"rank": 1, "world_size": 2})]
    assert isinstance(store, dist.PrefixStore)
    store.set("x", "1")
    assert launcher_store.get("prism/x") == b"1"


def test_no_rendezvous_is_a_config_error_naming_the_options(no_store_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="PRISM_STORE_FILE.*MASTER_ADDR.*init_method='file:///path'"):
        real_store(2, 0)


# -- write_summary ---------------------------------------------------------------------------------------
def test_summary_line_and_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    summary = {"rank": 5, "world_size": 8, "path": Path("/x")}
    written = write_summary(summary, tmp_path / "out")
    line = capsys.readouterr().out
    assert line == 'PRISM_SUMMARY {"rank": 5, "world_size": 8, "path": "/x"}\n'
    assert written == tmp_path / "out" / "rank5.summary.json"
    assert written.read_text() == json.dumps({"rank": 5, "world_size": 8, "path": "/x"}, indent=2)


def test_summary_without_rank_or_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert write_summary({}, tmp_path, rank=7, stdout=False) == tmp_path / "rank7.summary.json"
    assert write_summary({"rank": 1}, None) is None
    assert capsys.readouterr().out == 'PRISM_SUMMARY {"rank": 1}\n'


# -- EmulatedRun (the session replaced by fakes) -------------------------------------------------------------
class _FakeSession:
    def __init__(self, events: list[str]) -> None:
        self.events = events


@pytest.fixture
def fake_session(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    from prism_plugin.runtime import session as session_mod

    events: list[str] = []

    def activate(config: Any, process_index: int, store: Any, **kwargs: Any) -> _FakeSession:
        events.append(f"activate {process_index} {kwargs}")
        return _FakeSession(events)

    def deactivate() -> dict[str, Any]:
        events.append("deactivate")
        return {"rank": 3, "world_size": 4}

    monkeypatch.setattr(session_mod, "activate", activate)
    monkeypatch.setattr(session_mod, "deactivate", deactivate)
    return events


def _config(tmp_path: Path) -> EmulationConfig:
    return EmulationConfig(world=VirtualWorld(world_size=4, real_ranks=(1, 3), gpus_per_node=2),
                           output_dir=tmp_path)


def test_run_order_and_clean_exit(fake_session: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = EmulatedRun(_config(tmp_path), 1, None, num_processes=2)
    assert run.rank == 3
    run.start(init_timeout_s=9.0)
    run.on_stop(lambda: fake_session.append("stop tracker"))
    run.add_summary(lambda: (fake_session.append("part"), {"megatron": {"cpu_mode": True}})[1])
    run.cleanup.callback(fake_session.append, "uninstall")
    with run:
        raise SystemExit(0)  # a clean exit is absorbed
    assert fake_session == ["activate 1 {'init_timeout_s': 9.0, 'num_processes': 2, 'backend': None}", "stop tracker",
                            "deactivate", "part", "uninstall"]
    expected = {"rank": 3, "world_size": 4, "megatron": {"cpu_mode": True}, "exit_code": 0}
    assert run.summary == expected
    assert json.loads((tmp_path / "rank3.summary.json").read_text()) == expected
    assert capsys.readouterr().out == "PRISM_SUMMARY " + json.dumps(expected) + "\n"
    assert run.finish() is run.summary and fake_session.count("deactivate") == 1  # once


def test_run_records_the_programs_error_and_reraises(fake_session: list[str], tmp_path: Path) -> None:
    run = EmulatedRun(_config(tmp_path), 1, None, print_summary=False)
    run.start()
    with pytest.raises(ValueError, match="boom"), run:
        raise ValueError("boom")
    assert run.summary is not None
    assert run.summary["exit_code"] == 1 and run.summary["error"] == "ValueError: boom"
    with pytest.raises(SystemExit) as info, EmulatedRun(_config(tmp_path), 0, None, print_summary=False) as other:
        other.start()
        raise SystemExit(4)
    assert info.value.code == 4 and other.summary is not None and other.summary["exit_code"] == 4


def test_sigterm_during_the_run_is_system_exit_143(fake_session: list[str], tmp_path: Path) -> None:
    run = EmulatedRun(_config(tmp_path), 1, None, print_summary=False)
    run.start()
    assert signal.getsignal(signal.SIGTERM) is lifecycle._raise_system_exit
    with pytest.raises(SystemExit) as info, run:
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)  # let the handler run
        raise AssertionError("SIGTERM did not interrupt the program")
    assert info.value.code == 143 and run.summary is not None and run.summary["exit_code"] == 143
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored by the run's cleanup


def test_a_programs_own_sigterm_handler_is_kept(fake_session: list[str], tmp_path: Path) -> None:
    def mine(signum: int, frame: Any) -> None:
        return None

    previous = signal.signal(signal.SIGTERM, mine)
    try:
        run = EmulatedRun(_config(tmp_path), 1, None, print_summary=False)
        run.start()
        assert signal.getsignal(signal.SIGTERM) is mine
        run.finish()
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_run_never_started_writes_nothing(fake_session: list[str], tmp_path: Path) -> None:
    run = EmulatedRun(_config(tmp_path), 0, None)
    with run.recording():
        pass
    assert run.finish() is None and not list(tmp_path.iterdir()) and fake_session == []


# -- exit codes and the watch loop ------------------------------------------------------------------------
def test_exit_code_of_a_signalled_child_is_128_plus_the_signal() -> None:
    assert [exit_code_of(rc) for rc in (0, 1, -9, -15, -2)] == [0, 1, 137, 143, 130]


def _child(code: str, index: int) -> RealProcess:
    return RealProcess(argv=(sys.executable, "-c", code), env=dict(os.environ), virtual_rank=10 + index,
                       process_index=index)


def test_watch_loop_names_the_failed_rank_and_stops_the_others(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    flag = tmp_path / "remove-me"
    flag.write_text("x")
    rc = launch_processes([_child("import time; time.sleep(60)", 0), _child("import os; os.kill(os.getpid(), 9)", 1)],
                          launcher="prism test", timeout_s=30.0, grace_s=1.0, remove=[flag])
    err = capfd.readouterr().err
    assert rc == 137
    assert "prism test: real rank 11 (process 1) ended with killed by signal 9 (SIGKILL, exit code 137); " \
           "stopping the other 1 real rank(s)" in err
    assert not flag.exists()


def test_a_lone_rank_that_refused_its_input_leaves_its_one_line_alone(capfd: pytest.CaptureFixture[str]) -> None:
    refuse = "import sys; print('prism: invalid input: --flag: use --other', file=sys.stderr); sys.exit(2)"
    assert launch_processes([_child(refuse, 0)], launcher="prism test", timeout_s=30.0, grace_s=1.0) == 2
    assert capfd.readouterr().err.strip().splitlines() == ["prism: invalid input: --flag: use --other"]
    # beside another rank, the launcher still says whom it stops
    assert launch_processes([_child("import time; time.sleep(60)", 0), _child(refuse, 1)], launcher="prism test",
                            timeout_s=30.0, grace_s=1.0) == 2
    assert "real rank 11 (process 1) ended with exit code 2; stopping the other 1" in capfd.readouterr().err


def test_watch_loop_sigkills_a_child_that_ignores_sigterm(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    ready = tmp_path / "ignoring"
    ignore = (f"import pathlib, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
              f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)")
    fail = (f"import pathlib, time\nwhile not pathlib.Path({str(ready)!r}).exists(): time.sleep(0.01)\n"
            "raise SystemExit(5)")
    rc = launch_processes([_child(ignore, 0), _child(fail, 1)], launcher="prism test", timeout_s=30.0, grace_s=0.5)
    err = capfd.readouterr().err
    assert rc == 5
    assert "prism test: real rank 10 (process 0) did not stop within 0.5 s; sending SIGKILL" in err


def test_watch_loop_timeout_is_124(capfd: pytest.CaptureFixture[str]) -> None:
    rc = launch_processes([_child("import time; time.sleep(60)", 0)], launcher="prism test", timeout_s=0.5)
    assert rc == 124
    assert "prism test: the job ran past its 0.5 s limit; killing 1 real rank(s)" in capfd.readouterr().err
