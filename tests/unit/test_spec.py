"""spec.py: an option is declared once, as a field of its command's frozen dataclass, and the
parser, validation's defaults, the typed options a handler gets and a child's argv all come
from that field. Offline, no daemon."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from pytorch_cuda_build import arguments, matrix, spec
from pytorch_cuda_build import validate as stage
from pytorch_cuda_build.errors import UsageErrors
from pytorch_cuda_build.jobs.options import JobOptions

from helpers import ROOT


@dataclass(frozen=True)
class WithNewOptions(arguments.BuildOptions):
    """build, plus two options no file of the package names: a flag and a number validation defaults,
    which does nothing without the flag."""

    NEEDS: ClassVar[tuple[tuple[str, str, str], ...]] = (
        *arguments.BuildOptions.NEEDS, ("engine_wait", "stop_after_engine", "it is how long --stop-after-engine waits"))

    stop_after_engine: bool = spec.flag("check the engine and the registry, then stop")
    engine_wait: int = spec.opt(30, "seconds to wait for the engine (default 30)", type=spec.positive_int, later=True)


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        arguments.parser().parse_args(argv)
    return out.getvalue()


def test_a_new_option_is_one_declaration_and_its_handlers_use(monkeypatch):
    """What a new option needs besides its field: nothing. The parser takes it (its help shown,
    its type checked by validation with every other problem), validation fills its default, the
    handler gets it typed, and a child of --all gets it back."""
    monkeypatch.setitem(arguments.COMMAND_OPTIONS, "build", WithNewOptions)
    assert "--stop-after-engine" in _help(["build", "--help"]) and "seconds to wait for the engine" in _help(["build", "--help"])

    parsed = stage.validate(arguments.parser().parse_args(["build", "--torch", "2.7", "--stop-after-engine"]), ROOT / "matrix.yaml")
    options = arguments.options(parsed, matrix=ROOT / "matrix.yaml")
    assert isinstance(options, WithNewOptions) and options.stop_after_engine is True and options.engine_wait == 30  # the handler's use

    with pytest.raises(UsageErrors) as refused:  # a bad value: one line among the others, before anything is touched
        stage.validate(arguments.parser().parse_args(["build", "--torch", "two", "--engine-wait", "0"]))
    assert refused.value.problems == ["argument --engine-wait: must be at least 1, not 0 (see --help)",
                                      "--torch takes a torch version like 2.7 or 2.7.1, not 'two'"]
    with pytest.raises(UsageErrors) as refused:  # its rule, declared with it
        stage.validate(arguments.parser().parse_args(["build", "--torch", "2.7", "--engine-wait", "5"]))
    assert refused.value.problems == ["--engine-wait needs --stop-after-engine: it is how long --stop-after-engine waits"]

    child = dataclasses.replace(options, all=True, engine_wait=5).child_argv(
        matrix.load(ROOT / "matrix.yaml").select("2.7", "12.6"), Path("r.json"), None)
    assert "--stop-after-engine" in child and child[child.index("--engine-wait") + 1] == "5"
    assert not [p for p in (ROOT / "pytorch_cuda_build").rglob("*.py") if "engine_wait" in p.read_text()]


@pytest.mark.parametrize("options", [
    arguments.BuildOptions(matrix=Path("m.yaml"), torch="2.7", cuda="12.1", flavor="devel", no_cache=True, cache_from=("type=gha",),
                           quiet=True, push=True, registry="127.0.0.1:5000/ml", retries=2, allow_vulnerable=("GHSA-1", "PYSEC-2"),
                           compression="zstd"),
    arguments.PublishOptions(torch="2.11", platform="all", registry="h/ns", sign_key=Path("k"), signatures=Path("s")),
    arguments.GpuBundleOptions(torch="2.7", dir=Path("b"), python="3.12", ops_arch="8.0;9.0", limit_mib=10),
    JobOptions(torch="2.7", scheduler="kubernetes", kind="jobset", nodes=2, mount=("/a:/b:ro",), qos="guaranteed",
               cpus_per_node=4, memory_per_node="64Gi", script=("train.py", "--lr", "1e-4")),
])
def test_a_childs_argv_parses_back_to_the_same_options(options, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_REGISTRY", raising=False)
    parsed = arguments.parser().parse_args(spec.argv(options))
    spec.fill_defaults(type(options), parsed)
    assert arguments.options(parsed) == options


def _helps(parser: argparse.ArgumentParser) -> list[str]:
    out = [parser.description or "", parser.epilog or ""]
    for action in parser._actions:
        out.append(action.help or "")
        if isinstance(action, argparse._SubParsersAction):
            out += [choice.help or "" for choice in action._choices_actions]
            for sub in action.choices.values():
                out += _helps(sub)
    return out


def test_no_help_text_says_ci_without_saying_which():
    """Two CIs run this project: its own (.ci/run on our machines) and the GitHub workflow. A help
    text names the one it means."""
    vague = [text for text in _helps(arguments.parser()) if re.search(r"\bCI\b", text)
             and not re.search(r"this project's CI|\.ci/run", text)]
    assert not vague, vague
