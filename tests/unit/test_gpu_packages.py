"""The virtual GPUs' private package folder (`prism_plugin.device.gpu_packages`): on sys.path only when it holds a
package, with typing.override (Python 3.12) given on 3.11."""

from __future__ import annotations

import sys
import typing
from pathlib import Path

import pytest

from prism_plugin.device import gpu_packages


def test_an_empty_folder_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PRISM_GPU_PACKAGES_PATH", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert gpu_packages.packages_path() == tmp_path
    assert gpu_packages.install(["pretrain_gpt.py", "--optimizer", "muon"]) is False
    assert str(tmp_path) not in sys.path


def test_a_folder_with_a_package_goes_last_on_sys_path_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "some_package-1.0.dist-info").mkdir()
    monkeypatch.setenv("PRISM_GPU_PACKAGES_PATH", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    if sys.version_info < (3, 12):
        monkeypatch.delattr(typing, "override", raising=False)
    assert gpu_packages.install(["pretrain_gpt.py", "--optimizer", "adam"]) is False  # not wanted: unchanged
    assert str(tmp_path) not in sys.path
    muon = ["pretrain_gpt.py", "--optimizer=muon"]
    assert gpu_packages.install(muon) is True and gpu_packages.install(muon) is True
    assert sys.path.count(str(tmp_path)) == 1 and sys.path[-1] == str(tmp_path)  # site-packages stay first

    @typing.override  # type: ignore[attr-defined,unused-ignore]
    def f() -> int:
        return 1

    assert f() == 1 and f.__override__ is True  # type: ignore[attr-defined]


def test_the_setup_installs_the_release_megatron_checks() -> None:
    folder = gpu_packages.packages_path()
    found = sorted(p.name for p in folder.glob("emerging_optimizers-*.dist-info"))
    assert found == [f"emerging_optimizers-{gpu_packages.EMERGING_OPTIMIZERS_VERSION}.dist-info"], \
        f"{folder}: run bash scripts/setup_env.sh"


@pytest.mark.parametrize(("argv", "expected"), [
    (["x", "--optimizer", "muon"], True), (["x", "--optimizer", "dist_muon"], True),
    (["x", "--optimizer=soap"], True), (["x", "--optimizer", "adam"], False), (["x", "--optimizer"], False),
    (["x", "--lr", "muon"], False), (["x"], False),
])
def test_only_a_job_asking_for_an_emerging_optimizer_wants_the_package(argv: list[str], expected: bool) -> None:
    assert gpu_packages.wanted(argv) is expected
