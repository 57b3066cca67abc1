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

from pytorch_cuda_build import arguments, cli, matrix, rules, spec
from pytorch_cuda_build import validate as stage
from pytorch_cuda_build.errors import UsageErrors
from pytorch_cuda_build.jobs.options import JobOptions

from helpers import ROOT


@dataclass(frozen=True)
class WithNewOptions(arguments.BuildOptions):
    """build, plus three options no file of the package names: a flag; a number validation defaults,
    which does nothing without the flag and has a rule of its own; a name of a declared form."""

    NEEDS: ClassVar[tuple[tuple[str, str, str], ...]] = (
        *arguments.BuildOptions.NEEDS, ("engine_wait", "stop_after_engine", "it is how long --stop-after-engine waits"))

    stop_after_engine: bool = spec.flag("check the engine and the registry, then stop")
    engine_wait: int = spec.opt(30, "seconds to wait for the engine (default 30)", type=spec.positive_int, later=True)
    engine_name: str | None = spec.opt(None, "the engine to check", check=rules.form(r"[a-z]+", "a lowercase name"))

    def rules(self, c: rules.Checks) -> None:
        super().rules(c)
        if self.engine_wait is not None and self.engine_wait > 600 and not self.all:
            c.fail("engine_wait", f"--engine-wait {self.engine_wait} outlasts a row's build step; at most 600 without --all")


def _help(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.parser().parse_args(argv)
    return out.getvalue()


def test_a_new_option_is_its_declaration_its_rule_and_its_handlers_use(monkeypatch):
    """What a new option needs: its field (and its rule) on its command's class, and its handler's
    use of it; nothing else. The parser takes it (its help shown, its type checked by validation with
    every other problem), validation runs its rules and fills its default, the handler gets it typed,
    and a child of --all gets it back."""
    got: list[WithNewOptions] = []

    def handler(m: matrix.Matrix, args: WithNewOptions) -> int:  # the handler's use: it reads the options it is given
        got.append(args)
        return 7 if args.stop_after_engine else 0

    build = next(h for h in cli.COMMANDS if h.options is arguments.BuildOptions)
    monkeypatch.setattr(cli, "COMMANDS", tuple(cli.Handler(WithNewOptions, handler, build.lost) if h is build else h
                                                for h in cli.COMMANDS))
    assert "--stop-after-engine" in _help(["build", "--help"]) and "seconds to wait for the engine" in _help(["build", "--help"])

    assert cli.main(["build", "--torch", "2.7", "--stop-after-engine", "--engine-name", "second"]) == 7
    options = got[0]
    assert isinstance(options, WithNewOptions) and options.stop_after_engine is True and options.engine_wait == 30
    assert options.engine_name == "second" and options.matrix == ROOT / "matrix.yaml"

    with pytest.raises(UsageErrors) as refused:  # bad values: one line each among the others, before anything is touched
        stage.validate(cli.parser().parse_args(["build", "--torch", "two", "--engine-wait", "0", "--engine-name", "Two"]))
    assert refused.value.problems == ["argument --engine-wait: must be at least 1, not 0 (see --help)",
                                      "--torch takes a torch version like 2.7 or 2.7.1, not 'two'",
                                      "--engine-name takes a lowercase name, not 'Two'"]
    with pytest.raises(UsageErrors) as refused:  # its rules, declared with it
        stage.validate(cli.parser().parse_args(["build", "--torch", "2.7", "--engine-wait", "5"]))
    assert refused.value.problems == ["--engine-wait needs --stop-after-engine: it is how long --stop-after-engine waits"]
    with pytest.raises(UsageErrors) as refused:
        stage.validate(cli.parser().parse_args(["build", "--torch", "2.7", "--stop-after-engine", "--engine-wait", "900"]))
    assert refused.value.problems == ["--engine-wait 900 outlasts a row's build step; at most 600 without --all"]
    assert not got[1:]  # refused before the handler

    child = dataclasses.replace(options, all=True, engine_wait=5).child_argv(
        matrix.load(ROOT / "matrix.yaml").select("2.7", "12.6"), Path("r.json"))
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
    parsed = cli.parser().parse_args(spec.argv(options))
    spec.fill_defaults(type(options), parsed)
    assert spec.complete(spec.command_class(parsed), parsed) == options


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
    vague = [text for text in _helps(cli.parser()) if re.search(r"\bCI\b", text)
             and not re.search(r"this project's CI|\.ci/run", text)]
    assert not vague, vague
