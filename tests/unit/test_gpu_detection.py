"""Which GPUs a daemon hands out, and how: the NVIDIA runtime (`--gpus all`) or a CDI device
(`--device nvidia.com/gpu=all`, Docker >= 25 with `nvidia-ctk cdi generate`). No daemon: info() is faked."""
from __future__ import annotations

from pytorch_cuda_build.engine import docker_env

CDI_SPEC = """cdiVersion: 0.5.0
kind: nvidia.com/gpu
devices:
- name: all
  containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
"""


class Daemon:
    def __init__(self, **info):
        self._info = info

    def info(self):
        return self._info


def test_the_nvidia_runtime_means_gpus_all():
    assert docker_env.gpu_request(Daemon(Runtimes={"nvidia": {}, "runc": {}})) is docker_env.GPUS_BY_RUNTIME


def test_a_cdi_spec_for_nvidia_gpus_means_the_cdi_device(tmp_path):
    (tmp_path / "nvidia.yaml").write_text(CDI_SPEC)
    req = docker_env.gpu_request(Daemon(Runtimes={"runc": {}}, CDISpecDirs=[str(tmp_path / "absent"), str(tmp_path)]))
    assert req is docker_env.GPUS_BY_CDI
    assert req["Driver"] == "cdi" and req["DeviceIDs"] == ["nvidia.com/gpu=all"]


def test_no_runtime_and_no_nvidia_cdi_spec_means_no_gpu(tmp_path):
    (tmp_path / "other.yaml").write_text(CDI_SPEC.replace("nvidia.com/gpu", "vendor.example/fpga"))
    (tmp_path / "notes.txt").write_text("kind: nvidia.com/gpu\n")  # not a spec file
    assert docker_env.gpu_request(Daemon(Runtimes={"runc": {}}, CDISpecDirs=[str(tmp_path)])) is None
    assert docker_env.gpu_request(Daemon(Runtimes={"runc": {}})) is None  # Docker < 27 reports no CDI dirs
