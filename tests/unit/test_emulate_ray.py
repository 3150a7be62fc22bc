"""`prism emulate --ray`: what a Ray task's run inherits (the driver's job variables, not the worker's)."""

from __future__ import annotations

from prism_plugin.cli.emulate_ray import _job_environment


def test_a_task_runs_in_the_drivers_job_environment() -> None:
    driver = {"PRISM_ATTENTION": "flash", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "HOME": "/home/driver",
              "PYTHONPATH": "/src"}
    worker = {"PRISM_MOE_ROUTING": "skew:1", "HOME": "/home/worker", "PATH": "/usr/bin", "NCCL_ALGO": "Ring"}
    env = _job_environment(driver, worker)
    # the worker's stale job variables go, the driver's come; the rest of the worker's environment stays
    assert env == {"PRISM_ATTENTION": "flash", "CUDA_DEVICE_MAX_CONNECTIONS": "1", "PYTHONPATH": "/src",
                   "HOME": "/home/worker", "PATH": "/usr/bin"}
