"""Each entry point names settings as its users write them (``--prism-*`` in the Megatron drop-in, keys of the
DeepSpeed ``"prism"`` section, plain flags in ``prism run``); a virtual GPU without a profile runs on dgx-h100;
the value policy's stated answers for a program function."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from prism_plugin.config.emulation import EmulationConfig, VirtualWorld
from prism_plugin.config.errors import ConfigError
from prism_plugin.device.values import NoValueError, SiteAnswer, ValuePolicy
from prism_plugin.launch.preflight import DEFAULT_PROFILE, RUN_FLAGS, default_profile_note, respell, spell

DROP_IN = ["x.py", "--prism-world-size", "8", "--prism-real-ranks", "1"]


def _dropin(*flags: str):
    from prism_plugin.adapters.megatron.wrapper import split_prism_flags

    return split_prism_flags([*DROP_IN, *flags])[1]


def test_spell_and_respell_per_entry_point() -> None:
    from prism_plugin.adapters.deepspeed.section import KEY_NAMES
    from prism_plugin.adapters.megatron.wrapper import FLAG_NAMES

    assert spell(RUN_FLAGS, "profile", "dgx-h100") == "--profile dgx-h100"
    assert spell(FLAG_NAMES, "profile", "dgx-h100") == "--prism-profile dgx-h100"
    assert spell(KEY_NAMES, "profile", "dgx-h100") == '"prism.profile": "dgx-h100"'
    assert spell(KEY_NAMES, "world_size", 8192) == '"prism.world_size": 8192'
    message = "e.g. --world-size 8192, or the cluster's ranks per node (--gpus-per-node); Megatron's --profile-ranks"
    assert respell(message, FLAG_NAMES) == ("e.g. --prism-world-size 8192, or the cluster's ranks per node "
                                            "(--prism-gpus-per-node); Megatron's --profile-ranks")
    assert respell(message, KEY_NAMES) == ('e.g. "prism.world_size": 8192, or the cluster\'s ranks per node '
                                           '("prism.gpus_per_node"); Megatron\'s --profile-ranks')
    assert respell(message, RUN_FLAGS) == message


def test_a_virtual_gpu_without_profile_or_gpu_runs_on_dgx_h100_as_a_stated_default() -> None:
    flags = _dropin("--prism-device", "virtual-gpu")
    assert flags.to_config().profile == DEFAULT_PROFILE == "dgx-h100"
    assert flags.policy_defaults() == ({"setting": "--prism-profile", "value": "dgx-h100",
                                        "reason": "--prism-device virtual-gpu without --prism-profile or "
                                                  "--prism-gpu"},)
    for named in (("--prism-profile", "dgx-a100"), ("--prism-gpu", "h100-sxm")):
        flags = _dropin("--prism-device", "virtual-gpu", *named)
        assert flags.policy_defaults() == ()
        assert flags.to_config().profile == ("dgx-a100" if named[0] == "--prism-profile" else "local-cpu-gloo")
    assert _dropin().policy_defaults() == () and _dropin().to_config().profile == "local-cpu-gloo"


def test_the_default_is_said_in_one_line_spelled_for_the_entry_point() -> None:
    from prism_plugin.adapters.deepspeed.section import KEY_NAMES
    from prism_plugin.adapters.megatron.wrapper import FLAG_NAMES

    assert default_profile_note(FLAG_NAMES) == (
        "prism: --prism-device virtual-gpu without --prism-profile or --prism-gpu: running on profile dgx-h100 "
        "(8 H100 SXM per node, its links and kernel figures); name another with --prism-profile <name>")
    assert default_profile_note(KEY_NAMES).startswith(
        'prism: "prism.device": "virtual-gpu" without "prism.profile" or "prism.gpu": running on profile dgx-h100')


@pytest.mark.parametrize(("flags", "message"), [
    (("--prism-world-size", "0"), "--prism-world-size 0: give an integer >= 1, e.g. 8192"),
        (("--prism-world-size", "12"), "or the cluster's ranks per node (--prism-gpus-per-node)"),
    (("--prism-data-policy", "recorded"), "needs --prism-replay DIR: the directory a recording run wrote "
                                              "(run it with --prism-record DIR first)"),
])
def test_drop_in_messages_name_the_prism_flags(flags: tuple[str, ...], message: str) -> None:
    from prism_plugin.adapters.megatron.wrapper import split_prism_flags

    argv = [*DROP_IN, *flags] if flags[0] != "--prism-world-size" else ["x.py", *flags, "--prism-real-ranks", "1"]
    with pytest.raises(ConfigError) as info:
        split_prism_flags(argv)[1].to_config()
    assert message in str(info.value)
    assert " --world-size" not in str(info.value) and "(--gpus-per-node)" not in str(info.value)


def test_a_profile_without_a_gpu_is_refused_naming_each_entry_points_settings() -> None:
    from prism_plugin.adapters.deepspeed.section import KEY_NAMES
    from prism_plugin.adapters.megatron.wrapper import FLAG_NAMES
    from prism_plugin.runtime.device_session import resolve_gpu

    config = EmulationConfig(world=VirtualWorld(world_size=8, real_ranks=(0,)), profile="local-cpu-gloo",
                             device="virtual-gpu")
    expected = {
        "run": "--device virtual-gpu needs a GPU model: profile 'local-cpu-gloo' names none; use a GPU profile "
               "(--profile dgx-h100) or name the model (--gpu h100-sxm)",
        "drop-in": "--prism-device virtual-gpu needs a GPU model: profile 'local-cpu-gloo' names none; use a GPU "
                   "profile (--prism-profile dgx-h100) or name the model (--prism-gpu h100-sxm)",
        "deepspeed": '"prism.device": "virtual-gpu" needs a GPU model: profile \'local-cpu-gloo\' names none; use a '
                     'GPU profile ("prism.profile": "dgx-h100") or name the model ("prism.gpu": "h100-sxm")',
    }
    for entry, names in (("run", RUN_FLAGS), ("drop-in", FLAG_NAMES), ("deepspeed", KEY_NAMES)):
        with pytest.raises(ConfigError) as info:
            resolve_gpu(config, flags=names)
        assert str(info.value) == expected[entry]


def test_the_drop_in_launcher_checks_the_gpu_model_without_importing_torch() -> None:
    """The drop-in's launcher process only checks the GPU model and starts the job's process, which imports torch
    itself: importing torch there too cost each launch ~2.3 s (a fresh interpreter, so nothing was imported)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from prism_plugin.adapters.megatron.virtual import library_env\n"
            "from prism_plugin.config.emulation import EmulationConfig, VirtualWorld\n"
            "from prism_plugin.runtime.device_session import resolve_gpu\n"
            "world = VirtualWorld(world_size=8, real_ranks=(0,))\n"
            "assert resolve_gpu(EmulationConfig(world=world, profile='dgx-h100', device='virtual-gpu')).name\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout[-2000:]


def test_the_deepspeed_section_defaults_a_virtual_gpu_to_dgx_h100_and_spells_its_keys() -> None:
    from prism_plugin.adapters.deepspeed.section import parse_section

    section = parse_section({"prism": {"world_size": 8, "real_ranks": [0], "device": "virtual-gpu"}})
    assert section.emulation.profile == "dgx-h100"
    assert [d["setting"] for d in section.policy_defaults] == ['"prism.profile"']
    named = parse_section({"prism": {"world_size": 8, "real_ranks": [0], "device": "virtual-gpu", "gpu": "h100"}})
    assert named.policy_defaults == () and named.emulation.profile == "local-cpu-gloo"
    with pytest.raises(ConfigError, match=r'the cluster\'s ranks per node \("prism.gpus_per_node"\)'):
        parse_section({"prism": {"world_size": 12, "real_ranks": [0]}})


def _read_in_logging_function(policy: ValuePolicy, tensor: torch.Tensor) -> bool | int | float:
    return policy.read(tensor)


def test_a_stated_answer_answers_reads_in_its_function_and_is_counted() -> None:
    policy = ValuePolicy()
    with FakeTensorMode():
        count = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(NoValueError, match=r"reads the value of a torch.int64 tensor .*\(--device real\)"):
        _read_in_logging_function(policy, count)
    policy.real_device_hint = "--prism-device real"
    with pytest.raises(NoValueError, match=r"\(--prism-device real\)"):
        _read_in_logging_function(policy, count)
    policy.state(SiteAnswer(path_suffix="tests/unit/test_entry_point_messages.py",
                            function="_read_in_logging_function", value=0, reason="no zero gradients"))
    assert _read_in_logging_function(policy, count) == 0
    with pytest.raises(NoValueError):  # another function: no stated answer there
        policy.read(count)
    summary = policy.summary()
    assert [(s["value"], s["count"]) for s in summary["by_site"]] == [("0", 1)]
    assert summary["by_site"][0]["site"].endswith("(_read_in_logging_function)")
    assert summary["stated"] == [{"function": "tests/unit/test_entry_point_messages.py:_read_in_logging_function",
                                  "value": 0, "reason": "no zero gradients"}]


def test_megatrons_count_of_zero_gradients_has_a_stated_answer_and_tensorboard_a_note(monkeypatch) -> None:
    from prism_plugin.adapters.megatron import log_values

    policy = ValuePolicy()
    log_values.state_answers(policy)
    assert policy.stated == [log_values.COUNT_ZEROS, log_values.SINKHORN, log_values.FSDP_BOUNDARIES]
    assert log_values.FSDP_BOUNDARIES.matches(
        "/venv/site-packages/megatron/core/distributed/fsdp/src/megatron_fsdp/uneven_dtensor.py",
        "validate_uneven_dtensor") and log_values.FSDP_BOUNDARIES.value is True
    assert log_values.SINKHORN.matches("/venv/site-packages/megatron/core/transformer/moe/moe_utils.py", "sinkhorn")
    assert log_values.SINKHORN.value is False  # one iteration: `while error > tol` ends after the first
    assert log_values.COUNT_ZEROS.matches("/venv/site-packages/megatron/core/optimizer/clip_grads.py",
                                          "count_zeros_fp32")
    monkeypatch.setattr(log_values.importlib.util, "find_spec", lambda name: None)
    assert log_values.tensorboard_note(type("Args", (), {"tensorboard_dir": None})()) is None
    args = type("Args", (), {"tensorboard_dir": "/tb", "log_timers_to_tensorboard": True})()
    assert log_values.tensorboard_note(args) == (
        "prism: --tensorboard-dir --log-timers-to-tensorboard: the tensorboard package is not installed on this "
        "host, so Megatron writes no TensorBoard events to /tb (its warning follows); the job runs on; pip install "
        "tensorboard to write them")


def test_wandb_is_refused_without_the_package_and_runs_offline_without_a_server(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """--wandb-project: no wandb package is a clear refusal up front (Megatron's last rank would fail to import it);
    with the package, an unreachable server (a closed local port here) sets WANDB_MODE=offline and says so; a
    WANDB_MODE the launch set is left alone."""
    import socket

    from prism_plugin.adapters.megatron import log_values
    from prism_plugin.config.errors import ConfigError

    args = type("Args", (), {"wandb_project": "llama"})()
    assert log_values.wandb_mode(type("Args", (), {"wandb_project": None})(), {}) is None
    monkeypatch.setattr(log_values.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^--wandb-project llama: the wandb package is not installed on this host "
                                          r"\(Megatron's last rank imports it at start-up\); pip install wandb, or "
                                          r"leave out --wandb-project$"):
        log_values.wandb_mode(args, {})
    monkeypatch.setattr(log_values.importlib.util, "find_spec", lambda name: object())  # as if installed
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    environ = {"WANDB_BASE_URL": url}
    assert log_values.wandb_mode(args, environ) == (
        f"prism: --wandb-project llama: no W&B server reachable at {url} from this host, so W&B runs offline "
        "(WANDB_MODE=offline; `wandb sync` uploads the run later)")
    assert environ["WANDB_MODE"] == "offline"
    chosen = {"WANDB_BASE_URL": url, "WANDB_MODE": "disabled"}
    assert log_values.wandb_mode(args, chosen) is None and chosen["WANDB_MODE"] == "disabled"
    with socket.socket() as server:  # a reachable server: nothing changes
        server.bind(("127.0.0.1", 0))
        server.listen()
        reachable = {"WANDB_BASE_URL": f"http://127.0.0.1:{server.getsockname()[1]}"}
        assert log_values.wandb_mode(args, reachable) is None and "WANDB_MODE" not in reachable
