"""One configuration (issue 19, part 1): one table of settings, every input form derived from it, one validator.

`prism_plugin.config.settings` is the table, `prism_plugin.config.resolve.resolve` the validator; the `prism`
command line, the Megatron drop-in's ``--prism-*`` flags and DeepSpeed's ``"prism"`` keys are derived from the table,
and ``docs/configuration.md`` is generated from it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prism_plugin.config.errors import ConfigError
from prism_plugin.config.reference import DOC_PATH, markdown
from prism_plugin.config.resolve import resolve
from prism_plugin.config.settings import SETTINGS, Entry, by_name, flag_names, from_environ, section_keys

WORLD = {"world_size": "16", "real_ranks": "0,3"}


def test_the_reference_page_is_generated_from_the_table() -> None:
    assert DOC_PATH.read_text() == markdown(), "run python -m prism_plugin.config.reference"
    for s in SETTINGS:
        assert f"| `{s.name}` |" in markdown()


def test_every_entry_point_derives_its_spelling_from_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    from prism_plugin.adapters.deepspeed.section import ALLOWED_KEYS
    from prism_plugin.cli.main import make_parser

    with pytest.raises(SystemExit):
        make_parser().parse_args(["run", "--help"])
    run_help = capsys.readouterr().out
    drop_in, ds = flag_names(Entry.DROP_IN), section_keys()
    for s in SETTINGS:
        if Entry.RUN in s.entries:
            assert s.spelled(Entry.RUN) in run_help
            assert drop_in[s.spelled(Entry.DROP_IN)[2:]] is s
        if Entry.DROP_IN in s.entries:
            assert drop_in[s.spelled(Entry.DROP_IN)[2:]] is s
        if Entry.DEEPSPEED in s.entries:
            assert ds[s.name] is s and s.name in ALLOWED_KEYS
    assert by_name("iterations").entries == {Entry.DROP_IN}  # Megatron's drop-in only: its --train-iters
    assert drop_in["prism-no-timing"] is by_name("timing") and drop_in["prism-fault"] is by_name("faults")
    assert ds["record_dir"] is by_name("record") and ds["trace_max_iterations"] is by_name("trace_iterations")


@pytest.mark.parametrize(("entry", "said"), [
    (Entry.RUN, "--kernel-model tabel: use one of roofline, table, fit"),
    (Entry.DROP_IN, "--prism-kernel-model tabel: use one of roofline, table, fit"),
    (Entry.DEEPSPEED, '"prism.kernel_model": "tabel": use one of roofline, table, fit'),
])
def test_one_validator_names_the_setting_as_each_entry_point_spells_it(entry: Entry, said: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve({**WORLD, "device": "virtual-gpu", "kernel_model": "tabel"}, entry, environ={})
    assert str(info.value) == said
    with pytest.raises(ConfigError) as info:  # the same value as a documented environment alias
        resolve({**WORLD, "device": "virtual-gpu"}, entry, environ={"PRISM_KERNEL_MODEL": "tabel"})
    assert str(info.value) == "PRISM_KERNEL_MODEL='tabel': use one of roofline, table, fit"


def test_a_flag_wins_over_its_environment_alias_and_the_ranks_get_the_result() -> None:
    s = resolve({**WORLD, "device": "virtual-gpu", "virtual_time": "off"}, Entry.DROP_IN,
                environ={"PRISM_VIRTUAL_TIME": "on", "PRISM_ATTENTION": "FLASH", "PRISM_TIMELINE": "off"})
    assert s.time.virtual_time is False and s.megatron.attention == "flash" and s.outputs.timeline == "off"
    assert s.given >= {"virtual_time"} and s.from_environment == {"attention", "timeline"}
    assert s.environ() == {"PRISM_VIRTUAL_TIME": "off", "PRISM_ATTENTION": "flash", "PRISM_TIMELINE": "off"}
    assert resolve(WORLD, Entry.RUN, environ={}).environ() == {}  # nothing given: nothing handed on


def test_the_nested_settings_are_typed_and_fill_the_defaults() -> None:
    s = resolve({**WORLD, "faults": ["straggler:ranks=4-7,factor=1.3"], "replay": None}, Entry.RUN, environ={})
    assert s.world.real_ranks == (0, 3) and s.device.profile == "local-cpu-gloo" and s.device.oom == "raise"
    assert s.time.timing is True and s.time.timeout is None and s.outputs.trace_iterations == 64
    assert s.data.data_policy.value == "mirror" and s.megatron.moe_routing == "balanced"
    assert s.emulation().timeout_s == 1800.0 and s.emulation(timeout_s=600.0).timeout_s == 600.0
    assert [f.to_text() for f in s.emulation().faults] == ["straggler:ranks=4-7,factor=1.3,from_step=0"]


def test_combinations_are_checked_together(tmp_path: Path) -> None:
    cases = [
        ({"kernel_model": "table"}, "--kernel-model table is a setting of virtual GPUs: add --device virtual-gpu"),
        ({"device": "virtual-gpu", "kernel_table": str(tmp_path)},
         "is read by the table kernel model, not by --kernel-model roofline"),
        ({"device": "virtual-gpu", "virtual_time": "off", "program_time": "emulated"},
         "--virtual-time off keeps no time, so --program-time emulated would do nothing"),
        ({"memory_snapshot": "snap.pickle"}, "the 2 real ranks would all write this one file"),
        ({"memory_snapshot": "r{rnak}.pickle"}, "unknown placeholder {rnak}"),
        ({"moe_routing": "skew:7,inf"}, "--moe-routing skew:7,inf: expected 'balanced' or 'skew:SEED[,ALPHA]'"),
        ({"gpus_per_node": "0"}, "--gpus-per-node 0: give an integer >= 1"),
    ]
    for values, words in cases:
        with pytest.raises(ConfigError, match=None) as info:
            resolve({**WORLD, **values}, Entry.RUN, environ={})
        assert words in str(info.value), (values, str(info.value))


def test_a_virtual_gpu_without_profile_or_gpu_is_a_reported_policy_default() -> None:
    s = resolve({**WORLD, "device": "virtual-gpu"}, Entry.DEEPSPEED, environ={})
    assert s.device.profile == "dgx-h100"
    assert s.policy_defaults == ({"setting": '"prism.profile"', "value": "dgx-h100",
                                  "reason": '"prism.device": "virtual-gpu" without "prism.profile" or "prism.gpu"'},)
    assert resolve({**WORLD, "device": "virtual-gpu", "gpu": "b200"}, Entry.RUN, environ={}).policy_defaults == ()


def test_a_rank_reads_its_setting_through_the_same_parser() -> None:
    assert from_environ("oom", {}) == "raise" and from_environ("oom", {"PRISM_VIRTUAL_GPU_OOM": "report"}) == "report"
    with pytest.raises(ConfigError, match="PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES='0': give an integer >= 1"):
        from_environ("memory_snapshot_max_entries", {"PRISM_MEMORY_SNAPSHOT_MAX_ENTRIES": "0"})


def test_the_drop_in_takes_every_setting_and_hands_the_ranks_their_variables() -> None:
    from prism_plugin.adapters.megatron.wrapper import split_prism_flags

    rest, flags = split_prism_flags(["pretrain_gpt.py", "--num-layers", "2", "--prism-world-size", "64",
                                     "--prism-real-ranks", "1", "--prism-device", "virtual-gpu",
                                     "--prism-virtual-time=off", "--prism-oom", "report", "--prism-no-timing"])
    assert rest == ["pretrain_gpt.py", "--num-layers", "2"]
    s = flags.settings(environ={})
    assert s.environ() == {"PRISM_VIRTUAL_TIME": "off", "PRISM_VIRTUAL_GPU_OOM": "report"}
    assert flags.to_config().timeout_s == 600.0  # Megatron's own default (--distributed-timeout-minutes 10)
    with pytest.raises(ConfigError, match="unknown flag --prism-virtual-tme; the prism flags are --prism-world-size"):
        split_prism_flags(["x.py", "--prism-virtual-tme", "off"])


def test_a_recipe_names_its_settings_as_the_table_does() -> None:
    import dataclasses

    from prism_plugin.recipes.schema import Emulation

    recipe_only = {"name", "runs", "compare_with", "ranks", "step_time_adjust", "tolerances", "expect"}
    names = {f.name for f in dataclasses.fields(Emulation)} - recipe_only
    assert names <= {s.name for s in SETTINGS}, names - {s.name for s in SETTINGS}
