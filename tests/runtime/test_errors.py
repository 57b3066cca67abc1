"""The in-image package's one exception tree (pytorch_cuda_runtime/errors.py): every exception
class it defines is a PytorchCudaError, except those errors.py names as apart on purpose. Read
from the source (ast), so that a module needing torch is read without importing it."""
from __future__ import annotations

import ast
import importlib
import os

from pytorch_cuda_runtime import errors

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "pytorch_cuda_runtime")
# errors.py's list: a signal, the lone-file scripts' own errors, the stand-in for pynvml's.
APART = {"Interrupted", "NinjaLogError", "UnknownBuilder", "NoArchList", "LayerError", "LockFormatError", "NVMLError"}


def exception_classes() -> dict[str, str]:
    """class name -> module, for every class of the package whose bases name an exception."""
    found = {}
    for folder, _, names in os.walk(PACKAGE):
        for name in names:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            module = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".").removesuffix(".__init__")
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ClassDef) and any(
                        isinstance(b, ast.Name) and (b.id.endswith(("Error", "Exception")) or b.id in found) for b in node.bases):
                    found[node.name] = module
    return found


def test_every_error_the_package_raises_on_purpose_is_one_of_its_tree():
    classes = exception_classes()
    assert {"ServiceError", "LaunchError", "HostlistError", "PreflightError", "Stop"} <= set(classes)
    assert APART <= set(classes), APART - set(classes)  # the list names classes that exist
    for name, module in classes.items():
        if name in APART or name == "PytorchCudaError":
            continue
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, errors.PytorchCudaError), f"{module}.{name} is outside the tree"
    text = open(os.path.join(PACKAGE, "errors.py")).read()
    assert all(name in text for name in APART | set(classes)), "errors.py's docstring draws every class"


def test_a_host_list_error_is_still_a_value_error():
    from pytorch_cuda_runtime.hostlist import HostlistError

    assert issubclass(HostlistError, ValueError) and issubclass(HostlistError, errors.PytorchCudaError)
