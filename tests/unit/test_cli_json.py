"""Issue 14, part 5: long-running commands take ``--json`` (the document on stdout; tables and progress on stderr).

`prism calibrate --json` prints the fit; `prism recipe run --json` without a path prints the result document
(with a path it writes it there, as before). `prism sweep --json` is tested in tests/unit/test_sweep.py and
integration_tests/test_sweep.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prism_plugin.cli.main import main, make_parser
from prism_plugin.cli.recipes import write_json
from prism_plugin.cost.profiles import load_profile

DATA = Path(__file__).resolve().parent / "data" / "nccl_tests"


def test_calibrate_json_prints_the_fit_instead_of_the_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cluster.yaml"
    assert main(["calibrate", "--from-nccl-tests", str(DATA), "--name", "synth", "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)  # stdout is the document alone
    assert doc["schema"] == "prism-calibrate/1" and doc["out"] == str(out) and doc["profile"]["name"] == "synth"
    profile = load_profile(str(out))  # the profile file is still written, and says the same
    assert doc["profile"]["inter_node"]["latency_us"] == pytest.approx(profile.inter_node.latency_us)
    assert doc["measurements"] > 0 and all({"op", "max_rel_error", "sizes"} <= set(r) for r in doc["residuals"])


def test_recipe_run_json_alone_means_stdout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = make_parser()
    assert parser.parse_args(["recipe", "run", "toy-tp2", "--json"]).json == Path("-")
    assert parser.parse_args(["recipe", "run", "--json", "r.json", "toy-tp2"]).json == Path("r.json")
    assert parser.parse_args(["recipe", "run", "toy-tp2"]).json is None
    write_json(Path("-"), {"recipe": "x"})
    assert json.loads(capsys.readouterr().out) == {"recipe": "x"}
    write_json(tmp_path / "sub" / "r.json", {"recipe": "y"})
    assert json.loads((tmp_path / "sub" / "r.json").read_text()) == {"recipe": "y"}


def test_run_json_and_virtual_time_flags_are_checked_before_any_process(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    base = ["run", "--world-size", "8", "--real-ranks", "0"]
    assert main([*base, "--json", str(tmp_path / "r.json"), "--", str(script)]) == 2  # no --output
    assert "give --output too" in capsys.readouterr().err
    assert main([*base, "--kernel-model", "roofline", "--", str(script)]) == 2  # virtual time without virtual GPUs
    assert "add --device virtual-gpu" in capsys.readouterr().err
    assert main([*base, "--device", "virtual-gpu", "--profile", "dgx-h100", "--kernel-model", "table", "--",
                 str(script)]) == 2  # the table model without a table
    assert "--kernel-model table needs --kernel-table <file>" in capsys.readouterr().err
    assert "never runs" not in capsys.readouterr().out
