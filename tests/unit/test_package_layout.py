"""The host package's layout (docs/architecture.md): no import cycle, no import hidden in a
function without its reason beside it, and each layer imports only the layers below it. An import
inside a function counts as any other: it ties the two modules all the same."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from helpers import ROOT

PACKAGE = "pytorch_cuda_build"
# Lowest first. A module may import its own layer and the layers below it, never above.
LAYERS = [
    ("shared", {"errors", "files", "paths", "progress", "console", "ca"}),
    ("model", {"matrix"}),  # matrix.yaml's rows, which every layer above reads
    ("spec", {"spec", "rules"}),  # how a command's options and rules are declared once (arguments.py, jobs/options.py declare them)
    ("engine", {"engine"}),
    ("helpers", {"resolve", "buildkit", "registry"}),  # the stages' helpers
    ("stages", {"stages"}),
    ("jobs", {"jobs"}),
    ("row", {"pipeline", "inputs"}),
    ("commands", {"commands", "scheduler", "checks"}),  # what users run beside the pipeline
    ("tooling", {"tooling"}),  # the project's own: selftest, bench, the pull measure, the second engine
    ("cli", {"arguments", "validate", "cli", "__init__"}),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _target(node: ast.ImportFrom, name: str, path: Path, known: dict[str, Path]) -> list[str]:
    """The package's modules an ImportFrom names (a module, or a module's attribute)."""
    if node.level:
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if not source.startswith(PACKAGE):
        return []
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]


def imports(name: str, path: Path, known: dict[str, Path]) -> tuple[set[str], list[str]]:
    """(the package's modules imported anywhere in the file, a function's body included: such an import
    still ties the two modules; 'file:line' of the imports in functions without their reason beside them)."""
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.update(_target(node, name, path, known))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith(PACKAGE))
    hidden = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1]:
                    hidden.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found, hidden


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: {t for t in imports(name, path, known)[0] if t in known and t != name} for name, path in known.items()}


def test_no_import_cycle(graph):
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_no_import_inside_a_function_without_its_reason_beside_it():
    known = modules()
    hidden = [where for name, path in known.items() for where in imports(name, path, known)[1]]
    assert not hidden, f"imports inside functions with no comment saying why: {hidden}"


def layer(module: str) -> int:
    """The layer of the longest member naming the module (jobs.mounts before jobs)."""
    inner = module.split(".", 1)[1] if "." in module else "__init__"
    keys = [".".join(inner.split(".")[:n]) for n in range(inner.count(".") + 1, 0, -1)]
    return next(i for key in keys for i, (_, members) in enumerate(LAYERS) if key in members)


def test_every_module_has_a_layer(graph):
    for module in graph:
        layer(module)  # StopIteration names a module no layer holds


def test_each_layer_imports_only_its_own_and_those_below(graph):
    upward = [f"{m} ({LAYERS[layer(m)][0]}) imports {t} ({LAYERS[layer(t)][0]})"
              for m, targets in graph.items() for t in sorted(targets) if layer(t) > layer(m)]
    assert not upward, "\n".join(upward)


def test_the_stages_folder_holds_the_stages_in_the_diagrams_order_and_nothing_else():
    from pytorch_cuda_build.stages import STAGES  # the package under test, read for its list

    numbers = [n for n, _, _ in STAGES]
    assert numbers == sorted(numbers) and numbers[0] == 1, STAGES
    on_disk = {p.stem for p in (ROOT / PACKAGE / "stages").glob("*.py")} - {"__init__"}
    assert on_disk == {name for _, name, _ in STAGES}, "stages/ holds exactly the stages STAGES lists; helpers go beside it"
    assert not [p for p in (ROOT / PACKAGE / "stages").iterdir() if p.is_dir() and p.name != "__pycache__"]


def test_the_architecture_page_numbers_the_stages_as_the_package_does():
    from pytorch_cuda_build.stages import STAGES  # the package under test, read for its list

    text = (ROOT / "docs" / "architecture.md").read_text()
    for number, name, _ in STAGES:
        assert f"| `stages/{name}.py` | stage {number}:" in text, f"docs/architecture.md's module map: stages/{name}.py as stage {number}"



def test_each_stage_module_opens_with_its_number():
    from pytorch_cuda_build.stages import STAGES  # the package under test, read for its list

    for number, name, _ in STAGES:
        doc = ast.get_docstring(ast.parse((ROOT / PACKAGE / "stages" / f"{name}.py").read_text())) or ""
        assert doc.startswith((f"Stage {number}:", f"Stage {number},")), f"stages/{name}.py's docstring opens with 'Stage {number}:'"


def test_the_pipelines_diagram_numbers_the_stages_as_the_package_does():
    from pytorch_cuda_build import pipeline  # the package under test, read for its docstring
    from pytorch_cuda_build.stages import STAGES  # the package under test, read for its list

    doc = pipeline.__doc__ or ""
    for number, name, _ in STAGES:
        if name != "publish_index":  # publish's other half: one box in the diagram
            assert f"{number} {name}" in doc, f"pipeline.py's diagram names stage {number} {name}"


# Bad input to a command is found by validation, before anything is touched; what later steps
# find has a class of its own in errors.py (BadValue, BadFile, NotReady, ImageUnfit, ...).
VALIDATION = {"validate", "arguments", "spec", "rules"}  # the engine, the rules, the parser's refusals


def test_only_validation_makes_usage_errors():
    made = [f"{path.relative_to(ROOT)}:{node.lineno}" for name, path in modules().items()
            if name.split(".", 1)[-1] not in VALIDATION
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("UsageError", "UsageErrors")]
    assert not made, f"UsageError made outside validation (raise the finding's own class from errors.py): {made}"


def test_an_import_inside_a_function_is_read(tmp_path):
    """A cycle closed by an import inside a function is a cycle: the graph reads it."""
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def f():\n    from . import a  # here, to hide the cycle\n    return a\n")
    known = {f"{PACKAGE}.a": package / "a.py", f"{PACKAGE}.b": package / "b.py"}
    found, hidden = imports(f"{PACKAGE}.b", package / "b.py", known)
    assert found == {f"{PACKAGE}.a"} and hidden == []  # explained, but still an edge
