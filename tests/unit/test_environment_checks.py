"""Settings given as environment variables are checked by the launcher, before any process starts (issue 19).

Each bad case used to surface inside the rank after the job ran: a timeline or Kineto path naming a file
(FileExistsError at exit, summary lost), a snapshot path without {rank} for two real ranks (one corrupt pickle,
exit 0), a directory that cannot be created, a mistyped placeholder written literally, garbage attention or MoE
routing on a program that never reads them, a bad virtual-time value (a ConfigError traceback, exit code 0).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_plugin.cli.main import main
from prism_plugin.config.errors import ConfigError
from prism_plugin.launch.preflight import ENVIRONMENT, check_environment


def _cases(tmp: Path) -> list[tuple[dict[str, str], tuple[int, ...], str]]:
    afile = tmp / "afile"
    afile.write_text("x")
    return [
        ({"PRISM_TIMELINE": str(afile)}, (0,), f"PRISM_TIMELINE {str(afile)!r} is a file, not a directory"),
        ({"PRISM_KINETO": str(afile / "k")}, (0,), f"its parent {str(afile)!r} is a file"),
        ({"PRISM_MEMORY_SNAPSHOT": str(tmp / "snap.pickle")}, (0, 1),
         "the 2 real ranks would all write this one file; put {rank} in the name"),
        ({"PRISM_MEMORY_SNAPSHOT": str(tmp / "r{rnak}.pickle")}, (0,), "unknown placeholder {rnak}; the one"),
        ({"PRISM_MEMORY_SNAPSHOT": str(tmp)}, (0,), "is a directory; name the snapshot file"),
        ({"PRISM_MEMORY_SNAPSHOT": str(afile / "r{rank}.pickle")}, (0,), f"the directory {str(afile)!r} is a file"),
        ({"PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES": "lots"}, (0,),
         "PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES='lots': give an integer >= 1"),
        ({"PRISM_VIRTUAL_GPU_OOM": "ignore"}, (0,), "PRISM_VIRTUAL_GPU_OOM='ignore': use one of raise, report"),
        ({"PRISM_KERNEL_MODEL": "bogus"}, (0,), "PRISM_KERNEL_MODEL='bogus': use one of roofline, table, fit"),
        ({"PRISM_VIRTUAL_TIME": "off", "PRISM_PROGRAM_TIME": "emulated"}, (0,), "keeps no time"),
        ({"PRISM_ATTENTION": "fast"}, (0,), "PRISM_ATTENTION='fast': use one of local, flash"),
        ({"PRISM_MOE_ROUTING": "skew:7,inf"}, (0,), "PRISM_MOE_ROUTING='skew:7,inf': expected 'balanced'"),
        ({"PRISM_KERNEL_MODEL": "fit", "PRISM_KERNEL_FIT": str(afile)}, (0,), str(afile)),  # not an overlay
    ]


def test_each_bad_setting_is_refused_naming_the_variable(tmp_path: Path) -> None:
    for env, ranks, message in _cases(tmp_path):
        with pytest.raises(ConfigError) as exc:
            check_environment(ranks, env)
        assert message in str(exc.value), (env, str(exc.value))
    assert {name for env, _, _ in _cases(tmp_path) for name in env} <= set(ENVIRONMENT)


def test_good_settings_pass_and_create_nothing(tmp_path: Path) -> None:
    env = {"PRISM_TIMELINE": str(tmp_path / "tl"), "PRISM_KINETO": str(tmp_path / "k"),
           "PRISM_MEMORY_SNAPSHOT": str(tmp_path / "snaps" / "rank{rank}.pickle"),
           "PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES": "1000", "PRISM_VIRTUAL_GPU_OOM": "report",
           "PRISM_ATTENTION": "flash", "PRISM_MOE_ROUTING": "skew:7,1.2", "PRISM_VIRTUAL_TIME": "on"}
    check_environment((0, 1), env)
    check_environment((3,), {"PRISM_MEMORY_SNAPSHOT": str(tmp_path / "one.pickle")})  # one real rank: no {rank}
    assert list(tmp_path.iterdir()) == []


def test_prism_run_refuses_before_any_process_or_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "job.py"
    script.write_text("raise SystemExit('the job must not run')\n")
    monkeypatch.setenv("PRISM_MEMORY_SNAPSHOT", str(tmp_path / "snap.pickle"))
    out = tmp_path / "out"
    rc = main(["run", "--world-size", "4", "--real-ranks", "0,1", "--output", str(out), "--", str(script)])
    err = capsys.readouterr().err
    assert rc == 2 and "PRISM_MEMORY_SNAPSHOT=" in err and "put {rank} in the name" in err
    assert not out.exists()
