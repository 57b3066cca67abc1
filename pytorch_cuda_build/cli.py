"""The command line: parse the arguments, call the pipeline (pipeline.py) or a stage module,
print. Typed errors are caught here, once, and printed as one line with their exit code."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

from . import arguments as a
from . import ca, console, errors, files, inputs, jobs, matrix, pipeline, scheduler, spec
from .commands import fanout, gpubundle, propose, record, verify, verify_image
from .engine import docker_env
from .errors import PipelineError, UsageErrors
from .jobs import options as job_options
from .jobs import renderers
from .registry import sign
from .stages import build, fetch, lock, publish, render, sbom, tag
from .tooling import bench, engine_current, pullcost, selftest
from .validate import validate

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


def cmd_list(m: matrix.Matrix, args: a.ListOptions) -> int:
    print("\n".join(console.columns(inputs.status(ROOT, m))))
    return 0


def cmd_lock(m: matrix.Matrix, args: a.LockOptions) -> int:
    images = [args.row(m)] if args.torch else list(m.images)
    if args.check_security:
        lines, found = inputs.check_security(ROOT, images, args.security_snapshot, lambda: ca.ca_bundle(args.ca_bundle),
                                             record=args.record)
        print("\n".join(lines))
        if args.record:
            inputs.rerender(ROOT, m, lambda _: None)  # the README table shows the new counts
        return 1 if found else 0  # 1, not an error: CI refreshes the locks on it
    if args.check:
        lock.check(ROOT, images)
        print(f"locks current for {len(images)} image(s)")
        return 0
    moved = inputs.relock(ROOT, m, images, args.upgrade, lambda: ca.ca_bundle(args.ca_bundle), log)
    for line in [f"locks current for {len(images)} image(s); use --upgrade to re-resolve"] if moved is None else moved:
        print(line)
    return 0


def cmd_fetch(m: matrix.Matrix, args: a.FetchOptions) -> int:
    image = args.row(m)
    pipeline.check_inputs(ROOT, m, [image])
    for row in pipeline.platforms(image, args.platform):
        items = lock.build_inputs(ROOT, row).all()
        what = f"{row.name} ({row.platform})"
        if args.from_ is not None:
            fetch.fill_from(items, args.from_, log)
            lacking = fetch.store().missing(items)
            if lacking:
                raise errors.InputUnavailable(f"{args.from_} lacks {len(lacking)} of {what}'s {len(items)} files, "
                                              f"{lacking[0].file} among them", url=lacking[0].url)
        else:
            if args.from_image is not None:
                verify_image.fill_store(jobs.parse_image(args.from_image), items, ca.ca_bundle(args.ca_bundle), log)
            fetch.fetch(items, ca.ca_bundle(args.ca_bundle), log, what)
        if args.to is not None:
            fetch.write_to(items, args.to, log)
        print(f"{what}: {len(items)} files, {fetch.size_text(sum(i.size for i in items))}, in the store {fetch.store().root}")
    return 0


def cmd_render(m: matrix.Matrix, args: a.RenderOptions) -> int:
    if not args.check:
        inputs.rerender(ROOT, m, log)
        return 0
    render.check(ROOT, m, list(m.images))
    print(f"rendered files current for {len(m.images)} image(s)")
    return 0


def cmd_build(m: matrix.Matrix, args: a.BuildOptions) -> int:
    images = args.rows(m)
    pipeline.check_inputs(ROOT, m, images)
    on = pipeline.platforms(images[0], args.platform) if not args.all else images
    if args.dry_run:
        print("\n".join(inputs.plan(ROOT, image) for image in on))
        return 0
    opts = args.found(publish_to=args.push)  # the CA bundle found, --push's registry parsed (its form validated)
    pipeline.preflight(opts, log)  # before an hour of building, like a bad registry address
    with console.make(args.verbose, args.quiet) as con:  # a bad CA failed above, not after waiting for the row lock
        results = scheduler.build(ROOT, m, images, on, opts, con, every=args.all, jobs=args.jobs,
                                  child_argv=opts.child_argv, result_json=args.result_json)
    if opts.push_to and not args.all:
        print("\n".join(publish.table(results[0].moves, opts.push_to, True)))
    if failed := scheduler.failures(results):
        raise failed
    return 0


def cmd_test(m: matrix.Matrix, args: a.ImageTestOptions) -> int:
    for image in pipeline.platforms(args.row(m), args.platform):
        ref = args.image or tag.own_ref(image)
        image_id, mode = pipeline.test_image(ROOT, image, ref, args.require_gpu, log, matrix_path=args.matrix)
        print(f"{ref} ({image_id[:19]}, {image.platform}) passed the smoke and structure tests ({mode})")
    return 0


def cmd_publish(m: matrix.Matrix, args: a.PublishOptions) -> int:
    opts = args.found(publish_to=True)  # a dry run reads the registry too
    for lines in pipeline.publish_command(ROOT, args.rows(m), opts, args.push, args.platform, args.merge, args.sign_key,
                                          args.signatures or ROOT / "build-results" / "signatures", log):
        print(lines)
    return 0


def cmd_signing_key(m: matrix.Matrix, args: a.SigningKeyOptions) -> int:
    fpr, public = sign.generate(args.folder)
    print(f"key {fpr} in {args.folder / sign.HOME} (its passphrase: ${sign.PASSPHRASE_ENV}; keep it secret); "
          f"public key {public} (give it to users)")
    return 0


def cmd_matrix(m: matrix.Matrix, args: a.MatrixOptions) -> int:
    if args.json or args.indexes:
        print(json.dumps(fanout.as_json(m) if args.json else fanout.indexes_json(m), indent=2))
        return 0
    print(propose.render(propose.candidates(m, ca.ca_bundle(args.ca_bundle), log)), end="")
    return 0


def cmd_prune(m: matrix.Matrix, args: a.PruneOptions) -> int:
    c = docker_env.ensure_engine(log)
    removed = build.prune(docker_env.build_client(None), c, m.repository, args.keep_storage)
    print(f"removed {removed} candidate tag(s) and dangling images; build cache bounded to {args.keep_storage}")
    seeds, freed = build.prune_ops_seed(c, {i.on(p).local_name for i in m.images for p in i.platforms})  # after the candidates went
    print(f"dropped {seeds} ops-seed entr{'y' if seeds == 1 else 'ies'} no image names, {freed / 2**20:.1f} MiB")
    return 0


def cmd_verify(m: matrix.Matrix, args: a.VerifyOptions) -> int:
    """Each platform --platform names, in turn: its own two builds, its own verdict. With --image,
    the published image against a rebuild of its row from this checkout (commands/verify_image.py)."""
    if args.image:
        return verify_published(m, args)
    row = args.row(m)
    if args.record:
        return verify_record(m, row, args)
    pipeline.check_inputs(ROOT, m, [row])
    reproducible = True
    for lines, same in verify.each_platform(ROOT, pipeline.platforms(row, args.platform), args.docker, ca.ca_bundle(args.ca_bundle),
                                            log, args.compile_ops):
        print(lines)
        reproducible &= same
    return 0 if reproducible else 1


def cmd_base(m: matrix.Matrix, args: a.BaseOptions) -> int:
    row = args.row(m)
    for line in pipeline.base_command(ROOT, m, pipeline.platforms(row, args.platform), args.docker, args.rebuild, args.record, log):
        print(line)
    return 0


def verify_record(m: matrix.Matrix, row: matrix.Image, args: a.VerifyOptions) -> int:
    """The row's local image (or --against) against a record: no build, no access to the recorded image."""
    assert args.record is not None  # verify_record runs with --record
    image = pipeline.platforms(row, args.platform)[0]
    ref = args.against or tag.own_ref(image)
    lines, same = record.against_record(ref, image.name, args.record, args.docker, log)
    print(f"{image.name} on {image.platform}: {ref} against {args.record}")
    print("\n".join(lines))
    return 0 if same else 1


def cmd_record(m: matrix.Matrix, args: a.RecordOptions) -> int:
    image = pipeline.platforms(args.row(m), args.platform)[0]
    out = args.output or pipeline.results_dir(ROOT, image) / "record.json.xz"
    rec = record.record_local(args.image or tag.own_ref(image), f"{image.name} ({image.platform})", out, args.docker, log)
    print(f"{out}: image {rec.image or '(classic store: no manifest digest)'}, config {rec.config_digest}, "
          f"{len(rec.layers)} layers, {sum(len(layer.entries or {}) for layer in rec.layers)} entries")
    return 0


def verify_published(m: matrix.Matrix, args: a.VerifyOptions) -> int:
    verdict = verify_image.run(ROOT, m, jobs.parse_image(args.image or ""), args.platform or docker_env.host_platform(),
                               args.against, args.docker, ca.ca_bundle(args.ca_bundle), log,
                               lambda image: pipeline.check_inputs(ROOT, m, [image]), lambda image: pipeline.results_dir(ROOT, image))
    print("\n".join(verdict.lines))
    return 0 if verdict.same else 1


def cmd_sbom(m: matrix.Matrix, args: a.SbomOptions) -> int:
    doc = sbom.generate(docker_env.ensure_engine(log), args.image)
    if not args.output:
        sys.stdout.write(sbom.text(doc))
        return 0
    files.write_atomic(args.output, sbom.text(doc))
    log(f"{len(doc['components'])} components written to {args.output}")
    return 0


def cmd_bench(m: matrix.Matrix, args: a.BenchOptions) -> int:
    image = args.row(m)
    only = bench.parse_only(args.only)  # validated, with --yes for the cold measures
    if args.pull_rows is not None:
        pullcost.rows(m, args.pull_rows)  # within the matrix's CUDA 13 rows, before Docker is touched
    c = docker_env.ensure_engine(log)
    print(bench.run(c, m, image, ROOT, only, args.runs, args.cold_runs, args.full, args.yes, args.docker,
                    lambda: ca.ca_bundle(args.ca_bundle), log, pull_rows=args.pull_rows))
    return 0


def cmd_engine(m: matrix.Matrix, args: a.EngineOptions) -> int:
    if args.down:
        log(f"engine ({args.store} store): {'stopped' if engine_current.down(args.store) else 'was not running'}")
        return 0
    env = engine_current.up(args.store, ca.ca_bundle(args.ca_bundle), log=lambda msg: log(msg.removeprefix("engine: ")))
    sys.stdout.write(engine_current.exports(env))
    return 0


def cmd_gpu_bundle(m: matrix.Matrix, args: a.GpuBundleOptions) -> int:
    image = args.row(m)  # DIR, --python, the wheel's source and --limit-mib: validated
    pipeline.check_inputs(ROOT, m, [image])  # the locks it reads are current
    source = gpubundle.WheelSource(args.ops_wheel, args.build_python, args.ops_arch)
    described = gpubundle.write(ROOT, image, args.dir, args.python or image.python, ca.ca_bundle(args.ca_bundle),
                                source, args.limit_mib, log)
    print(f"{args.dir}: {image.name} for Python {described['python']}, ops prebuilt for {described['ops_wheel']['arch_list']}, "
          f"{len(described['files'])} files, {described['size'] / 2**20:.1f} MiB; on the GPU machine: bash {args.dir}/run.sh")
    return 0


def cmd_job(m: matrix.Matrix, args: job_options.JobOptions) -> int:
    image = args.row(m)
    ref = jobs.parse_image(args.image) if args.image else jobs.published(pipeline.results_dir(ROOT, image), image.name)
    job = job_options.job(args, image.name, ref)
    text, path = renderers.render(job), job.target(args.output)
    if path is None:
        sys.stdout.write(text)
        return 0
    files.write_atomic(path, text)
    log(f"{path}: {job.nodes}-node {job.kind or job.runtime} job for {job.scheduler}, image {ref}")
    return 0


def cmd_selftest(m: matrix.Matrix, args: a.SelftestOptions) -> int:
    return selftest.run(ROOT, list(args.pytest_args), m.repository)


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


C = TypeVar("C", bound=spec.Command)


@dataclass(frozen=True)
class Handler(Generic[C]):
    """A command: its options class (the parser's, the rules') and the handler that gets them, typed
    alike so that mypy checks each pair. lost: what a lost Docker daemon leaves as it was, for the
    commands that call it (the pipeline's stages and the commands name their own step first,
    docker_env.calls; this names the command for whatever call lies outside them). The rest reach
    no daemon: a network error of theirs (the package index's, a registry's) is never read as the daemon's."""

    options: type[C]
    run: Callable[[matrix.Matrix, C], int]
    lost: str | None = None

    def __call__(self, parsed: argparse.Namespace) -> int:
        path = parsed.matrix or ROOT / "matrix.yaml"
        args = spec.complete(self.options, parsed, matrix=path)  # frozen and typed
        lost = self.lost
        with docker_env.calls(f"`build.py {self.options.NAME}`", lost) if lost else contextlib.nullcontext():
            return self.run(matrix.load(path), args)


# The commands, in `build.py --help`'s order: the one list.
COMMANDS = (  # not annotated: each pair is inferred on its own, so mypy checks its handler against its class
    Handler(a.BuildOptions, cmd_build, docker_env.NO_TAG_MOVED),
    Handler(a.ListOptions, cmd_list, docker_env.NO_TAG_MOVED),
    Handler(a.MatrixOptions, cmd_matrix),
    Handler(a.PublishOptions, cmd_publish, pipeline.PUSHED_TESTED),
    Handler(a.SigningKeyOptions, cmd_signing_key),
    Handler(a.LockOptions, cmd_lock),
    Handler(a.FetchOptions, cmd_fetch),
    Handler(a.RenderOptions, cmd_render),
    Handler(a.ImageTestOptions, cmd_test, docker_env.NO_TAG_MOVED),
    Handler(a.VerifyOptions, cmd_verify, docker_env.NO_TAG_MOVED),
    Handler(a.RecordOptions, cmd_record, docker_env.NO_TAG_MOVED),
    Handler(a.BaseOptions, cmd_base, docker_env.NO_TAG_MOVED),
    Handler(a.SbomOptions, cmd_sbom, docker_env.NO_TAG_MOVED),
    Handler(a.BenchOptions, cmd_bench, docker_env.NO_TAG_MOVED),
    Handler(a.SelftestOptions, cmd_selftest),
    Handler(a.EngineOptions, cmd_engine),
    Handler(a.GpuBundleOptions, cmd_gpu_bundle),
    Handler(job_options.JobOptions, cmd_job),
    Handler(a.PruneOptions, cmd_prune, "the candidate tags and dangling images not yet removed are still there"),
)
NAMES = tuple(h.options.NAME for h in COMMANDS)


def parser() -> argparse.ArgumentParser:
    return spec.parser([h.options for h in COMMANDS], prog="build.py",
                       description="Build, test and tag pinned PyTorch + CUDA images from matrix.yaml.")


def handler(parsed: argparse.Namespace) -> Handler[Any]:
    """The handler of the command a namespace was parsed for."""
    return next(h for h in COMMANDS if h.options is spec.command_class(parsed))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminated)  # CI cancels with SIGTERM: clean up as for Ctrl-C
    # A shell starting us in the background without job control leaves SIGINT ignored,
    # and Python then keeps it ignored: Ctrl-C and CI cancellations must always clean up.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    skip = 2 if argv[:1] == ["--matrix"] else 1 if argv[:1] and argv[0].startswith("--matrix=") else 0
    first = next((a for a in argv[skip:] if not a.startswith("-")), None)
    if first not in NAMES and not {"-h", "--help"} & set(argv):
        argv.insert(skip, "build")  # `build.py --torch 2.7` means `build.py build --torch 2.7`
    command, push = None, False
    try:
        parsed = validate(parser().parse_args(argv), ROOT / "matrix.yaml")  # every argument, before anything is touched
        command, push = parsed.command, getattr(parsed, "push", False)
        return handler(parsed)(parsed)
    except PipelineError as e:
        for n, line in enumerate(e.lines()):  # each of several usage problems is an error line of its own
            print(f"error: {line}" if n == 0 or isinstance(e, UsageErrors) else line, file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        if command == "publish" or push:
            print("error: interrupted; no alias moved after the interrupt (where every tag is: the line above)", file=sys.stderr)
        else:
            print("error: interrupted; no tag was moved and the candidate's containers were removed", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader stopped early (`build.py matrix --json | head`): quiet, as a shell tool is.
        # stdout goes to /dev/null so that the interpreter's last flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what the shell reports for a tool the pipe ended
