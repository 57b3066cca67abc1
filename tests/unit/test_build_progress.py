"""BuildKit's progress read as events (progress.py) and what the consoles make of them."""
from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace

from pytorch_cuda_build import console, progress
from pytorch_cuda_build.stages import build
from pytorch_cuda_build.tooling import bench

# Recorded: the start of a real build.log of 2.7.1-cuda12.1-runtime (Docker 20.10's built-in
# BuildKit), long RUN lines cut; #9 and #13 ran side by side, so BuildKit re-announced #9.
PLAIN = """\
$ /usr/bin/docker build --progress=plain --file images/2.7.1-cuda12.1-runtime/Dockerfile --target runtime
#1 [internal] load build definition from Dockerfile
#1 sha256:1e6a765348a56a95b04ee56a2be5289fcf1f01567c543943d1dae566558d03b3
#1 transferring dockerfile: 10.96kB done
#1 DONE 0.0s

#4 [base 1/3] FROM docker.io/library/pytorch-cuda-rootfs:bookworm-a6e2c6c06377
#4 sha256:7a3d9b0cce4676272ddae6987ebca76ea751908c53ac2895d7b9635b697378fb
#4 DONE 0.0s

#5 [base 2/3] RUN apt-get update  && apt-get install -y --no-install-recommends ca-certificates=20230311+deb12u1
#5 sha256:155d48254c49f2ec5f2697d8cb4258746a7bb2285bbfd50b5c61cf51e96b0c0d
#5 0.560 Get:1 http://deb.debian.org/debian bookworm InRelease [151 kB]
#5 DONE 49.1s

#8 [python-env 1/2] COPY requirements.lock /opt/pytorch-cuda/requirements.lock
#8 CACHED

#9 [python-env 2/2] RUN --mount=type=cache,id=pytorch-cuda-wheelhouse,target=/wheelhouse,sharing=locked     --mount=type=secret,id=ca     set -eu;
#9 sha256:79ac8832ca14712e335bb1ad08f5351fbae077dfb41def5d34b161f4db1dc95a
#9 ...

#13 [cuda-toolkit 3/3] RUN --mount=type=cache,id=pytorch-cuda-debs,target=/debs,sharing=locked     python3 /opt/pytorch-cuda/toolkit.py debs
#13 sha256:e0e6bb7ee5a61be6bf517bcf717740791484d5fc5086cfe48b144703d2e55a54
#13 108.2 toolkit: unpacked nvidia-cuda-dev=12.4.127~12.4.1-2
#13 DONE 135.0s

#9 [python-env 2/2] RUN --mount=type=cache,id=pytorch-cuda-wheelhouse,target=/wheelhouse,sharing=locked     --mount=type=secret,id=ca     set -eu;
#9 sha256:79ac8832ca14712e335bb1ad08f5351fbae077dfb41def5d34b161f4db1dc95a
#9 DONE 256.6s
"""
# How the same BuildKit reports a failing step and the step it cancels beside it.
FAILED = """\
#17 [ops-builder 5/5] RUN python /opt/pytorch-cuda/opsbuild.py /wheelhouse/deepspeed-0.17.6.tar.gz
#17 12.3 ERROR: no nvcc
#17 ERROR: executor failed running [/bin/sh -c python /opt/pytorch-cuda/opsbuild.py]: exit code: 1
#18 [runtime 2/9] COPY --from=ops-builder /dist /dist
#18 CANCELED
------
 > [ops-builder 5/5] RUN python /opt/pytorch-cuda/opsbuild.py /wheelhouse/deepspeed-0.17.6.tar.gz:
------
"""


def test_plain_events_announce_each_step_once():
    p = progress.PlainParser()
    events = [ev for line in PLAIN.splitlines(keepends=True) for ev in p.feed(line)]
    started = [ev.step for ev in events if isinstance(ev, progress.Started)]
    assert [s.id for s in started] == ["1", "4", "5", "8", "9", "13"]
    assert started[2].position == ("base", 2, 3) and started[2].name.startswith("RUN apt-get update")
    assert started[0].position is None and started[0].stage == "internal"
    assert progress.Done("9", 256.6) in events and progress.Cached("8") in events
    assert progress.Output("13", "toolkit: unpacked nvidia-cuda-dev=12.4.127~12.4.1-2") in events


def test_bench_steps_read_through_the_parser():
    st = bench.steps(PLAIN)
    assert [(s["stage"], s["seconds"], s["cached"]) for s in st] == [
        ("base", 0.0, False), ("base", 49.1, False), ("python-env", 0.0, True),
        ("python-env", 256.6, False), ("cuda-toolkit", 135.0, False)]


def test_the_failed_step_is_the_one_buildkit_marked_error(tmp_path):
    log = tmp_path / "build.log"
    log.write_text(PLAIN + FAILED)
    assert build.failed_step(log) == "step [ops-builder 5/5] RUN python /opt/pytorch-cuda/opsbuild.py /wheelhouse/deepspeed-0.17.6.tar.gz"
    assert progress.failed_step(PLAIN) is None


def _status(**kw) -> str:
    return json.dumps(kw, indent=2) + "\n"  # BuildKit indents its rawjson objects


def test_rawjson_gives_the_same_events():
    d1, d2 = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    text = ("$ docker buildx build --load --progress=rawjson --file Dockerfile .\n"
            + _status(vertexes=[{"digest": d1, "name": "[python-env 2/2] RUN pip install", "started": "2026-01-01T00:00:00.5Z"}])
            + _status(logs=[{"vertex": d1, "stream": 1, "data": base64.b64encode(b"Collecting torch\n").decode()}])
            + _status(vertexes=[{"digest": d1, "name": "[python-env 2/2] RUN pip install", "started": "2026-01-01T00:00:00.5Z",
                                 "completed": "2026-01-01T00:01:33.712345678Z"},
                                {"digest": d2, "name": "[base 2/3] RUN apt-get update", "cached": True,
                                 "started": "2026-01-01T00:00:00Z", "completed": "2026-01-01T00:00:00Z"}]))
    assert progress.detect(text) == progress.RAWJSON
    p = progress.RawJSONParser()
    events = [ev for line in text.splitlines(keepends=True) for ev in p.feed(line)]
    assert progress.Output(d1, "Collecting torch") in events
    assert progress.Done(d1, 93.2) in events and progress.Cached(d2) in events
    assert [(s["stage"], s["seconds"], s["cached"]) for s in progress.steps(text)] == [("python-env", 93.2, False), ("base", 0.0, True)]
    assert "[python-env 2/2] RUN pip install" in progress.readable(text)


def test_the_tail_shown_after_a_failure_is_the_failed_steps_own_output(tmp_path):
    """rawjson: the failed step started first, others after it; their lines must not hide its own."""
    bad, later = "sha256:" + "c" * 64, "sha256:" + "d" * 64
    text = ("$ docker buildx build --load --progress=rawjson --file Dockerfile .\n"
            + _status(vertexes=[{"digest": "sha256:" + "e" * 64, "name": "[base 2/3] RUN apt-get update",
                                 "started": "2025-12-31T23:59:59Z", "completed": "2026-01-01T00:00:09Z",
                                 "error": "context canceled"}])
            + _status(vertexes=[{"digest": bad, "name": "[python-env 2/2] RUN pip download", "started": "2026-01-01T00:00:00Z"}])
            + _status(vertexes=[{"digest": later, "name": "[cuda-toolkit 3/3] RUN toolkit.py debs", "started": "2026-01-01T00:00:01Z"}])
            + _status(logs=[{"vertex": bad, "stream": 2, "data": base64.b64encode(
                b"WARNING: Retrying after SSLError(CERTIFICATE_VERIFY_FAILED)\n").decode()}])
            + "".join(_status(logs=[{"vertex": later, "stream": 1, "data": base64.b64encode(f"unpacked deb {i}\n".encode()).decode()}])
                      for i in range(40))
            + _status(vertexes=[{"digest": bad, "name": "[python-env 2/2] RUN pip download", "started": "2026-01-01T00:00:00Z",
                                 "completed": "2026-01-01T00:00:09Z", "error": "process did not complete successfully: exit code: 1"},
                                {"digest": later, "name": "[cuda-toolkit 3/3] RUN toolkit.py debs", "started": "2026-01-01T00:00:01Z",
                                 "completed": "2026-01-01T00:00:09Z", "error": "context canceled"}]))
    log = tmp_path / "build.log"
    log.write_text(text)
    assert "unpacked deb 39" in progress.readable(text).splitlines()[-2]  # what the plain tail would have shown
    assert progress.log_tail(log).splitlines() == ["[python-env 2/2] RUN pip download",
                                            "WARNING: Retrying after SSLError(CERTIFICATE_VERIFY_FAILED)",
                                            "ERROR: process did not complete successfully: exit code: 1"]
    plain = tmp_path / "plain.log"
    plain.write_text(PLAIN + FAILED)
    assert progress.log_tail(plain).splitlines()[0] == "[ops-builder 5/5] RUN python /opt/pytorch-cuda/opsbuild.py /wheelhouse/deepspeed-0.17.6.tar.gz"
    assert progress.log_tail(plain).splitlines()[-1].startswith("ERROR: ")


def test_ci_console_prints_one_line_per_finished_step():
    err = io.StringIO()
    sink = console.CI(err=err, out=io.StringIO()).build_sink()
    for line in (PLAIN + FAILED).splitlines(keepends=True):
        sink(line)
    lines = err.getvalue().splitlines()
    assert lines[0] == "[base 1/3] FROM docker.io/library/pytorch-cuda-rootfs:bookworm-a6e2 ... 0.0s"
    assert lines[1] == "[base 2/3] RUN apt-get update && apt-get install -y --no-install-re ... 49.1s"
    assert lines[2] == "[python-env 1/2] COPY requirements.lock /opt/pytorch-cuda/requirements.lock CACHED"
    assert lines[3].startswith("[cuda-toolkit 3/3] RUN --mount") and lines[3].endswith(" ... 135.0s")
    assert lines[4].startswith("[python-env 2/2] RUN --mount") and lines[4].endswith(" 256.6s")
    assert lines[5].startswith("[ops-builder 5/5] RUN python /opt/pytorch-cuda/opsbuild.py") and lines[5].endswith(
        " FAILED after 0.0s: executor failed running [/bin/sh -c python /opt/pytorch-cuda/opsbuild.py]: exit code: 1")
    assert len(lines) == 6  # internal vertices, output and the canceled step print nothing


def test_smoke_steps_and_totals_get_a_line():
    assert console.smoke_line("  zero3_cpu2: rc=0 45.1s") == "[smoke] zero3_cpu2 ok 45.1s"
    assert console.smoke_line("  fsdp2_cpu2: rc=1 3.0s") == "[smoke] fsdp2_cpu2 FAILED (exit 1) 3.0s"
    assert console.smoke_line("  ddp_cpu2: rc=-9 600.0s TIMEOUT") == "[smoke] ddp_cpu2 TIMEOUT 600.0s"
    assert console.smoke_line("138 passed, 0 failed, 12 skipped, 3 info in 237s; report /results/report.json") == \
        "[smoke] 138 passed, 0 failed, 12 skipped, 3 info in 237s"
    assert console.smoke_line("CHECK  RUN  RANK  STATUS  DETAIL") is None


def test_summary_table_has_a_row_per_result_and_the_errors_below():
    ok = SimpleNamespace(image="2.7.1-cuda12.1-runtime", ok=True, exit_code=0, size_bytes=6.22e9, total=800.0,
                         seconds={"engine": 1.0, "build": 700.0, "test": 99.0}, tags=["pytorch-cuda:2.7.1-cuda12.1-runtime", "pytorch-cuda:v2.7"],
                         error=[])
    bad = SimpleNamespace(image="2.7.1-cuda12.6-runtime", ok=False, exit_code=1, size_bytes=0, total=30.0,
                          seconds={"engine": 1.0, "build": 29.0}, tags=[], error=["build failed at step [python-env 2/2] RUN ...", "tail"])
    lines = console.summary_table([ok, bad])
    assert lines[0].split() == ["ROW", "RESULT", "SIZE", "ENGINE", "BUILD", "TEST", "TOTAL", "TAGS"]
    assert lines[1].split() == ["2.7.1-cuda12.1-runtime", "ok", "6.22", "GB", "1.0s", "700.0s", "99.0s", "800.0s",
                                "pytorch-cuda:2.7.1-cuda12.1-runtime", "pytorch-cuda:v2.7"]
    assert lines[2].split() == ["2.7.1-cuda12.6-runtime", "exit", "1", "-", "1.0s", "29.0s", "-", "30.0s", "-"]
    assert lines[3] == "2.7.1-cuda12.6-runtime: build failed at step [python-env 2/2] RUN ..."


# A build stopped mid-way (Ctrl-C, the daemon gone): #10 started, wrote output and never ended;
# #11 failed while #12, beside it, never said anything more.
STOPPED = """\
#10 [ops-builder 5/5] RUN python /opt/pytorch-cuda/opsbuild.py /wheelhouse/deepspeed-0.17.6.tar.gz
#10 3.1 building op cpu_adam
#10 12.3 [12/40] c++ -MMD -MF cpu_adam.o.d
"""
FAILED_BESIDE = """\
#11 [python-env 2/2] RUN pip install --no-deps -r requirements.lock
#12 [cuda-toolkit 3/3] RUN python3 /opt/pytorch-cuda/toolkit.py debs
#11 4.0 ERROR: hash mismatch
#11 ERROR: executor failed running [/bin/sh -c pip install]: exit code: 1
"""


def test_a_plain_step_that_never_ended_is_unfinished_with_how_long_it_ran():
    records = {r.step.id: r for r in progress.replay(PLAIN + STOPPED)}
    assert not records["10"].finished and records["10"].seconds == 12.3
    assert records["10"].end == "NOT FINISHED after 12.3s"
    assert records["9"].finished and records["9"].end == "DONE 256.6s"
    assert records["1"].end == "DONE 0.0s"  # a step BuildKit timed at 0.0s stays done
    assert progress.steps(PLAIN + STOPPED)[-1] == {
        "stage": "ops-builder", "cmd": "RUN python /opt/pytorch-cuda/opsbuild.py /wheelhouse/deepspeed-0.17.6.tar.gz",
        "seconds": 12.3, "cached": False, "finished": False}


def test_in_a_failed_build_the_step_beside_the_failure_is_unfinished_not_done():
    records = {r.step.id: r for r in progress.replay(FAILED_BESIDE)}
    assert records["11"].end == "ERROR: executor failed running [/bin/sh -c pip install]: exit code: 1"
    assert not records["12"].finished and records["12"].end == "NOT FINISHED"  # no output: no time known
    assert progress.failed_step(FAILED_BESIDE) == "[python-env 2/2] RUN pip install --no-deps -r requirements.lock"


def _log(vertex: str, text: str, when: str) -> str:
    return _status(logs=[{"vertex": vertex, "stream": 1, "data": base64.b64encode(text.encode()).decode(), "timestamp": when}])


def test_a_rawjson_step_that_never_ended_reads_not_finished_never_done_0s(tmp_path):
    ran, queued, done = "sha256:" + "f" * 64, "sha256:" + "1" * 64, "sha256:" + "2" * 64
    text = ("$ docker buildx build --load --progress=rawjson --file Dockerfile .\n"
            # BuildKit lists the vertices of the build before it starts them
            + _status(vertexes=[{"digest": d, "name": n} for d, n in (
                (done, "[base 2/3] RUN apt-get update"), (ran, "[ops-builder 5/5] RUN python opsbuild.py"),
                (queued, "[runtime 2/9] COPY --from=ops-builder /dist /dist"))])
            + _status(vertexes=[{"digest": done, "name": "[base 2/3] RUN apt-get update",
                                 "started": "2026-01-01T00:00:00Z", "completed": "2026-01-01T00:00:04Z"}])
            + _status(vertexes=[{"digest": ran, "name": "[ops-builder 5/5] RUN python opsbuild.py", "started": "2026-01-01T00:00:05Z"}])
            + _log(ran, "building op cpu_adam\n", "2026-01-01T00:00:08.5Z")
            + _status(statuses=[{"id": "x", "vertex": done, "timestamp": "2026-01-01T00:00:17.3Z"}]))
    records = progress.replay(text)
    assert [r.step.name for r in records] == ["RUN apt-get update", "RUN python opsbuild.py"]  # the queued one never began
    assert [(r.finished, r.seconds) for r in records] == [(True, 4.0), (False, 12.3)]
    p = progress.RawJSONParser()
    outputs = [ev for line in text.splitlines(keepends=True) for ev in p.feed(line) if isinstance(ev, progress.Output)]
    assert [(o.text, o.seconds) for o in outputs] == [("building op cpu_adam", 3.5)]
    readable = progress.readable(text)
    assert f"#{ran[7:19]} NOT FINISHED after 12.3s" in readable.splitlines() and "DONE 0.0s" not in readable
    log = tmp_path / "build.log"
    log.write_text(text)
    assert progress.log_tail(log).splitlines()[-1] == f"#{ran[7:19]} NOT FINISHED after 12.3s"  # what a user sees after Ctrl-C


def test_a_stage_of_ten_steps_or_more_keeps_its_padded_steps():
    """BuildKit pads k to M's width: `[train  2/15]`. Read as no position, the bench dropped the
    train stage's first nine steps (the CPU ops' 230 s among them) from a cold build's figures."""
    log = ("#43 [train  2/15] RUN env -u TORCH_EXTENSIONS_DIR python /tmp/cpuops.py\n#43 DONE 230.7s\n\n"
           "#44 [ 3/12] RUN true\n#44 DONE 1.0s\n\n#45 [train 10/15] RUN pip check\n#45 DONE 2.0s\n")
    assert [(s["stage"], s["seconds"]) for s in bench.steps(log)] == [("train", 230.7), ("train", 2.0)]
    assert progress.Step("44", " 3/12", "RUN true").position == ("", 3, 12)
