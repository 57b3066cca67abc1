"""The in-image package's one exception tree: every error it raises on purpose is a PytorchCudaError,
so a caller (an entrypoint, the launch contract, the preflight, gpucheck) can tell ours from a bug.

    PytorchCudaError            one line for the user
    ├── ServiceError            services.py: the container's entrypoint (code 2 bad input, 1 environment)
    ├── LaunchError             launch/: no launch can be made of this environment or these arguments
    ├── HostlistError           hostlist.py: a Slurm host list that does not parse (a ValueError too)
    ├── PreflightError          preflight/: a usage or environment problem before any check runs
    └── Stop                    gpurunner.py: a gpucheck step failed so that the rest cannot run

Apart from it, on purpose:
- Interrupted (interrupt.py) is a BaseException, like KeyboardInterrupt: a signal, not an error.
- The scripts a build step runs as a lone file have no package around them there, so their errors
  are their own, each turned into one line and an exit code by its main(): NinjaLogError (ninjalogs.py), UnknownBuilder
  (cpuops.py), NoArchList (torchfacts.py), LayerError (wheellayer.py); and LockFormatError
  (lockfile.py), which wheellayer.py and toolkit.py import as a file beside them in a build step.
- NVMLError (preflight/fakenvml.py) stands in for pynvml's, which the code it tests catches.

Standard library only, like every module the images import before torch.
"""
from __future__ import annotations


class PytorchCudaError(Exception):
    """An error this package raises on purpose; its message is one line for the user."""
