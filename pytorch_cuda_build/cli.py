"""The command line: parse the arguments, call the pipeline (pipeline.py) or a stage module,
print. Typed errors are caught here, once, and printed as one line with their exit code."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from . import arguments as a
from . import ca, console, errors, files, inputs, jobs, matrix, pipeline, scheduler
from .commands import gpubundle, propose, record, verify, verify_image
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
    images = [m.select(args.torch, args.cuda, args.flavor)] if args.torch else list(m.images)
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
    image = m.select(args.torch, args.cuda, args.flavor)
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
    images = scheduler.select_rows(m, args.torch, args.cuda, args.flavor) if args.all else [m.select(args.torch, args.cuda, args.flavor)]
    reg = publish.registry(args.registry, args.retries) if args.push else None  # validated: its form was checked
    pipeline.check_inputs(ROOT, m, images)
    on = pipeline.platforms(images[0], args.platform) if not args.all else images
    if args.dry_run:
        print("\n".join(inputs.plan(ROOT, image) for image in on))
        return 0
    opts = pipeline.Options(docker=args.docker, matrix_path=args.matrix, ca_path=ca.ca_bundle(args.ca_bundle), no_test=args.no_test, retest=args.retest,
                            no_cache=args.no_cache, require_gpu=args.require_gpu, registry=reg, retries=args.retries,
                            allow_vulnerable=args.allow_vulnerable, cache_from=args.cache_from, cache_to=args.cache_to,
                            compression=args.compression, attach_inputs=args.attach_inputs)
    pipeline.preflight(opts, log)  # before an hour of building, like a bad registry address
    with console.make(args.verbose, args.quiet) as con:  # a bad CA failed above, not after waiting for the row lock
        results = scheduler.build(ROOT, m, images, on, opts, con, every=args.all, jobs=args.jobs,
                                  child_argv=lambda image, out: args.child_argv(image, out, opts.ca_path), result_json=args.result_json)
    if reg and not args.all:
        print("\n".join(publish.table(results[0].moves, reg, True)))
    if failed := scheduler.failures(results):
        raise failed
    return 0


def cmd_test(m: matrix.Matrix, args: a.ImageTestOptions) -> int:
    for image in pipeline.platforms(m.select(args.torch, args.cuda, args.flavor), args.platform):
        ref = args.image or tag.own_ref(image)
        image_id, mode = pipeline.test_image(ROOT, image, ref, args.require_gpu, log, matrix_path=args.matrix)
        print(f"{ref} ({image_id[:19]}, {image.platform}) passed the smoke and structure tests ({mode})")
    return 0


def cmd_publish(m: matrix.Matrix, args: a.PublishOptions) -> int:
    images = list(m.images) if args.all else [m.select(args.torch, args.cuda, args.flavor)]
    opts = pipeline.Options(ca_path=ca.ca_bundle(args.ca_bundle), registry=publish.registry(args.registry, args.retries),
                            retries=args.retries, allow_vulnerable=args.allow_vulnerable, compression=args.compression,
                            attach_inputs=args.attach_inputs)
    for lines in pipeline.publish_command(ROOT, images, opts, args.push, args.platform, args.merge, args.sign_key,
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
        print(json.dumps(matrix.as_json(m) if args.json else matrix.indexes_json(m), indent=2))
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
    row = m.select(args.torch, args.cuda, args.flavor)
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
    row = m.select(args.torch, args.cuda, args.flavor)
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
    image = pipeline.platforms(m.select(args.torch, args.cuda, args.flavor), args.platform)[0]
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
    image = m.select(args.torch, args.cuda, args.flavor)
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
    image = m.select(args.torch, args.cuda, args.flavor)  # DIR, --python, the wheel's source and --limit-mib: validated
    pipeline.check_inputs(ROOT, m, [image])  # the locks it reads are current
    source = gpubundle.WheelSource(args.ops_wheel, args.build_python, args.ops_arch)
    described = gpubundle.write(ROOT, image, args.dir, args.python or image.python, ca.ca_bundle(args.ca_bundle),
                                source, args.limit_mib, log)
    print(f"{args.dir}: {image.name} for Python {described['python']}, ops prebuilt for {described['ops_wheel']['arch_list']}, "
          f"{len(described['files'])} files, {described['size'] / 2**20:.1f} MiB; on the GPU machine: bash {args.dir}/run.sh")
    return 0


def cmd_job(m: matrix.Matrix, args: job_options.JobOptions) -> int:
    image = m.select(args.torch, args.cuda, args.flavor)
    ref = jobs.parse_image(args.image) if args.image else jobs.published(pipeline.results_dir(ROOT, image), image.name)
    job = job_options.job(args, image.name, ref)
    text, path = renderers.render(job), jobs.target(job, args.output)
    if path is None:
        sys.stdout.write(text)
        return 0
    files.write_atomic(path, text)
    log(f"{path}: {job.nodes}-node {job.kind or job.runtime} job for {job.scheduler}, image {ref}")
    return 0


def cmd_selftest(m: matrix.Matrix, args: a.SelftestOptions) -> int:
    return selftest.run(ROOT, list(args.pytest_args))


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


HANDLERS: dict[str, Callable[[matrix.Matrix, Any], int]] = {"build": cmd_build, "list": cmd_list, "matrix": cmd_matrix, "lock": cmd_lock, "fetch": cmd_fetch, "render": cmd_render, "test": cmd_test,
            "publish": cmd_publish, "prune": cmd_prune, "selftest": cmd_selftest, "bench": cmd_bench, "sbom": cmd_sbom,
            "verify": cmd_verify, "record": cmd_record, "base": cmd_base, "signing-key": cmd_signing_key, "engine": cmd_engine,
            "gpu-bundle": cmd_gpu_bundle, "job": cmd_job}
assert set(HANDLERS) == set(a.COMMANDS), "each command of arguments.py has its handler here"
# The commands that call the Docker daemon, with what a daemon lost in one leaves as it was. The
# pipeline's stages and the commands name their own step first (docker_env.calls); this names the
# command for whatever call lies outside them. The rest reach no daemon: a network error of theirs
# (the package index's, a registry's) is never read as the daemon's.
ENGINE_COMMANDS = {"build": docker_env.NO_TAG_MOVED, "test": docker_env.NO_TAG_MOVED, "publish": pipeline.PUSHED_TESTED,
                   "prune": "the candidate tags and dangling images not yet removed are still there", "verify": docker_env.NO_TAG_MOVED,
                   "record": docker_env.NO_TAG_MOVED, "base": docker_env.NO_TAG_MOVED, "sbom": docker_env.NO_TAG_MOVED,
                   "bench": docker_env.NO_TAG_MOVED, "list": docker_env.NO_TAG_MOVED}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminated)  # CI cancels with SIGTERM: clean up as for Ctrl-C
    # A shell starting us in the background without job control leaves SIGINT ignored,
    # and Python then keeps it ignored: Ctrl-C and CI cancellations must always clean up.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    skip = 2 if argv[:1] == ["--matrix"] else 1 if argv[:1] and argv[0].startswith("--matrix=") else 0
    first = next((a for a in argv[skip:] if not a.startswith("-")), None)
    if first not in a.COMMANDS and not {"-h", "--help"} & set(argv):
        argv.insert(skip, "build")  # `build.py --torch 2.7` means `build.py build --torch 2.7`
    command, push = None, False
    try:
        parsed = validate(a.parser().parse_args(argv), ROOT / "matrix.yaml")  # every argument, before anything is touched
        command, push = parsed.command, getattr(parsed, "push", False)
        args = a.options(parsed, matrix=parsed.matrix or ROOT / "matrix.yaml")  # frozen and typed: what the handler gets
        with docker_env.calls(f"`build.py {command}`", ENGINE_COMMANDS[command]) if command in ENGINE_COMMANDS else contextlib.nullcontext():
            return HANDLERS[command](matrix.load(args.matrix), args)
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
