"""Launching DeepSpeed scripts under emulation: torchrun, the deepspeed launcher, the patched release.

- torchrun --nproc-per-node 2 and ``deepspeed --num_gpus 2`` (it runs on CPU): the script's one change
  is ``prism_plugin.deepspeed.init_distributed(config)``; the two processes play ranks 0 and 5 of 8,
  rendezvous through the launcher's MASTER_ADDR:MASTER_PORT, and see LOCAL_RANK 0 and 1 (their
  physical index); both launchers give the same losses.
- the startup hook setup installs (`prism_plugin.startup`): an unmodified script emulates from the section alone,
  under python and under the deepspeed launcher, with stock DeepSpeed;
- ``patches/deepspeed-0.19.8``: applied to a copy of the installed DeepSpeed, an unmodified script
  emulates from the config's "prism" section alone, through ``deepspeed.initialize`` (ZeRO) and through
  ``deepspeed.init_distributed()`` with PRISM_DEEPSPEED_CONFIG (PipelineModule builds groups earlier).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "ds_train.py"
PATCH_DIR = REPO / "patches" / "deepspeed-0.19.8"
BIN = Path(sys.executable).parent


def _config(path: Path, *, real_ranks: list[int], world_size: int, output: Path, stage: int = 2) -> Path:
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2 if stage == 1 else 1,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "steps_per_print": 10**6,
        "prism": {"world_size": world_size, "real_ranks": real_ranks, "timing": False, "output": str(output),
                  "pipe_activations": {"shape": [2, 16]}},
    }))
    return path


def _free_port() -> int:
    with socket.socket() as s:  # the launchers need a port; a collision fails loudly, never hangs
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _results(proc: subprocess.CompletedProcess, out_dir: Path) -> dict[int, dict]:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["rank"]: r for r in (json.loads(p.read_text()) for p in sorted(out_dir.glob("result*.json")))}


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def test_torchrun_and_deepspeed_launcher(tmp_path):
    config = _config(tmp_path / "ds.json", real_ranks=[0, 5], world_size=8, output=tmp_path / "out")
    launches = {
        "torchrun": [str(BIN / "torchrun"), "--nproc-per-node", "2", "--master-port", str(_free_port())],
        "deepspeed": [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port())],
    }
    for name in launches:
        (tmp_path / name).mkdir()
    procs = {name: subprocess.Popen([*cmd, str(SCRIPT), "--config", str(config), "--dropin", "--out", name],
                                    env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for name, cmd in launches.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        results[name] = _results(subprocess.CompletedProcess(proc.args, proc.returncode, out, err), tmp_path / name)
    for name, per_rank in results.items():
        assert sorted(per_rank) == [0, 5], name
        assert all(r["world_size"] == 8 and r["backend"] == "gloo" for r in per_rank.values())
        assert per_rank[0]["local_rank"] == 0 and per_rank[5]["local_rank"] == 1
    assert results["torchrun"] == results["deepspeed"]
    for rank in (0, 5):
        summary = json.loads((tmp_path / "out" / f"rank{rank}.summary.json").read_text())
        assert summary["world_size"] == 8 and summary["real_ranks"] == [0, 5]


def _installed_deepspeed() -> Path:
    """The installed package's folder, found without importing it (an import costs seconds)."""
    version = importlib.metadata.version("deepspeed")
    assert version.startswith("0.19.8"), f"the patches target deepspeed 0.19.8, installed {version}"
    return Path(importlib.util.find_spec("deepspeed").origin).parent


def _patched_copy(tmp_path: Path) -> Path:
    site = tmp_path / "site"
    shutil.copytree(_installed_deepspeed(), site / "deepspeed",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for patch in sorted(PATCH_DIR.glob("*.patch")):
        check = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "-i", str(patch)], cwd=site,
                               capture_output=True, text=True)
        assert check.returncode == 0 and "fuzz" not in check.stdout and "offset" not in check.stdout, check.stdout
        subprocess.run(["patch", "-p1", "--forward", "-i", str(patch)], cwd=site, check=True, capture_output=True)
    return site


def test_patched_deepspeed_honours_prism_section(tmp_path):
    site = _patched_copy(tmp_path)
    zero_cfg = _config(tmp_path / "zero.json", real_ranks=[5], world_size=16, output=tmp_path / "out_zero")
    pipe_cfg = _config(tmp_path / "pipe.json", real_ranks=[9], world_size=16, output=tmp_path / "out_pipe", stage=1)
    env = _env(PYTHONPATH=os.pathsep.join([str(site), str(REPO)]), LOCAL_RANK="0")
    runs = {
        # unmodified script; deepspeed.initialize reads the section (the patch's __init__ hook)
        "zero": (["--config", str(zero_cfg), "--mode", "zero"], env),
        # unmodified script; deepspeed.init_distributed() reads PRISM_DEEPSPEED_CONFIG (the comm hook)
        "pipe": (["--config", str(pipe_cfg), "--mode", "pipe"], {**env, "PRISM_DEEPSPEED_CONFIG": str(pipe_cfg)}),
    }
    for name in runs:
        (tmp_path / name).mkdir()
    procs = {name: subprocess.Popen([sys.executable, str(SCRIPT), *args, "--out", name], env=e, cwd=tmp_path,
                                    text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, (args, e) in runs.items()}
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=240)
        out[name] = _results(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), tmp_path / name)
    assert out["zero"][5]["world_size"] == 16 and out["zero"][5]["backend"] == "gloo"
    assert out["pipe"][9]["world_size"] == 16 and out["pipe"][9]["backend"] == "gloo"
    # rank 9 of 2 stages x DP 8 is the last stage: it computes real (positive) losses
    assert all(x > 0 for x in out["pipe"][9]["losses"])
    assert (tmp_path / "out_zero" / "rank5.summary.json").is_file()
    assert (tmp_path / "out_pipe" / "rank9.summary.json").is_file()
    # the copy really is the patched one, and the pristine install is untouched
    assert "_prism_hook" in (site / "deepspeed" / "comm" / "comm.py").read_text()
    assert "_prism_hook" not in (_installed_deepspeed() / "comm" / "comm.py").read_text()


def test_the_startup_hook_emulates_an_unedited_script_from_its_section(tmp_path):
    """``scripts/setup_env.sh`` installs ``prism_plugin_startup.pth`` (`prism_plugin.startup`): the unedited script
    (no ``--dropin``), stock DeepSpeed, no environment variable. ``deepspeed.initialize(config=...)`` reads the
    section (ZeRO); ``deepspeed.init_distributed()`` with no config finds it on the command line (``--config``, a
    JSON file with a "prism" key: what a PipelineModule script or Accelerate's early init needs); the ``deepspeed``
    launcher's two processes play ranks 0 and 5 of 8."""
    import sysconfig

    pth = Path(sysconfig.get_paths()["purelib"]) / "prism_plugin_startup.pth"
    assert pth.read_text().strip() == "import prism_plugin.startup"
    assert "_prism_hook" not in (_installed_deepspeed() / "comm" / "comm.py").read_text()  # not the patch
    zero_cfg = _config(tmp_path / "zero.json", real_ranks=[5], world_size=16, output=tmp_path / "out_zero")
    pipe_cfg = _config(tmp_path / "pipe.json", real_ranks=[9], world_size=16, output=tmp_path / "out_pipe", stage=1)
    launch_cfg = _config(tmp_path / "launch.json", real_ranks=[0, 5], world_size=8, output=tmp_path / "out_launch")
    env = _env(LOCAL_RANK="0")
    env.pop("PRISM_DEEPSPEED_CONFIG", None)
    runs = {
        "zero": [sys.executable, str(SCRIPT), "--config", str(zero_cfg), "--mode", "zero"],
        "pipe": [sys.executable, str(SCRIPT), "--config", str(pipe_cfg), "--mode", "pipe"],
        "launch": [str(BIN / "deepspeed"), "--num_gpus", "2", "--master_port", str(_free_port()), str(SCRIPT),
                   "--config", str(launch_cfg), "--mode", "zero"],
    }
    for name in runs:
        (tmp_path / name).mkdir()
    # the two one-process runs at once (as in test_patched_deepspeed_honours_prism_section), then the launcher's two
    procs = {name: subprocess.Popen([*runs[name], "--out", name], env=env, cwd=tmp_path, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE) for name in ("zero", "pipe")}
    out = {}
    for name, popen in procs.items():
        stdout, stderr = popen.communicate(timeout=240)
        out[name] = _results(subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr), tmp_path / name)
    proc = subprocess.run([*runs["launch"], "--out", "launch"], env=_env(), cwd=tmp_path, text=True,
                          capture_output=True, timeout=240)
    out["launch"] = _results(proc, tmp_path / "launch")
    assert out["zero"][5]["world_size"] == 16 and out["pipe"][9]["world_size"] == 16
    assert all(x > 0 for x in out["pipe"][9]["losses"])  # the last of 2 stages: real losses
    assert sorted(out["launch"]) == [0, 5] and all(r["world_size"] == 8 for r in out["launch"].values())
    for directory, rank in (("out_zero", 5), ("out_pipe", 9), ("out_launch", 0), ("out_launch", 5)):
        assert (tmp_path / directory / f"rank{rank}.summary.json").is_file()


def test_crashed_virtual_dp_peer_fails_deepspeed_in_its_own_code_path(tmp_path):
    """``"faults": ["crash:rank=1,step=1"]`` in the "prism" section: real rank 0's ZeRO-2 data-parallel peer dies
    at step 1. DeepSpeed's own parameter all-gather after the first optimizer step raises gloo's peer-death
    error there, the script exits non-zero, and rank 0's summary carries the crash event."""
    config = _config(tmp_path / "ds.json", real_ranks=[0], world_size=2, output=tmp_path / "out")
    doc = json.loads(config.read_text())
    doc["prism"]["faults"] = ["crash:rank=1,step=1"]
    config.write_text(json.dumps(doc))
    (tmp_path / "r").mkdir()
    proc = subprocess.run([sys.executable, str(SCRIPT), "--config", str(config), "--dropin", "--out", "r"],
                          env=_env(LOCAL_RANK="0"), cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0 and "DS_RESULT" not in proc.stdout
    err = proc.stderr
    assert "Connection reset by peer" in err and "deepspeed/runtime/utils.py" in err, err[-3000:]
    assert "prism: fault crash:rank=1,step=1: rank 0 raises" in proc.stderr
    events = json.loads((tmp_path / "out" / "rank0.summary.json").read_text())["faults"]["events"]
    assert [(e["event"], e["rank"], e["step"], e["op"]) for e in events] == [("crash", 1, 1, "all_gather")]
