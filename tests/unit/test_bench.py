"""The benchmark's parsing and report logic (the measurements themselves are never asserted),
its refusal to empty the build cache without --yes, and a failing command as one typed line."""
from __future__ import annotations

import dataclasses
import subprocess
import types
from unittest import mock

import pytest

from pytorch_cuda_build import cli, matrix
from pytorch_cuda_build.engine import docker_env
from pytorch_cuda_build.errors import BadValue, CommandFailed
from pytorch_cuda_build.stages import build, tag
from pytorch_cuda_build.tooling import bench, bench_report

from helpers import ROOT

LOG = """\
#1 [internal] load build definition from Dockerfile
#1 DONE 0.0s
#4 [base 1/3] FROM docker.io/library/pytorch-cuda-rootfs:bookworm-abc
#4 DONE 0.0s
#5 [base 2/3] RUN apt-get update
#5 CACHED
#7 [python-env 2/2] RUN set -eu; pip download
#7 12.3 Collecting torch
#7 DONE 93.2s
#9 [ops-builder 3/5] RUN pip wheel deepspeed
#9 DONE 201.5s
#11 [runtime 4/9] COPY pytorch_cuda_runtime /opt/pytorch-cuda/lib
#11 DONE 0.1s
"""


def test_steps_reads_stage_time_and_cache_hits():
    st = bench.steps(LOG)
    assert [(s["stage"], s["seconds"], s["cached"]) for s in st] == [
        ("base", 0.0, False), ("base", 0.0, True), ("python-env", 93.2, False), ("ops-builder", 201.5, False), ("runtime", 0.1, False)]
    assert st[2]["cmd"].startswith("RUN set -eu")


def test_report_marks_each_target_met_or_not():
    r = {"image": "x", "date": "d", "cpus": 2,
         "size": {"image": 104e8, "floor": 100e8, "base_os_python": 2e8, "locked_env": 98e8, "ratio_to_floor": 1.04, "naive": 130e8},
         "rebuild_nochange_s": bench_report.stats([1.0, 1.2, 0.9]),
         "second_row": {"image": "y", "seconds": 5.0, "unique_bytes": 1e6, "unique_fraction": 0.0002, "size": 58e8, "fraction_of_cold_build": 0.01}}
    md = bench_report.report_markdown(r)
    assert "| 1.040x | <= 1.03x | no |" in md
    assert "| 1.00 s | <= 3 s | yes |" in md
    assert "(0.020%) | <= 1% | yes |" in md


def test_svg_has_one_bar_per_series():
    svg = bench_report.svg_bars("t", "GB", [("a", 1.0), ("b", 2.0), ("c", 0.5)])
    assert svg.startswith("<svg") and svg.count("<rect") == 3 and "2.00 GB" in svg


def test_matrix_row_is_met_only_when_one_row_ran_the_shared_step():
    base = {"image": "x", "date": "d", "cpus": 2}
    once = {"rows": ["a", "b"], "jobs": 2, "seconds": 300.0, "cpu_busy": 0.93, "locked_wheels_step_s": {"a": [65.0], "b": []}}
    twice = {**once, "locked_wheels_step_s": {"a": [65.0], "b": [64.0]}}
    assert "| 1 of 2 | 1 | yes |" in bench_report.report_markdown({**base, "matrix": once})
    assert "| 2 of 2 | 1 | no |" in bench_report.report_markdown({**base, "matrix": twice})
    assert "| 93% | busy |" in bench_report.report_markdown({**base, "matrix": once})


def test_a_partial_run_keeps_the_other_figures_and_says_when(tmp_path):
    path = tmp_path / "report.json"
    first = {"image": "x", "date": "monday", "commit": "aaa1111", "cpus": 2, "runs": 5, "rebuild_nochange_s": bench_report.stats([1.0])}
    path.write_text(bench.json.dumps(first))
    later = {"image": "x", "date": "tuesday", "commit": "bbb2222", "cpus": 2, "runs": 5, "rebuild_nochange_s": bench_report.stats([2.0]),
             "matrix": {"rows": ["a"], "jobs": 1, "seconds": 1.0, "cpu_busy": 0.5, "locked_wheels_step_s": {"a": [1.0]}}}
    merged = bench_report.merge_previous(path, later, {"rebuild", "matrix"}, complete=False)
    assert merged["rebuild_nochange_s"]["median"] == 2.0 and "matrix" in merged
    assert merged["date"] == "monday" and merged["commit"] == "aaa1111"
    assert merged["updated"] == [{"date": "tuesday", "commit": "bbb2222", "measures": ["matrix", "rebuild"]}]
    md = bench_report.report_markdown(merged)
    assert "Measured monday at commit aaa1111 on this machine" in md
    assert "Re-measured tuesday at commit bbb2222: matrix, rebuild" in md
    # a report written before the tools recorded the commit says so
    assert "Measured monday (commit not recorded) on" in bench_report.report_markdown({**merged, "commit": None})
    # the cold measure's naive image sizes join the size measure's, never replace them
    path.write_text(bench.json.dumps({**first, "size": {"image": 6, "floor": 5}}))
    merged = bench_report.merge_previous(path, {**later, "size": {"naive": 3}}, {"cold"}, complete=False)
    assert merged["size"] == {"image": 6, "floor": 5, "naive": 3}
    # a full run, or another image's report, starts afresh
    assert bench_report.merge_previous(path, later, set(bench.MEASURES), complete=True) is later
    assert bench_report.merge_previous(path, {**later, "image": "y"}, {"matrix"}, complete=False)["date"] == "tuesday"
    # the pull measure builds its own rows: it joins the report, whichever --torch it ran with
    merged = bench_report.merge_previous(path, {"image": "y", "date": "wednesday", "cpus": 2, "pull": {"rows": ["a", "b"]}}, {"pull"}, complete=False)
    assert merged["image"] == "x" and merged["pull"] == {"rows": ["a", "b"]} and merged["rebuild_nochange_s"]["median"] == 1.0
    assert merged["updated"][-1] == {"date": "wednesday", "commit": None, "measures": ["pull"]}


def test_busy_fraction_from_proc_stat_samples():
    assert bench.busy_fraction((100, 400), (250, 600)) == 0.75
    busy, total = bench.cpu_times()
    assert 0 <= busy <= total


def test_naive_ops_baseline_builds_the_rows_ops_with_ds_build_flags(tmp_path):
    """The second naive Dockerfile: the same toolkit .debs as the lock, one DS_BUILD_* per op."""
    from types import SimpleNamespace

    (tmp_path / "toolkit.lock").write_text("# header\nabc 10 http://deb.example/a.deb a=1\ndef 20 http://deb.example/b.deb b=2\n")
    image = SimpleNamespace(toolkit=SimpleNamespace(source="debian"), torch="2.7.1", deepspeed="0.17.6",
                            prebuilt_ops=["cpu_adam", "fused_adam", "async_io"])
    d = bench.naive_ops_dockerfile(image, "base:tag", tmp_path)
    assert d.startswith("# What a user") and "FROM base:tag\n" in d
    assert "http://deb.example/a.deb http://deb.example/b.deb" in d
    assert "DS_ACCELERATOR=cuda DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 DS_BUILD_AIO=1 pip install" in d
    assert "torch==2.7.1" in d and "deepspeed==0.17.6" in d and "# syntax" not in d
    assert bench.naive_ops_dockerfile(SimpleNamespace(toolkit=SimpleNamespace(source="pypi")), "b", tmp_path) is None


def test_report_compares_against_the_naive_ops_build_and_the_ops_cache():
    r = {"image": "x", "date": "d", "cpus": 2,
         "cold": {"ours_s": [1500.0], "ours_ops_s": [700.0], "ours_cpu_ops_s": [390.0], "ours_python_env_s": [70.0],
                  "naive_s": [100.0], "naive_ops_s": [1400.0], "ratio_to_naive": 15.0, "ratio_to_naive_without_ops": 8.0,
                  "ratio_to_naive_ops": 1500 / 1400},
         "opscache": {"seconds": 600.0, "ops_step_s": 20.0, "cpu_ops_s": 390.0, "served_from_cache": True, "cold_ops_step_s": 700.0}}
    md = bench_report.report_markdown(r)
    assert "(1500 s / 1400 s) | 1.07x | <= 1.1x | yes |" in md
    assert "| 20 s / 600 s | ops from the cache | yes |" in md
    assert "| cold build, naive with DS_BUILD_* ops | 1400.00 |" in md


# ---- --full's consent, and failing commands ----------------------------------------------

@pytest.fixture
def no_docker(monkeypatch):
    """Every way bench reaches Docker, recorded: a refusal must run none of them."""
    calls = []

    def record(*a, **kw):
        calls.append(a[0] if a else kw)
        raise AssertionError(f"ran {a[0] if a else kw}")
    monkeypatch.setattr(docker_env, "ensure_engine", record)
    monkeypatch.setattr(docker_env, "build_client", record)
    monkeypatch.setattr(bench.subprocess, "run", record)
    return calls


@pytest.mark.parametrize("only", [None, "cold", "matrix", "size,cold"])
def test_bench_full_refuses_to_empty_the_build_cache_without_yes(no_docker, capsys, only):
    argv = ["bench", "--torch", "2.7", "--cuda", "12.1", "--full"] + (["--only", only] if only else [])
    rc = cli.main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "need an empty build cache" in err and "removes every entry of this daemon's build cache" in err
    assert "--yes" in err and "--only size,opscache,rebuild,rows,banner" in err
    assert no_docker == []  # nothing ran, nothing pruned


def test_bench_full_without_cache_measures_needs_no_yes(no_docker):
    bench.check_consent({"size", "rebuild", "rows", "banner"}, yes=False)
    bench.check_consent(set(bench.MEASURES), yes=True)


def test_bench_full_itself_checks_before_any_command(no_docker, tmp_path):
    with pytest.raises(BadValue, match="--yes"):
        bench.full(None, None, None, tmp_path, None, None, 1, 1, {"cold"}, tmp_path, print)
    assert no_docker == []


def test_a_failing_command_is_a_typed_error_with_its_exit_code():
    with pytest.raises(bench.BenchError) as e:
        bench._run(["sh", "-c", "echo first >&2; echo 'no such image' >&2; exit 125"])
    assert isinstance(e.value, CommandFailed) and e.value.returncode == 125
    assert str(e.value) == "`sh -c 'echo first >&2; echo '\"'\"'no such image'\"'\"' >&2; exit 125'` exited 125: no such image"


def test_a_missing_or_hanging_command_is_a_typed_error_too():
    with pytest.raises(bench.BenchError, match="could not run"):
        bench._run(["/nonexistent/docker", "run"])
    with pytest.raises(bench.BenchError, match="timed out after 0 s"):
        bench._run(["sleep", "5"], timeout=0.2)


def test_cli_bench_prints_a_failed_docker_run_as_one_line(monkeypatch, capsys, tmp_path):
    """The CalledProcessError that once escaped as a traceback from the banner measure."""
    monkeypatch.setattr(docker_env, "ensure_engine", lambda log=None: object())
    monkeypatch.setattr(tag, "current", lambda c, image: {image.refs()[0]: "sha256:x"})
    monkeypatch.setattr(cli, "ROOT", tmp_path)  # no report written into the tree
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 125, "", "docker: Error response from daemon: could not select device driver\n"))
    rc = cli.main(["--matrix", str(ROOT / "matrix.yaml"), "bench", "--torch", "2.7", "--cuda", "12.1", "--runs", "1"])
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1, err
    assert err.startswith("error: `docker run --rm pytorch-cuda:2.7.1-cuda12.1-runtime true` exited 125: docker: Error response"), err


CACHED_LOG = """\
#4 [base 1/3] FROM docker.io/library/pytorch-cuda-rootfs:bookworm-abc-arm64
#4 DONE 0.0s
#5 [base 2/3] RUN apt-get update
#5 CACHED
#7 [python-env 2/2] RUN set -eu; pip download
#7 CACHED
"""
ARM_LOG = LOG.replace("RUN pip wheel deepspeed", "RUN --mount=type=cache,id=pytorch-cuda-wheelhouse,target=/wheelhouse     "
                      "--mount=type=cache,id=pytorch-cuda-ops,target=/opscache set -eu; python /opt/pytorch-cuda/opsbuild.py")


def test_arm64_figures_come_from_the_last_build_that_built(tmp_path):
    """A rebuild from the cache keeps the build before it as build.previous.log: the figures are that one's."""
    (tmp_path / "build.log").write_text(CACHED_LOG)
    assert bench.last_build(tmp_path) is None
    (tmp_path / "build.previous.log").write_text(ARM_LOG)
    (tmp_path / "smoke-report.json").write_text('{"seconds": 412.5, "summary": {"PASS": 9, "FAIL": 0, "SKIPPED": 1}}')
    figures = bench._platform_figures(tmp_path)
    assert figures["log"].endswith("build.previous.log")
    assert (figures["build_s"], figures["python_env_s"], figures["ops_s"], figures["smoke_s"]) == (294.8, 93.2, 201.5, 412.5)
    (tmp_path / "build.log").write_text(ARM_LOG)
    assert bench.last_build(tmp_path)[0].name == "build.log"  # the newest that built wins


def test_arm64_report_puts_the_platforms_side_by_side_and_says_what_was_not_measured():
    r = {"image": "2.11.0-cuda13.0-runtime", "date": "2026-11-25 12:00 UTC", "cpus": 2, "host": "linux/amd64",
         "linux/amd64": None,
         "linux/arm64": {"log": "build-results/x/linux-arm64/build.log", "log_time": "2026-11-25 11:00 UTC", "build_s": 3600.0,
                         "python_env_s": 396.3, "ops_s": 2400.0, "cpu_ops_s": 600.0, "apt_s": 166.0, "smoke_s": 500.0,
                         "smoke_checks": {"PASS": 9, "FAIL": 0, "SKIPPED": 1}},
         "size": {"image": 10.3e9, "base_os_python": 0.4e9, "locked_env": 9.8e9, "floor": 10.2e9, "ratio_to_floor": 10.3 / 10.2}}
    assert "Measured 2026-11-25 12:00 UTC at commit abc1234 on this" in bench_report.platforms_markdown({**r, "commit": "abc1234"})
    text = bench_report.platforms_markdown(r)
    assert "| build: the steps that ran (steps from the cache not counted) | not measured | 3600 s |" in text
    assert "|   of which the DeepSpeed op compile (nvcc) | not measured | 2400 s |" in text
    assert "= **1.010x** (target <= 1.03x)" in text and "- linux/amd64: no build that built here" in text


def test_a_rebuild_keeps_the_last_build_that_built_beside_it(tmp_path):
    from pytorch_cuda_build.stages import build
    log = tmp_path / "build.log"
    log.write_text(LOG)  # a build that ran steps
    assert build._stream(["sh", "-c", "echo the second"], {"PATH": "/usr/bin:/bin"}, log, False) == 0
    assert (tmp_path / "build.previous.log").read_text() == LOG
    assert log.read_text().endswith("the second\n")
    log.write_text(CACHED_LOG)  # every step from the cache: .previous keeps the build that built
    assert build._stream(["sh", "-c", "echo the third"], {"PATH": "/usr/bin:/bin"}, log, False) == 0
    assert (tmp_path / "build.previous.log").read_text() == LOG


def test_a_train_flavors_cold_build_is_reported_alone_with_its_compiles():
    """The naive Dockerfiles are the runtime's baselines: a train image's cold build has none,
    and its report gives the time and the stages that compile, not a ratio to nothing."""
    r = {"image": "2.11.0-cuda13.0-train", "date": "2026-11-28 03:00 UTC", "cpus": 2, "runs": 1, "cold_runs": 1,
         "cold": {"ours_s": [2400.0], "ours_ops_s": [1500.0], "ours_te_s": [1300.0], "ours_python_env_s": [300.0],
                  "ours_cpu_ops_s": [150.0], "naive_s": [], "naive_ops_s": []}}
    md = bench_report.report_markdown(r)
    assert "| cold build, this tool: empty build cache and store, ops compiled (DeepSpeed ops stage 1500 s, " \
           "Transformer Engine stage 1300 s, locked wheels 300 s, partly side by side) | 2400 s (40 min) |" in md
    assert "naive" not in md.split("| series (s)")[0].replace("(naive builds none)", "")
    assert "|   of which Transformer Engine's extension | 1300.00 |" in md
    assert "cold-build.svg" not in md


def test_the_cpu_ops_step_is_found_in_every_flavors_dockerfile():
    """The cold figures name the CPU accelerator's ops step by its command as BuildKit logs it
    (cut to 120 characters): read from the rendered Dockerfiles, so a template change that moves
    it is caught here, not by a report that says 0 s."""
    for name in ("2.7.1-cuda12.1-runtime", "2.11.0-cuda13.0-train"):
        text = (ROOT / "images" / name / "Dockerfile").read_text()
        runs = [" ".join(line.strip() for line in block.splitlines()).replace("\\ ", "")
                for block in text.split("\nRUN ")[1:]]
        ops = [r for r in runs if "cpuops.py" in r]
        assert len(ops) == 1, name
        log = f"#43 [x  2/15] RUN {ops[0]}\n#43 DONE 230.7s\n"
        assert [s["seconds"] for s in bench.steps(log) if bench.cpu_ops_step(s)] == [230.7], name


@pytest.mark.parametrize("flavor", ["devel", "train"])
def test_the_second_row_measure_builds_and_measures_the_twin_of_the_same_flavor(tmp_path, monkeypatch, flavor):
    """The rows measure builds a second row sharing the lock and measures its candidate: the twin's
    build must name its flavor, or build.py builds the runtime row and the measure reads a candidate
    never built. No Docker: the builds are recorded, the engine stood in for."""
    m = matrix.load(ROOT / "matrix.yaml")
    row = m.select("2.7", "12.1", flavor)
    other = dataclasses.replace(row, cuda="12.6")  # a row of the same flavor sharing its lock
    built: list[list[str]] = []
    monkeypatch.setattr(bench, "timed", lambda cmd, env=None, cwd=None: built.append(cmd) or 1.0)
    c = mock.MagicMock()
    run = bench.Run(c, types.SimpleNamespace(images=[row, other]), row, tmp_path, mock.Mock(argv=["docker"]), None, 1, 1,
                    {"rows"}, tmp_path, print)
    bench._measure_rows(run)
    assert [cmd[2:] for cmd in built] == [bench.row_args(row) + ["--quiet", "--no-test"], bench.row_args(other) + ["--quiet", "--no-test"]]
    assert all(cmd[cmd.index("--flavor") + 1] == flavor for cmd in built)
    assert run.r["second_row"]["image"] == other.name == f"2.7.1-cuda12.6-{flavor}"
    assert mock.call(build.candidate_ref(other), noprune=False) in c.images.remove.call_args_list  # the twin's own candidate
