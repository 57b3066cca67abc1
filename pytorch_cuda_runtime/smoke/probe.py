"""Child process: report versions and devices as the libraries see them (JSON on stdout).

Runs in a child so the orchestrator never imports torch or DeepSpeed itself: a
broken library then shows up as a failed check, not a crashed suite.
"""
import json
import platform
import sys


def torch_facts():
    import torch
    f = {"torch": torch.__version__, "torch_cuda": torch.version.cuda,
         "cuda_available": torch.cuda.is_available(),
         "cuda_device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    try:
        f["cudnn"] = torch.backends.cudnn.version()
    except Exception as e:  # CPU-only torch builds have no cuDNN
        f["cudnn_error"] = repr(e)
    try:
        f["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception as e:
        f["nccl_error"] = repr(e)
    try:  # get_arch_list() is [] without a GPU; the compiled-in flags are not
        f["arch_list"] = torch._C._cuda_getArchFlags().split()
    except Exception as e:
        f["arch_list_error"] = repr(e)
    f["devices"] = [{"index": i, "name": torch.cuda.get_device_name(i),
                     "capability": "%d.%d" % torch.cuda.get_device_capability(i)}
                    for i in range(f["cuda_device_count"])]
    return f


def deepspeed_facts():
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import accelerator_name, installed_ops
    except Exception as e:
        return {"deepspeed_error": repr(e)}
    # Prebuilt ops load only when the run-time accelerator is the one they were built for.
    return {"deepspeed": deepspeed.__version__, "installed_ops": dict(installed_ops),
            "ds_build_accelerator": accelerator_name,
            "ds_runtime_accelerator": get_accelerator()._name}


def main():
    facts = {"python": platform.python_version()}
    try:
        facts.update(torch_facts())
    except Exception as e:
        facts["torch_error"] = repr(e)
    facts.update(deepspeed_facts())
    # Last line of stdout is ours; libraries may log before it.
    sys.stdout.write("\nPROBE " + json.dumps(facts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
