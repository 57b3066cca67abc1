"""The devel flavor: the runtime plus the CUDA toolkit its DeepSpeed ops were built with.

Everything here compiles for real and just in time, without a GPU: nvcc, torch's
cpp_extension and DeepSpeed's op builder only need the toolkit to build and the CUDA
runtime libraries to load what they built.
"""
from __future__ import annotations

import json

import pytest

from pytorch_cuda_build import matrix
from pytorch_cuda_build.checks.support import Host

pytestmark = pytest.mark.docker


@pytest.fixture(autouse=True)
def _devel_only(row: matrix.Image) -> None:
    if row.flavor != "devel":
        pytest.skip(f"{row.name} is a {row.flavor} image; the toolkit is in devel only")


def test_nvcc_is_the_toolkit_the_ops_were_built_with(host: Host, lock_meta: dict) -> None:
    env = host.environment()
    assert env["CUDA_HOME"] == "/usr/local/cuda"
    assert env["PATH"].split(":")[0] == "/usr/local/cuda/bin"
    out = host.check_output("nvcc --version")
    version = lock_meta["cuda_toolkit"]
    assert f"V{version}" in out, out
    facts = json.loads(host.file("/opt/pytorch-cuda/ops-facts.json").content_string)
    assert facts["cuda_toolkit"] == version


LOAD_INLINE = """
import os, torch
from torch.utils.cpp_extension import load_inline
cuda = "__global__ void twice(float *x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] *= 2; }\\n" \\
       "void run(torch::Tensor x) { twice<<<(x.numel() + 255) / 256, 256>>>(x.data_ptr<float>(), x.numel()); }\\n"
m = load_inline("twice_ext", cpp_sources="void run(torch::Tensor x);", cuda_sources=cuda, functions=["run"],
                build_directory=os.environ["BUILD"], verbose=False)
assert callable(m.run)
print("LOADED", sorted(os.listdir(os.environ["BUILD"])))
"""


def test_cpp_extension_cuda_kernel_compiles_and_loads_without_a_gpu(host: Host) -> None:
    cmd = host.run(f"export BUILD=$(mktemp -d) TORCH_CUDA_ARCH_LIST=8.0 MAX_JOBS=2; python -c '{LOAD_INLINE}'")
    assert cmd.rc == 0 and "LOADED" in cmd.stdout, cmd.stdout[-2000:] + cmd.stderr[-3000:]
    assert "cuda.cu" in cmd.stdout and "twice_ext.so" in cmd.stdout


# DeepSpeed's own `.load()` picks architectures from the visible GPUs (its JIT mode), so without
# one it has none to compile for. Its cross-compile mode takes TORCH_CUDA_ARCH_LIST instead, as
# for a prebuild: the op's own sources and flags, compiled just in time by torch's loader.
JIT_OP = """
import os
from deepspeed.accelerator import get_accelerator
from deepspeed.git_version_info import installed_ops
from torch.utils.cpp_extension import load
assert not installed_ops.get("fused_lion"), "fused_lion is prebuilt: pick an op that is not"
b = get_accelerator().create_op_builder("FusedLionBuilder")
b.jit_mode = False
m = load(name=b.name, sources=[b.deepspeed_src_path(p) for p in b.sources()],
         extra_include_paths=[b.deepspeed_src_path(p) for p in b.include_paths()],
         extra_cflags=b.strip_empty_entries(b.cxx_args()), extra_cuda_cflags=b.strip_empty_entries(b.nvcc_args()),
         extra_ldflags=b.strip_empty_entries(b.extra_ldflags()), verbose=False)
print("JIT", m.__name__, sorted(os.listdir(os.environ["TORCH_EXTENSIONS_DIR"])))
"""


def test_a_deepspeed_cuda_op_compiles_just_in_time_without_a_gpu(host: Host) -> None:
    cmd = host.run(f"export TORCH_EXTENSIONS_DIR=$(mktemp -d) DS_ACCELERATOR=cuda TORCH_CUDA_ARCH_LIST=8.0 MAX_JOBS=2; python -c '{JIT_OP}'")
    assert cmd.rc == 0 and "JIT fused_lion" in cmd.stdout, cmd.stdout[-2000:] + cmd.stderr[-3000:]
