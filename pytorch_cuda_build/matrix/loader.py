"""Loading matrix.yaml: parse (YAML, with line numbers) -> validate (the schema, then the rules
across rows; every problem at once, each with its line) -> complete (one Image per row and flavor)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from packaging.version import Version
from pydantic import ValidationError

from ..errors import BadFile, MatrixError, Problem
from .image import Image
from .schema import OS_PLATFORMS, MatrixFile, major_of, minor_of
from .selection import Matrix

# ---- parse -------------------------------------------------------------------


def _line_map(node: yaml.Node, path: tuple[Any, ...] = (), out: dict | None = None) -> dict:
    """Map every key path in the YAML document to its 1-based line number."""
    out = {} if out is None else out
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            child = path + (key.value,)
            out[child] = key.start_mark.line + 1
            _line_map(value, child, out)
            out[child] = key.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _line_map(item, path + (i,), out)
    return out


class _NoDuplicateKeys(yaml.SafeLoader):
    """A repeated key in a mapping is an error, not a silent overwrite."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def parse(path: Path) -> tuple[Any, dict]:
    try:
        text = path.read_text()
    except OSError as e:
        raise BadFile(f"cannot read matrix file {path}: {e.strerror}", path=path) from None
    try:
        node = yaml.compose(text, Loader=_NoDuplicateKeys)
        data = yaml.load(text, Loader=_NoDuplicateKeys)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark else None
        reason = getattr(e, "problem", None) or str(e)
        raise MatrixError(str(path), [Problem("", f"malformed YAML: {reason}", line)]) from None
    if node is None or not isinstance(data, dict):
        raise MatrixError(str(path), [Problem("", "expected a mapping with defaults, oses, platforms and rows", 1)])
    return data, _line_map(node)


# ---- validate and complete -----------------------------------------------------


def _schema_problems(err: ValidationError, lines: dict) -> list[Problem]:
    problems = []
    for e in err.errors():
        loc = tuple(e["loc"])
        line = next((lines[loc[:n]] for n in range(len(loc), -1, -1) if loc[:n] in lines), None)
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        problems.append(Problem(where, msg, line))
    return problems


def _row_problems(spec: MatrixFile, lines: dict) -> list[Problem]:
    problems: list[Problem] = []
    seen: dict[tuple, int] = {}
    defaults: dict[str, int] = {}
    for i, row in enumerate(spec.rows):
        at = lines.get(("rows", i))
        where = f"rows[{i}]"
        os_name = row.os or spec.defaults.os
        if os_name not in spec.oses:
            problems.append(Problem(where + ".os", f"unknown OS {os_name!r}; defined: {', '.join(spec.oses)}", at))
        if row.cuda not in spec.platforms:
            problems.append(Problem(where + ".cuda", f"unknown CUDA platform {row.cuda}; defined: {', '.join(spec.platforms)}", at))
        if major_of(row.wheel_cuda) not in spec.toolkits:
            problems.append(Problem(where + ".wheel_cuda", f"no CUDA toolkit for CUDA {major_of(row.wheel_cuda)}.x under toolkits; defined: {', '.join(spec.toolkits) or 'none'}", at))
        if major_of(row.cuda) != major_of(row.wheel_cuda):
            problems.append(Problem(where, f"wheel CUDA {row.wheel_cuda} and platform CUDA {row.cuda} differ in major version; minor-version compatibility does not cross majors", at))
        elif Version(row.wheel_cuda) != Version(row.cuda) and not row.note:
            problems.append(Problem(where + ".note", f"platform CUDA {row.cuda} uses the CUDA {row.wheel_cuda} wheel: say why in a note", at))
        key = (row.torch, row.cuda)
        if key in seen:
            problems.append(Problem(where, f"duplicate row torch {row.torch} cuda {row.cuda} (first at line {seen[key]})", at))
        seen.setdefault(key, at or 0)
        listed = spec.defaults.platforms if row.platforms is None else row.platforms
        if len(set(listed)) != len(listed):
            problems.append(Problem(where + ".platforms", f"a platform listed twice: {', '.join(listed)}", at))
        if "linux/amd64" not in listed:
            problems.append(Problem(where + ".platforms", "linux/amd64 is missing: every row is built for it, other platforms beside it", at))
        flavors = row.flavors or spec.defaults.flavors
        if "train" in flavors and "runtime" not in flavors:
            problems.append(Problem(where + ".flavors", "train is locked over the row's runtime: list runtime too", at))
        if "train" in flavors and not any(e.left_out_because(row) is None for e in spec.train.values()):
            why = "; ".join(f"{n}: {e.left_out_because(row)}" for n, e in spec.train.items()) or "train: lists none"
            problems.append(Problem(where + ".flavors", f"no train extra can work on this row ({why})", at))
        if row.default:
            minor = minor_of(row.torch)
            if minor in defaults:
                problems.append(Problem(where + ".default", f"second default for torch {minor} (first at line {defaults[minor]})", at))
            defaults.setdefault(minor, at or 0)
    return problems


def _complete(spec: MatrixFile, path: Path) -> Matrix:
    images = []
    for row in spec.rows:
        os_name = row.os or spec.defaults.os
        base = spec.oses[os_name]
        for flavor in row.flavors or spec.defaults.flavors:
            train = flavor == "train"
            images.append(
                Image(
                    repository=spec.repository, torch=row.torch, cuda=row.cuda, wheel_cuda=row.wheel_cuda,
                    cudnn=row.cudnn, nccl=row.nccl, deepspeed=row.deepspeed, python=base.python,
                    os_name=os_name, os=base, index=row.index or spec.defaults.index, flavor=flavor,
                    default=row.default, driver_min=spec.platforms[row.cuda].driver_min,
                    extra_requirements=spec.defaults.extra_requirements, note=row.note,
                    cpu_arch=spec.defaults.cpu_arch,
                    cpu_arches=(("linux/amd64", spec.defaults.cpu_arch), ("linux/arm64", spec.defaults.cpu_arch_arm64)),
                    toolkit=spec.toolkits[major_of(row.wheel_cuda)],
                    prebuilt_ops=spec.defaults.prebuilt_ops, layers=spec.defaults.layers,
                    platforms=tuple(sorted(row.platforms or spec.defaults.platforms, key=list(OS_PLATFORMS).index)),
                    extras=tuple((n, req) for n, e in spec.train.items()  # left in: it has a requirement (left_out_because)
                                 if train and e.left_out_because(row) is None and (req := e.requirement_for(minor_of(row.torch))) is not None),
                    extras_left_out=tuple((n, why) for n, e in spec.train.items()
                                          if train and (why := e.left_out_because(row)) is not None),
                    extras_built=tuple(e.build for e in spec.train.values() if train and e.build and e.left_out_because(row) is None),
                )
            )
    return Matrix(path=path, repository=spec.repository, images=tuple(images), platforms=tuple(spec.platforms),
                  extras=tuple(spec.train))


def load(path: Path) -> Matrix:
    """Parse, validate and complete a matrix file; raise MatrixError with every problem."""
    data, lines = parse(path)
    try:
        spec = MatrixFile.model_validate(data)
    except ValidationError as e:
        raise MatrixError(str(path), _schema_problems(e, lines)) from None
    problems = _row_problems(spec, lines)
    if problems:
        raise MatrixError(str(path), problems)
    return _complete(spec, path)
