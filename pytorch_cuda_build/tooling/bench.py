"""Benchmarks: measure and report, never assert.

`banner`: container start-up with and without the banner (`docker run --rm IMAGE true`),
interleaved so drift in the machine's load hits both sides alike.
`full`: everything the benchmark issue asks, for one row, in one run: image size against
the floor and a naive Dockerfile, cold builds of both, the no-change and smoke-only
rebuilds, a second row sharing the lock, a matrix build (`--all --jobs`), and the banner.
Report: bench/ (committed).

The cold and matrix measures empty the daemon's whole build cache (BuildKit cannot empty
only our entries without also dropping the cache mounts the cold build must not reuse),
so they run only with the user's --yes.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import docker
import docker.errors

from .. import files, progress
from ..engine import containers, docker_env
from ..engine.docker_env import DOCKER_ENV
from ..errors import BadValue, CommandFailed, NoSuchRow, NotReady, PipelineError
from ..matrix import Image, Matrix
from ..pipeline import results_dir
from ..stages import build, render, tag
from . import bench_report as report
from . import pullcost

MEASURES = ("size", "cold", "opscache", "rebuild", "rows", "matrix", "banner", "arm64", "pull")
EMPTIES_CACHE = ("cold", "matrix")  # measured from an empty build cache
OWN_BUILDS = ("arm64", "pull")  # measured from builds of their own, not from the row's image


class BenchError(CommandFailed):
    """A command the benchmark runs failed: which one, its exit code, its last stderr line."""


def check_consent(only: set[str], yes: bool) -> None:
    """Refuse to empty the build cache, which holds every project's entries, unasked."""
    wanted = [m for m in EMPTIES_CACHE if m in only]
    if wanted and not yes:
        rest = ",".join(m for m in MEASURES if m not in EMPTIES_CACHE)
        raise BadValue(f"cold builds (the {' and '.join(wanted)} measure{'s' if len(wanted) > 1 else ''}) need an empty build cache, "
                         "and emptying it (`docker builder prune --all`) removes every entry of this daemon's build cache, "
                         f"other projects' too; pass --yes to allow that, or leave them out: --only {rest}", name="--yes")


def _run(cmd: list[str], timeout: float | None = None, **kw: Any) -> subprocess.CompletedProcess:
    """Run a command; a failure is a BenchError naming it and its exit code, never a traceback."""
    plain = [a for i, a in enumerate(cmd) if a != "--label" and (i == 0 or cmd[i - 1] != "--label")]  # containers' labels: noise here
    shown = shlex.join(plain[:6]) + (" ..." if len(plain) > 6 else "")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired:
        raise BenchError(shown, None, f"timed out after {timeout:.0f} s") from None
    except OSError as e:
        raise BenchError(shown, None, str(e)) from None
    if proc.returncode != 0:
        raise BenchError(shown, proc.returncode, (proc.stderr.strip().splitlines() or [""])[-1][:300])
    return proc


def _time_run(docker_cli: str, ref: str, env: list[str]) -> float:
    t0 = time.perf_counter()
    _run([docker_cli, "run", "--rm", *containers.label_args("bench"), *env, ref, "true"], timeout=120)
    return time.perf_counter() - t0


def banner(image: Image, ref: str, runs: int, out_dir: Path, *, docker_cli: str) -> dict:
    """`docker run --rm REF true` with the banner and without, interleaved, through docker_cli (the user's --docker)."""
    _time_run(docker_cli, ref, [])  # warm the page cache and the daemon
    on, off = [], []
    for _ in range(runs):
        on.append(_time_run(docker_cli, ref, []))
        off.append(_time_run(docker_cli, ref, ["-e", "PYTORCH_CUDA_NO_BANNER=1"]))
    result = {
        "benchmark": "banner start-up", "image": image.name, "ref": ref, "runs": runs,
        "with_banner_s": report.stats(on), "without_banner_s": report.stats(off),
        "median_overhead_s": statistics.median(on) - statistics.median(off),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "banner.json").write_text(json.dumps(result, indent=2) + "\n")
    (out_dir / "banner.md").write_text(report.markdown(result))
    return result


# ---- the full benchmark: size against the floor and a naive build, build times ----------

NAIVE = """\
# What a user would write by hand: the same base, one pip install, no lock, no ops.
FROM {base}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \\
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
RUN --mount=type=secret,id=ca if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \\
    /opt/venv/bin/pip install torch=={torch} deepspeed=={deepspeed}
"""
# The second baseline: what a user would write by hand to get the same DeepSpeed ops prebuilt
# with DeepSpeed's DS_BUILD_* flags. Same base, the same toolkit .debs (unpacked where Debian
# installs them: installing would pull the newer release's glibc), the arch list read from torch,
# LIBRARY_PATH at the toolkit's stubs as NVIDIA's devel images set it; no lock, cache or checks.
NAIVE_OPS = """\
# What a user would write by hand to prebuild the same DeepSpeed ops with DS_BUILD_*.
FROM {base}
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ libaio-dev ca-certificates \\
    && rm -rf /var/lib/apt/lists/*
RUN cd /tmp && python3 -c "import sys, urllib.request as u; [u.urlretrieve(x, x.rsplit('/', 1)[1]) for x in sys.argv[1:]]" {deb_urls} \\
    && for d in /tmp/*.deb; do dpkg-deb -x "$d" /; done && rm /tmp/*.deb
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH CUDA_HOME=/usr LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/stubs
RUN --mount=type=secret,id=ca if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \\
    pip install torch=={torch} ninja
RUN --mount=type=secret,id=ca if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \\
    export TORCH_CUDA_ARCH_LIST="$(python -c 'import torch; print(";".join(a[3:-1] + "." + a[-1] for a in torch._C._cuda_getArchFlags().split() if a.startswith("sm_")) + "+PTX")')"; \\
    DS_ACCELERATOR=cuda {ds_build} pip install --no-build-isolation deepspeed=={deepspeed}
"""
# DeepSpeed's DS_BUILD_* name of each op (async_io's is DS_BUILD_AIO).
DS_BUILD_VAR = {"async_io": "DS_BUILD_AIO"}


def naive_ops_dockerfile(image: Image, base: str, lock_dir: Path) -> str | None:
    """The DS_BUILD_* baseline for a row whose toolkit is Debian's; None for a PyPI toolkit
    (CUDA 13 rows), which this baseline does not cover."""
    assert image.toolkit is not None  # every matrix row has one (matrix.yaml toolkits)
    if image.toolkit.source != "debian":
        return None
    urls = [line.split()[2] for line in (lock_dir / "toolkit.lock").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    ds_build = " ".join(f"{DS_BUILD_VAR.get(op, 'DS_BUILD_' + op.upper())}=1" for op in image.prebuilt_ops)
    return NAIVE_OPS.format(base=base, deb_urls=" ".join(urls), torch=image.torch, deepspeed=image.deepspeed,
                            ds_build=ds_build)


def cpu_ops_step(s: dict) -> bool:
    """The step that compiles the CPU accelerator's ops: the one that binds ninjalogs.py first
    (steps() keeps 120 characters of a command, too few to reach cpuops.py or its env line)."""
    return s["cmd"].startswith("RUN --mount=type=bind,source=pytorch_cuda_runtime/ninjalogs.py")


def steps(build_log: str) -> list[dict]:
    """Every Dockerfile step of a saved BuildKit log: stage, command, seconds, cached."""
    return progress.steps(build_log)


def timed(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> float:
    t0 = time.perf_counter()
    _run(cmd, env={**os.environ, **(env or {})}, cwd=cwd)
    return time.perf_counter() - t0


def image_size(c: docker.DockerClient, ref: str) -> int:
    return int(c.images.get(ref).attrs["Size"])


def du_venv(docker_cli: str, ref: str) -> int:
    out = _run([docker_cli, "run", "--rm", *containers.label_args("bench"), "--entrypoint", "du", ref, "-sb", "/opt/venv"], timeout=600).stdout
    return int(out.split()[0])


def unique_bytes(c: docker.DockerClient, new_ref: str, old_ref: str) -> int:
    """Bytes of new_ref's layers that old_ref does not have (the layers after the shared prefix)."""
    new, old = (c.images.get(r).attrs["RootFS"]["Layers"] for r in (new_ref, old_ref))
    shared = 0
    while shared < min(len(new), len(old)) and new[shared] == old[shared]:
        shared += 1
    own = len(new) - shared
    layer_steps = [h for h in c.images.get(new_ref).history() if re.match(r"^(RUN|COPY|ADD)\b", h.get("CreatedBy", ""))]
    return sum(h["Size"] for h in layer_steps[:own])


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine, from /proc/stat (containers included)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    idle = v[3] + (v[4] if len(v) > 4 else 0)  # idle + iowait
    return sum(v) - idle, sum(v)


def busy_fraction(before: tuple[int, int], after: tuple[int, int]) -> float:
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total else 0.0


def row_args(image: Image) -> list[str]:
    """The build.py arguments that pick image's row: its torch, CUDA and flavor (a row without its
    flavor is the runtime row)."""
    return ["--torch", image.torch, "--cuda", image.cuda, "--flavor", image.flavor]


@dataclass
class Run:
    """One `bench --full` run for one row: what every measure reads, and the report they add to."""

    c: docker.DockerClient
    m: Matrix
    image: Image
    root: Path
    bc: docker_env.BuildClient
    ca: str | None
    runs: int
    cold_runs: int
    only: set[str]
    out_dir: Path
    log: Callable[[str], None]
    pull_rows: int | None = None
    r: dict = field(default_factory=dict)

    @property
    def buildpy(self) -> list[str]:
        return [sys.executable, str(self.root / "build.py")]

    @property
    def chosen(self) -> dict[str, str]:
        return {DOCKER_ENV: self.bc.argv[0]}  # the build.py runs measured here use the same Docker CLI

    @property
    def ref(self) -> str:
        return self.image.refs()[0]

    def build(self, image: Image, *extra: str) -> float:
        """`build.py` for image's row (its flavor included) through the user's Docker CLI: its seconds."""
        return timed(self.buildpy + row_args(image) + list(extra), env=self.chosen)


def _measure_cold(b: Run) -> None:
    b.r["cold"], b.r["size"] = _cold(b.c, b.image, b.root, b.bc, b.ca, b.cold_runs, b.buildpy, row_args(b.image), b.log, b.chosen)


def _measure_rebuild(b: Run) -> None:
    b.log(f"bench: unchanged rebuild through build.py, {b.runs} runs")
    b.r["rebuild_nochange_s"] = report.stats([b.build(b.image, "--quiet") for _ in range(b.runs)])
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-bench-") as tmp:
        copy = files.copy_project(b.root, Path(tmp))
        smoke = copy / "pytorch_cuda_runtime" / "smoke" / "versions.py"
        smoke.write_text(smoke.read_text() + f"\n# a change to the smoke suite only ({time.time_ns()})\n")
        t = timed([sys.executable, str(copy / "build.py"), *row_args(b.image), "--quiet", "--no-test"], env=b.chosen, cwd=copy)
        rebuilt = [s for s in steps((copy / "build-results" / b.image.name / "build.log").read_text())
                   if not s["cached"] and not s["cmd"].startswith("FROM ")]  # FROM resolves, it builds nothing
        b.c.images.remove(build.candidate_ref(b.image), noprune=False)
    b.r["smoke_change"] = {"seconds": t, "rebuilt_steps": [f"[{s['stage']}] {s['cmd']}" for s in rebuilt]}


def _measure_size(b: Run) -> None:
    image, ref = b.image, b.ref
    b.log("bench: size against the floor")
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-bench-") as tmp:
        ctx = Path(tmp)
        build.stage_context(b.root, image, ctx)
        _run([*b.bc.argv, "--progress=plain", "--file", str(b.root / "images" / image.name / "Dockerfile"),
              "--target", "base", "--tag", "pytorch-cuda-bench:base", str(ctx)], env={**os.environ, **b.bc.env})
    base, venv, ours = image_size(b.c, "pytorch-cuda-bench:base"), du_venv(b.bc.argv[0], ref), image_size(b.c, ref)
    b.c.images.remove("pytorch-cuda-bench:base", noprune=True)
    b.r["size"] = {**b.r.get("size", {}), "image": ours, "base_os_python": base, "locked_env": venv, "floor": base + venv,
                   "ratio_to_floor": ours / (base + venv)}
    if image.flavor == "train":
        b.r["train"] = train_figures(b.c, b.m, image, ref, b.bc.argv[0])


def _measure_opscache(b: Run) -> None:
    # After the cold build. --no-cache empties every cache mount, so the host's ops seed
    # (opsseed: the wheel the cold build exported) must spare the compile.
    b.log("bench: --no-cache rebuild (the host's ops seed must serve the compiled ops)")
    t = b.build(b.image, "--quiet", "--no-test", "--no-cache")
    text = progress.readable((b.root / "build-results" / b.image.name / "build.log").read_text())
    st = steps(text)
    b.r["opscache"] = {"seconds": t, "ops_step_s": sum(s["seconds"] for s in st if s["stage"] == "ops-builder"),
                       "cpu_ops_s": sum(s["seconds"] for s in st if cpu_ops_step(s)),
                       "served_from_cache": "nothing compiled" in text}
    if b.r.get("cold"):
        b.r["opscache"]["cold_ops_step_s"] = statistics.median(b.r["cold"]["ours_ops_s"])


def twin(m: Matrix, image: Image) -> Image | None:
    """Another row of image's flavor that shares its lock, if the matrix has one."""
    return next((i for i in m.images if i.lock_key == image.lock_key and i.name != image.name and i.flavor == image.flavor), None)


def _measure_rows(b: Run) -> None:
    second = twin(b.m, b.image)
    if second is None:
        return
    c = b.c
    # Both rows from the same cache state: BuildKit keeps several results per step once
    # a --no-cache build has run, and a build takes the newest, which the tested image may predate.
    b.log(f"bench: second row with the same lock ({second.name}) after the first")
    b.build(b.image, "--quiet", "--no-test")
    first = f"pytorch-cuda-bench:{b.image.name}"
    c.images.get(build.candidate_ref(b.image)).tag(*first.split(":"))
    t = b.build(second, "--quiet", "--no-test")
    cand = build.candidate_ref(second)
    unique, size = unique_bytes(c, cand, first), image_size(c, cand)
    r: dict[str, Any] = {"image": second.name, "seconds": t, "unique_bytes": unique, "size": size, "unique_fraction": unique / size}
    c.images.remove(first, noprune=True)
    if b.r.get("cold"):
        r["fraction_of_cold_build"] = t / statistics.median(b.r["cold"]["ours_s"])
    c.images.remove(cand, noprune=False)
    b.r["second_row"] = r


def _measure_matrix(b: Run) -> None:
    b.r["matrix"] = _matrix(b.c, b.m, b.image, b.root, b.bc, b.buildpy, b.r, b.log)


def _measure_banner(b: Run) -> None:
    b.log(f"bench: banner start-up, {b.runs} interleaved runs")
    b.r["banner"] = banner(b.image, b.ref, b.runs, b.out_dir, docker_cli=b.bc.argv[0])


def _measure_arm64(b: Run) -> None:
    if "linux/arm64" in b.image.platforms:
        platforms(b.c, b.image, b.root, b.bc, b.out_dir, b.log)  # its own report: bench/arm64.md


def _measure_pull(b: Run) -> None:
    b.log("bench: pull cost, one layer of wheels against the layered layout (the CUDA 13 rows, both layouts built)")
    b.r["pull"] = pullcost.measure(b.c, b.m, b.root, b.bc, b.ca, b.log, first=b.pull_rows)
    pullcost.write(b.r["pull"], b.out_dir)  # also its own report: bench/pull.md


@dataclass(frozen=True)
class Measure:
    name: str  # as --only names it (MEASURES)
    run: Callable[[Run], None]
    tested: bool = True  # reads the row's built and tested image (False: the cold builds, and those with builds of their own)


# The measures in the order a full run takes them: the cold builds first, from an empty build cache;
# they leave the layer cache warm for the build that the next measures read.
FULL = (Measure("cold", _measure_cold, tested=False), Measure("rebuild", _measure_rebuild), Measure("size", _measure_size),
        Measure("opscache", _measure_opscache), Measure("rows", _measure_rows), Measure("matrix", _measure_matrix),
        Measure("banner", _measure_banner), Measure("arm64", _measure_arm64, tested=False), Measure("pull", _measure_pull, tested=False))


def full(c: docker.DockerClient, m: Matrix, image: Image, root: Path, bc: docker_env.BuildClient, ca: str | None, runs: int, cold_runs: int, only: set[str],
         out_dir: Path, log: Callable[[str], None], yes: bool = False, pull_rows: int | None = None) -> dict:
    """Every figure of the benchmark issue for one row, measured in one run on this machine: each
    measure of `only`, in FULL's order.

    yes: the user allowed emptying the daemon's whole build cache (cold, matrix). pull_rows: --pull-rows."""
    check_consent(only, yes)
    b = Run(c, m, image, root, bc, ca, runs, cold_runs, only, out_dir, log, pull_rows)
    b.r.update({"image": image.name, "runs": runs, "cold_runs": cold_runs, "cpus": os.cpu_count(),
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": build.source(root).revision})
    partial = out_dir / "report.partial.json"
    if "cold" not in only:
        b.r["cold"] = report.previous(out_dir / "report.json", image, "cold")  # ratios to the last measured cold build
    tested = False
    for measure in FULL:
        if measure.name not in only:
            continue
        if measure.tested and not tested:
            # After the cold builds, which leave the layer cache warm: only the tests run here then.
            log("bench: making sure the row is built and tested")
            b.build(image, "--quiet")
            tested = True
        measure.run(b)
        report.save_partial(partial, b.r)  # a long run keeps what it measured if a later step fails
    return _write(b, partial)


def _write(b: Run, partial: Path) -> dict:
    """The report of a full run, merged with the previous one's other measures: report.json, report.md, the charts."""
    r, image, out_dir = b.r, b.image, b.out_dir
    if r.get("cold") is None or "cold" not in b.only:
        r.pop("cold", None)  # only borrowed for the ratios: merge_previous carries the measured one
    r = report.merge_previous(out_dir / "report.json", r, b.only, complete=set(MEASURES) <= b.only)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(r, indent=2) + "\n")
    (out_dir / "report.md").write_text(report.report_markdown(r))
    partial.unlink(missing_ok=True)
    if "image" in r.get("size", {}) and "naive" in r["size"]:
        s = r["size"]
        (out_dir / "sizes.svg").write_text(report.svg_bars(f"Image size, {image.name}", "GB", [
            ("floor (base + locked env)", s["floor"] / 1e9), ("this tool", s["image"] / 1e9), ("naive Dockerfile", s["naive"] / 1e9)]
            + ([("naive, DS_BUILD_* ops", s["naive_ops"] / 1e9)] if "naive_ops" in s else [])))
    if "cold" in r and r["cold"].get("naive_s"):
        cd = r["cold"]
        (out_dir / "cold-build.svg").write_text(report.svg_bars(f"Cold build, {image.name} (median)", "min", [
            ("this tool", statistics.median(cd["ours_s"]) / 60),
            ("this tool without op prebuild", (statistics.median(cd["ours_s"]) - statistics.median(cd["ours_ops_s"])) / 60),
            ("naive Dockerfile", statistics.median(cd["naive_s"]) / 60)]
            + ([("naive, DS_BUILD_* ops", statistics.median(cd["naive_ops_s"]) / 60)] if cd.get("naive_ops_s") else [])))
    return r


# ---- arm64: the row's platforms side by side, from their own builds ----------------------


def last_build(results: Path) -> tuple[Path, list[dict]] | None:
    """The newest log under results that built something (a build from the cache records no
    times): build.log, else build.previous.log; with its steps. None: neither did."""
    for name in ("build.log", "build.previous.log"):
        path = results / name
        if path.exists():
            st = steps(path.read_text(errors="replace"))
            if any(not s["cached"] and s["seconds"] > 5 for s in st):
                return path, st
    return None


def _platform_figures(results: Path) -> dict | None:
    found = last_build(results)
    if found is None:
        return None
    path, st = found
    built = [s for s in st if not s["cached"]]
    smoke = json.loads((results / "smoke-report.json").read_text()) if (results / "smoke-report.json").exists() else {}

    def ran(pick: Callable[[dict], Any]) -> float | None:  # None: that step came from the cache in this build, so it was not measured
        mine = [s["seconds"] for s in built if pick(s)]
        return sum(mine) if mine else None
    return {"log": str(path), "log_time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(path.stat().st_mtime)),
            "build_s": sum(s["seconds"] for s in built),
            "python_env_s": ran(lambda s: s["stage"] == "python-env"),
            # The saved command is cut at 120 characters. The op compile is the ops-builder step whose first
            # mount is the ops cache; cpu_ops_step says how the CPU ops' is found.
            "ops_s": ran(lambda s: s["stage"] == "ops-builder" and f"id={render.OPS_CACHE_ID}," in s["cmd"]),
            "cpu_ops_s": ran(cpu_ops_step),
            "apt_s": ran(lambda s: s["stage"] == "base" and s["cmd"].startswith("RUN")),
            "smoke_s": smoke.get("seconds"), "smoke_checks": smoke.get("summary")}


def platforms(c: docker.DockerClient, image: Image, root: Path, bc: docker_env.BuildClient, out_dir: Path, log: Callable[[str], None]) -> dict:
    """The row's linux/arm64 image (emulated here) beside its linux/amd64 one: their builds'
    step times, read from each platform's last build that built (build-results/<row>/[linux-arm64/]),
    their gates' smoke runs, and the arm64 image's size against its floor, measured now.
    Written to out_dir/arm64.{json,md}."""
    if "linux/arm64" not in image.platforms:
        raise NoSuchRow(f"{image.name} is not built for linux/arm64 (its platforms: {', '.join(image.platforms)})", name="--platform")
    arm = image.on("linux/arm64")
    r: dict = {"image": image.name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(),
               "host": docker_env.host_platform(), "commit": build.source(root).revision}
    for p in image.platforms:
        r[p] = _platform_figures(results_dir(root, image.on(p)))
    ref = tag.own_ref(arm)
    if r["linux/arm64"] is None or tag.current(c, arm).get(ref, None) is None and not _exists(c, ref):
        raise NotReady(f"no built and tagged linux/arm64 image of {image.name} ({ref}); build it first: "
                         f"python build.py --torch {image.torch} --cuda {image.cuda} --platform linux/arm64", ref=ref)
    log("bench: the arm64 image against its floor (base stage + /opt/venv, measured under emulation)")
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-bench-") as tmp:
        build.stage_context(root, arm, Path(tmp))
        _run([*bc.argv, "--progress=plain", "--file", str(build.dockerfile(root, arm)), *build.platform_args(arm),
              "--target", "base", "--tag", "pytorch-cuda-bench:base-arm64", tmp], env={**os.environ, **bc.env})
    out = _run([bc.argv[0], "run", "--rm", *containers.label_args("bench"), "--platform", arm.platform, "--entrypoint", "du", ref, "-sb", "/opt/venv"], timeout=1800).stdout
    base, venv, ours = image_size(c, "pytorch-cuda-bench:base-arm64"), int(out.split()[0]), image_size(c, ref)
    c.images.remove("pytorch-cuda-bench:base-arm64", noprune=True)
    r["size"] = {"image": ours, "base_os_python": base, "locked_env": venv, "floor": base + venv, "ratio_to_floor": ours / (base + venv)}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "arm64.json").write_text(json.dumps(r, indent=2) + "\n")
    (out_dir / "arm64.md").write_text(report.platforms_markdown(r))
    return r


def _exists(c: docker.DockerClient, ref: str) -> bool:
    try:
        c.images.get(ref)
        return True
    except docker.errors.ImageNotFound:
        return False


def _cold(c: docker.DockerClient, image: Image, root: Path, bc: docker_env.BuildClient, ca: str | None, cold_runs: int, buildpy: list[str], row: list[str],
          log: Callable[[str], None], chosen: dict) -> tuple[dict, dict]:
    """Cold builds from an empty build cache: this tool (through build.py, no tests), the naive
    Dockerfile, and the naive Dockerfile that prebuilds the same ops with DS_BUILD_*.

    The naive Dockerfiles are the runtime image's baselines (one pip install of torch and
    DeepSpeed); another flavor's cold build is measured alone, with its extras' compile."""
    r: dict = {"size": {}}
    r["cold"] = {"ours_s": [], "ours_ops_s": [], "ours_cpu_ops_s": [], "ours_python_env_s": [], "ours_te_s": [],
                 "naive_s": [], "naive_ops_s": []}
    naive = image.flavor == "runtime"
    naive_ref = f"pytorch-cuda-bench-naive:{image.name}"
    naive_ops = naive and naive_ops_dockerfile(image, render.base_ref(image), root / "images" / image.name)
    for k in range(cold_runs):
        # Truly cold: no layer cache and an empty store of its own (the downloads are the build's too).
        _empty_build_cache(bc)
        log(f"bench: cold build {k + 1}/{cold_runs} through build.py (empty build cache and store)")
        with tempfile.TemporaryDirectory(prefix="pytorch-cuda-bench-store-") as store:
            r["cold"]["ours_s"].append(timed(buildpy + row + ["--quiet", "--no-test"], env={**chosen, "PYTORCH_CUDA_STORE": store}))
        st = steps((root / "build-results" / image.name / "build.log").read_text())
        r["cold"]["ours_ops_s"].append(sum(s["seconds"] for s in st if s["stage"] == "ops-builder"))
        r["cold"]["ours_python_env_s"].append(sum(s["seconds"] for s in st if s["stage"] == "python-env"))
        r["cold"]["ours_cpu_ops_s"].append(sum(s["seconds"] for s in st if cpu_ops_step(s)))
        r["cold"]["ours_te_s"].append(sum(s["seconds"] for s in st if s["stage"] == "te-builder"))
        if not naive:
            continue
        log(f"bench: naive cold build {k + 1}/{cold_runs}")
        dockerfile = NAIVE.format(base=render.base_ref(image), torch=image.torch, deepspeed=image.deepspeed)
        r["cold"]["naive_s"].append(_naive_build(bc, ca, dockerfile, naive_ref))
        if naive_ops:
            # --no-cache, and no cache mounts: cold without emptying the cache, so this tool's
            # layers stay for the tested build that follows.
            log(f"bench: naive cold build with DS_BUILD_* ops {k + 1}/{cold_runs}")
            r["cold"]["naive_ops_s"].append(_naive_build(bc, ca, naive_ops, naive_ref + "-ops"))
    c.images.remove(build.candidate_ref(image), noprune=False)
    cold = r["cold"]
    if not naive:
        return cold, r["size"]
    r["size"]["naive"] = image_size(c, naive_ref)
    c.images.remove(naive_ref)
    if naive_ops:
        r["size"]["naive_ops"] = image_size(c, naive_ref + "-ops")
        c.images.remove(naive_ref + "-ops")
    cold["ratio_to_naive"] = statistics.median(cold["ours_s"]) / statistics.median(cold["naive_s"])
    cold["ratio_to_naive_without_ops"] = (statistics.median(cold["ours_s"]) - statistics.median(cold["ours_ops_s"])) / statistics.median(cold["naive_s"])
    if cold["naive_ops_s"]:
        cold["ratio_to_naive_ops"] = statistics.median(cold["ours_s"]) / statistics.median(cold["naive_ops_s"])
    return r["cold"], r["size"]


def _naive_build(bc: docker_env.BuildClient, ca: str | None, dockerfile: str, ref: str) -> float:
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-naive-") as tmp:
        (Path(tmp) / "Dockerfile").write_text(dockerfile)
        cmd = [*bc.argv, "--progress=plain", "--no-cache", "--tag", ref, *(["--network", bc.network] if bc.network else []), tmp]
        if ca:
            cmd[-1:-1] = ["--secret", f"id=ca,src={ca}"]
        return timed(cmd, env=bc.env)


def _empty_build_cache(bc: docker_env.BuildClient) -> None:
    """Every entry of the daemon's build cache, not only ours: the caller has the user's --yes."""
    _run([bc.argv[0], "builder", "prune", "--all", "--force"], env={**os.environ, **bc.env})


def _matrix(c: docker.DockerClient, m: Matrix, image: Image, root: Path, bc: docker_env.BuildClient, buildpy: list[str], r: dict, log: Callable[[str], None]) -> dict:
    """`--all --jobs N` over the rows of this torch minor, from an empty build cache: wall
    time against the one-row cold build, how busy the machine was, and how many rows ran
    the locked-wheels step themselves (BuildKit should run a step shared by rows once)."""
    rows = [i for i in m.images if i.torch_minor == image.torch_minor and i.flavor == image.flavor]
    _empty_build_cache(bc)
    log(f"bench: matrix build of {len(rows)} rows ({', '.join(i.name for i in rows)}), --jobs {len(rows)}, empty build cache")
    before = cpu_times()
    t = timed(buildpy + ["build", "--all", "--torch", image.torch_minor, "--jobs", str(len(rows)), "--no-test", "--quiet"],
              env={DOCKER_ENV: bc.argv[0]})
    busy = busy_fraction(before, cpu_times())
    ran = {}
    for i in rows:
        st = steps((root / "build-results" / i.name / "build.log").read_text())
        ran[i.name] = [s["seconds"] for s in st if s["stage"] == "python-env" and not s["cached"] and s["cmd"].startswith("RUN")]
        c.images.remove(build.candidate_ref(i), noprune=False)
    out = {"rows": [i.name for i in rows], "jobs": len(rows), "seconds": t, "cpu_busy": busy,
           "locked_wheels_step_s": ran}
    if r.get("cold"):
        out["fraction_of_cold_build"] = t / statistics.median(r["cold"]["ours_s"])
    return out


def train_figures(c: docker.DockerClient, m: Matrix, image: Image, ref: str, docker_cli: str) -> dict:
    """What the train flavor adds: its size over the row's runtime image (when built here), and the
    Transformer Engine compile its builder stage ran (te-facts.json, baked into the image)."""
    runtime = next(i for i in m.images if (i.torch, i.cuda, i.flavor) == (image.torch, image.cuda, "runtime")).refs()[0]
    out = {"runtime_ref": runtime, "runtime_image": image_size(c, runtime) if _exists(c, runtime) else None,
           "extras": image.extras_pins, "left_out": dict(image.extras_left_out)}
    if image.extras_built:
        facts = _run([docker_cli, "run", "--rm", *containers.label_args("bench"), "--entrypoint", "cat", ref, "/opt/pytorch-cuda/te-facts.json"])
        te = json.loads(facts.stdout)
        out["te_compile_s"], out["te_compile_jobs"] = te["compile_seconds"], te["compile_jobs"]
    return out


def report_dir(root: Path, image: Image) -> Path:
    """bench/ for a runtime row; bench/<image>/ for another flavor's image, whose figures stand beside the runtime's."""
    return root / "bench" if image.flavor == "runtime" else root / "bench" / image.name


def parse_only(text: str | None) -> set[str]:
    """--only's measures (None: every one); checked by validate before Docker is touched."""
    if text is None:
        return set(MEASURES)
    only = {x.strip() for x in text.split(",") if x.strip()}
    if not only or only - set(MEASURES):
        raise BadValue(f"--only takes a comma list of {','.join(MEASURES)}, not {text!r}", name="--only")
    return only


def run(c: docker.DockerClient, m: Matrix, image: Image, root: Path, only: set[str], runs: int, cold_runs: int, every: bool, yes: bool,
        docker: str | None, ca: Callable[[], str | None], log: Callable[[str], None], pull_rows: int | None = None) -> str:
    """`build.py bench`: the banner alone, or (every: --full) each measure of `only`; the report as markdown."""

    if every and only == {"arm64"}:  # the platforms' own builds: nothing else is built or run
        return report.platforms_markdown(platforms(c, image, root, docker_env.build_client(docker), root / "bench", log))
    ref = image.refs()[0]
    # The cold builds make their own image; the other measures read the built and tested one.
    if not (every and only <= {*OWN_BUILDS, "cold"}) and tag.current(c, image)[ref] is None:
        raise NotReady(f"no image {ref}; build it first", ref=ref)
    if not every:
        return report.markdown(banner(image, ref, runs, root / "build-results" / "bench", docker_cli=docker_env.docker_cli(docker)))
    bc = docker_env.build_client(docker)
    if only & set(EMPTIES_CACHE):
        build.check_disk(docker_env.root_dir(c))
    try:
        result = full(c, m, image, root, bc, ca(), runs, cold_runs, only, report_dir(root, image), log, yes=yes, pull_rows=pull_rows)
    except BenchError as e:
        raise PipelineError(f"benchmark step failed: {e}") from None
    return report.report_markdown(result)
