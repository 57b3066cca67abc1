"""Check 2 (GPU only): matmuls, a cuDNN convolution fwd+bwd, arch support, per device.

Runs as its own child process: `python -m pytorch_cuda_runtime.smoke.gpu_basics`.
"""
import os
import sys

from .. import manifest as mf
from .results import Recorder


def _matmul(torch, dev, dtype):
    a = torch.randn(256, 256, device=dev, dtype=dtype)
    b = torch.randn(256, 256, device=dev, dtype=dtype)
    got = (a @ b).float()
    ref = a.float() @ b.float()
    return (got - ref).abs().max().item() / ref.abs().max().item()


def _conv(torch, dev):
    """cuDNN conv forward and backward, compared with the same op on the CPU."""
    torch.backends.cudnn.enabled = True
    x = torch.randn(4, 8, 16, 16, device=dev, requires_grad=True)
    w = torch.randn(16, 8, 3, 3, device=dev, requires_grad=True)
    torch.nn.functional.conv2d(x, w, padding=1).square().mean().backward()
    xc, wc = x.detach().cpu().requires_grad_(), w.detach().cpu().requires_grad_()
    torch.nn.functional.conv2d(xc, wc, padding=1).square().mean().backward()
    return max((x.grad.cpu() - xc.grad).abs().max().item(),
               (w.grad.cpu() - wc.grad).abs().max().item())


def run_device(rec, torch, i, archs):
    dev = torch.device("cuda", i)
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 5e-3)):
        err = _matmul(torch, dev, dtype)
        rec.check(f"gpu.matmul_{str(dtype)[6:]}[cuda:{i}]", err < tol, f"rel err < {tol}",
                  f"{err:.2e}")
    err = _conv(torch, dev)
    rec.check(f"gpu.cudnn_conv_fwd_bwd[cuda:{i}]", err < 1e-2, "grad err < 1e-2", f"{err:.2e}")
    cap = "%d.%d" % torch.cuda.get_device_capability(i)
    ok, how = mf.arch_supported(cap, archs)
    rec.check(f"gpu.arch[cuda:{i}]", ok, f"sm_{cap.replace('.', '')} supported", how,
              detail=torch.cuda.get_device_name(i))


def main():
    import torch
    rec = Recorder(os.environ.get("PCR_RESULTS_DIR"), os.environ.get("PCR_RUN", ""), 0)
    archs = torch.cuda.get_arch_list()
    for i in range(torch.cuda.device_count()):
        try:
            run_device(rec, torch, i, archs)
        except Exception as e:
            rec.add(f"gpu.error[cuda:{i}]", "FAIL", actual=f"{type(e).__name__}: {e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
