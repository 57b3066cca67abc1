"""The command line: parse, run one pipeline stage or all of them, print errors once.

    build.py [build] --torch 2.7 [--cuda 12.1] [--flavor runtime]   lock-check, render-check, build, test, tag
    build.py list | lock [--check|--upgrade] | render [--check] | test | prune
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import base, bench, build, docker_env, lock, matrix, publish, render, sbom, tag, test, verify
import docker.errors
import requests
from filelock import FileLock, Timeout

from . import files
from .errors import BuildError, EnvironmentProblem, PipelineError, UsageError

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("build", "list", "matrix", "lock", "render", "test", "publish", "prune", "selftest", "bench", "sbom", "verify")


def log(msg: str) -> None:
    print(f"==> {msg}", file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, like every other bad input
        raise UsageError(f"{message} (see --help)")


def _selection(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--torch", required=required, help="torch minor (2.7) or full version (2.7.1)")
    p.add_argument("--cuda", help="CUDA platform, e.g. 12.1; default: the torch minor's default row")
    p.add_argument("--flavor", default="runtime", help="image flavor: runtime (default) or devel (adds the CUDA toolkit)")


def _registry(p: argparse.ArgumentParser, push_help: str) -> None:
    p.add_argument("--registry", default=os.environ.get("PYTORCH_CUDA_REGISTRY"), help="HOST[:PORT]/NAMESPACE (default: $PYTORCH_CUDA_REGISTRY)")
    p.add_argument("--push", action="store_true", help=push_help)
    p.add_argument("--retries", type=int, default=4, help="attempts per registry call (default 4, exponential backoff)")
    if not any(a.dest == "ca_bundle" for a in p._actions):
        p.add_argument("--ca-bundle", help="CA bundle for an HTTPS registry (default: pip's configured cert)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="build.py", description="Build, test and tag pinned PyTorch + CUDA images from matrix.yaml.")
    p.add_argument("--matrix", type=Path, default=ROOT / "matrix.yaml", help="matrix file (default: matrix.yaml)")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    b = sub.add_parser("build", help="build, test and tag one row (the default command), or many with --all")
    _selection(b, required=False)
    b.add_argument("--all", action="store_true", help="every row (of --torch, if given): each built, tested and tagged as on its own")
    b.add_argument("--jobs", type=int, default=1, help="with --all: rows built at once (shared layers are built once)")
    b.add_argument("--docker", help="Docker CLI to build with (default: $PYTORCH_CUDA_DOCKER, else detected)")
    b.add_argument("--ca-bundle", help="CA bundle for HTTPS inside the build (default: pip's configured cert)")
    b.add_argument("--no-test", action="store_true", help="build only; sets no public tag")
    b.add_argument("--retest", action="store_true", help="test even if this image ID already passed")
    b.add_argument("--no-cache", action="store_true", help="build without the layer cache")
    b.add_argument("--require-gpu", action="store_true", help="fail instead of testing on the CPU when no GPU runtime exists")
    b.add_argument("--dry-run", action="store_true", help="print the plan without calling Docker")
    b.add_argument("--quiet", action="store_true", help="do not stream the build log (it is still saved)")
    _registry(b, "after tagging, publish the row (see `publish`)")

    sub.add_parser("list", help="the matrix: what can be built, what is built")

    mx = sub.add_parser("matrix", help="the matrix for machines: --json rows for a CI fan-out, --propose new torch releases")
    mode = mx.add_mutually_exclusive_group(required=True)
    mode.add_argument("--json", action="store_true", help="every row with its tags and build arguments, as JSON")
    mode.add_argument("--propose", action="store_true", help="candidate rows for torch releases on the index that the matrix lacks (network)")
    mx.add_argument("--ca-bundle")

    pb = sub.add_parser("publish", help="push tested images and their tags to a registry (dry run without --push)")
    _selection(pb, required=False)
    pb.add_argument("--all", action="store_true", help="every row of the matrix (each must be built and tested)")
    _registry(pb, "push for real; without it, print what would move")

    lk = sub.add_parser("lock", help="resolve rows into images/<image>/ lock files (network)")
    _selection(lk, required=False)
    lk.add_argument("--check", action="store_true", help="fail if any lock is stale (offline)")
    lk.add_argument("--upgrade", action="store_true", help="re-resolve and print the version changes")
    lk.add_argument("--ca-bundle")

    r = sub.add_parser("render", help="render images/<image>/Dockerfile (offline)")
    r.add_argument("--check", action="store_true", help="fail on drift from templates/ and the locks")

    t = sub.add_parser("test", help="run the smoke and structure tests against a built image")
    _selection(t)
    t.add_argument("--image", help="image reference or ID to test (default: the row's own tag)")
    t.add_argument("--require-gpu", action="store_true")

    vf = sub.add_parser("verify", help="build a row twice without cache and compare the images file by file")
    _selection(vf)
    vf.add_argument("--docker")
    vf.add_argument("--ca-bundle")

    sb = sub.add_parser("sbom", help="CycloneDX SBOM (Python and Debian packages) of any local image")
    sb.add_argument("image", help="image reference or ID")
    sb.add_argument("--output", type=Path, help="file to write (default: stdout)")

    bn = sub.add_parser("bench", help="measure (never assert): --full for size, build times and banner, else the banner only")
    _selection(bn)
    bn.add_argument("--runs", type=int, default=10, help="repetitions of the quick measurements (default 10)")
    bn.add_argument("--full", action="store_true", help="every benchmark; report in bench/ (~15 min; empties the build cache for the cold builds)")
    bn.add_argument("--cold-runs", type=int, default=1, help="with --full: cold builds of each kind (default 1)")
    bn.add_argument("--only", default=",".join(bench.MEASURES), help="with --full: comma list of " + ",".join(bench.MEASURES))
    bn.add_argument("--yes", action="store_true", help="allow the cold and matrix measures to empty this daemon's whole build cache")
    bn.add_argument("--docker")
    bn.add_argument("--ca-bundle")

    st = sub.add_parser("selftest", help="this project's own test suite (sets up Docker first)")
    st.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments")

    pr = sub.add_parser("prune", help="remove candidate images and bound the build cache")
    pr.add_argument("--keep-storage", default="40GB", help="build cache to keep (default 40GB)")
    return p


def default_ca_bundle() -> str | None:
    """The CA file pip or requests is configured with, if any: corporate proxies need it."""
    for var in ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE"):
        if os.environ.get(var):
            return os.environ[var]
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".cert"):
            return value.strip("'\"")
    return None


def ca_bundle(given: str | None) -> str | None:
    path = given or default_ca_bundle()
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise UsageError(f"cannot read CA bundle {path}: {e.strerror}") from None
    return path


def results_dir(image: matrix.Image) -> Path:
    return ROOT / "build-results" / image.name


# ---- commands ----------------------------------------------------------------


def cmd_list(m: matrix.Matrix, args) -> int:
    try:
        c = docker_env.client()
    except EnvironmentProblem:
        c = None
    rows = [("IMAGE", "TORCH", "CUDA", "WHEEL CUDA", "CUDNN", "NCCL", "DEEPSPEED", "PY", "LOCK", "BUILT", "TAGS")]
    for i in m.images:
        lock_ok = "ok" if not lock.problems(ROOT, i) else "STALE"
        built = "?" if c is None else ("yes" if tag.current(c, i)[i.refs()[0]] else "no")
        rows.append((i.name, i.torch, i.cuda, i.wheel_cuda, i.cudnn, i.nccl, i.deepspeed, i.python, lock_ok, built, " ".join(i.tags[1:])))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    return 0


def _writing_images() -> FileLock:
    """One writer of images/ at a time per checkout: two `lock`/`render` runs never interleave files."""
    base.STATE_DIR.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    return FileLock(str(base.STATE_DIR / f"images-{key}.lock"))


def cmd_lock(m: matrix.Matrix, args) -> int:
    with _writing_images():
        return _lock(m, args)


def _lock(m: matrix.Matrix, args) -> int:
    images = [m.select(args.torch, args.cuda, args.flavor)] if args.torch else list(m.images)
    if args.check:
        lock.check(ROOT, images)
        print(f"locks current for {len(images)} image(s)")
        return 0
    before = {i.name: lock.read(ROOT, i).get("pins", {}) for i in images if (lock.image_dir(ROOT, i) / "lock.json").exists()}
    stale = images if args.upgrade else [i for i in images if lock.problems(ROOT, i)]
    if not stale:
        print(f"locks current for {len(images)} image(s); use --upgrade to re-resolve")
        return 0
    lock.write(ROOT, m, stale, ca_bundle(args.ca_bundle), log=log)
    for i in stale:
        _print_changes(i, before.get(i.name, {}), lock.read(ROOT, i)["pins"])
    render.write(ROOT, m, stale, log=log)
    return 0


def _print_changes(image: matrix.Image, old: dict, new: dict) -> None:
    for name in sorted(set(old) | set(new)):
        if old.get(name) != new.get(name):
            print(f"{image.name}: {name} {old.get(name, '-')} -> {new.get(name, '-')}")


def cmd_render(m: matrix.Matrix, args) -> int:
    if args.check:
        render.check(ROOT, m, list(m.images))
        print(f"rendered files current for {len(m.images)} image(s)")
    else:
        with _writing_images():
            render.write(ROOT, m, list(m.images), log=log)
    return 0


def _plan(image: matrix.Image) -> None:
    d = lock.image_dir(ROOT, image)
    print(f"row:        torch {image.torch} for CUDA platform {image.cuda} (wheel CUDA {image.wheel_cuda}), {image.flavor}")
    print(f"pins:       cuDNN {image.cudnn}, NCCL {image.nccl}, DeepSpeed {image.deepspeed}, Python {image.python}")
    if image.note:
        print(f"note:       {image.note}")
    print(f"base:       {render.base_ref(image)} ({image.os.kind}: {image.os_name})")
    print(f"tags:       {' '.join(image.refs())}")
    print(f"lock:       {d / 'requirements.lock'} (sha256 {lock.read(ROOT, image)['files_sha256'][:16]}...)")
    print(f"dockerfile: {d / 'Dockerfile'}\n")
    print((d / "Dockerfile").read_text())


def cmd_build(m: matrix.Matrix, args) -> int:
    if args.all:
        return _build_many(m, args)
    image = m.select(args.torch, args.cuda, args.flavor)
    if args.push:
        args.registry_parsed = _parse_registry(args)  # bad address: fail before an hour of building
    lock.check(ROOT, [image])
    render.check(ROOT, m, [image])
    if args.dry_run:
        _plan(image)
        return 0
    args.ca_path = ca_bundle(args.ca_bundle)  # bad input fails now, not after waiting for the row lock
    # Two runs of the same row would race on its candidate tag; different rows run in parallel.
    base.STATE_DIR.mkdir(parents=True, exist_ok=True)
    row_lock = FileLock(str(base.STATE_DIR / f"build-{image.name}.lock"))
    try:
        row_lock.acquire(timeout=1)
    except Timeout:
        log(f"another build of {image.name} is running; waiting for it")
        row_lock.acquire()
    try:
        return _build(image, args)
    finally:
        row_lock.release()


def _passthrough(args) -> list[str]:
    out = ["--quiet"] + [f"--{f.replace('_', '-')}" for f in ("no_test", "retest", "no_cache", "require_gpu", "push") if getattr(args, f)]
    for f in ("docker", "ca_bundle", "registry"):
        if getattr(args, f):
            out += [f"--{f.replace('_', '-')}", str(getattr(args, f))]
    return out + ["--retries", str(args.retries)]


def _build_many(m: matrix.Matrix, args) -> int:
    """Rows as separate build.py processes, `--jobs` at a time. BuildKit merges the steps
    that concurrent builds share, so a layer common to several rows is built once."""
    images = [i for i in m.images if i.flavor == args.flavor and args.torch in (None, i.torch, i.torch_minor) and args.cuda in (None, i.cuda)]
    if not images:
        raise UsageError(f"no rows match --torch {args.torch} --cuda {args.cuda} --flavor {args.flavor}")
    if args.jobs < 1 or args.dry_run:
        raise UsageError("--jobs must be at least 1" if args.jobs < 1 else "--dry-run takes one row, not --all")
    if args.push:
        _parse_registry(args)
    lock.check(ROOT, images)
    render.check(ROOT, m, images)
    docker_env.ensure_engine(log)
    pending, running, done = list(images), {}, {}
    try:
        while pending or running:
            while pending and len(running) < args.jobs:
                image = pending.pop(0)
                results_dir(image).mkdir(parents=True, exist_ok=True)
                out = open(results_dir(image) / "run.log", "w")
                cmd = [sys.executable, str(ROOT / "build.py"), "--matrix", str(args.matrix), "build", "--torch", image.torch,
                       "--cuda", image.cuda, "--flavor", image.flavor, *_passthrough(args)]
                running[subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)] = (image, time.monotonic(), out)
                log(f"{image.name}: started (log: {out.name})")
            for proc in [p for p in running if p.poll() is not None]:
                image, t0, out = running.pop(proc)
                out.close()
                errors = [ln for ln in Path(out.name).read_text().splitlines() if ln.startswith("error: ")]
                done[image.name] = (proc.returncode, time.monotonic() - t0, errors[0][7:] if errors else "")
                log(f"{image.name}: {'ok' if proc.returncode == 0 else 'FAILED'} after {done[image.name][1]:.0f} s")
            time.sleep(0.5)
    except KeyboardInterrupt:
        for proc in running:  # each row cleans up its own containers and moves no tag
            proc.send_signal(signal.SIGTERM)
        for proc in running:
            proc.wait(timeout=300)
        raise
    for name, (rc, secs, err) in done.items():
        print(f"{name:32} {'ok' if rc == 0 else f'exit {rc}':8} {secs:6.0f} s  {err}".rstrip())
    failed = [n for n, (rc, _, _) in done.items() if rc != 0]
    if failed:
        raise PipelineError(f"{len(failed)} of {len(done)} rows failed: {', '.join(failed)} (each row's run.log under build-results/)")
    return 0


def _build(image: matrix.Image, args) -> int:
    ca = args.ca_path
    timer = build.Timer()
    results = results_dir(image)
    results.mkdir(parents=True, exist_ok=True)
    with timer("engine"):
        c = docker_env.ensure_engine(log)
        bc = docker_env.build_client(args.docker)
        build.check_disk(docker_env.root_dir(c))
    with timer("base"):
        base_id = base.ensure(c, image, results, log, docker_cli=bc.argv[0])
    log(f"building {image.name} with {bc.description} (log: {results / 'build.log'})")
    with timer("build"):
        try:
            image_id = build.run(bc, ROOT, image, results / "build.log", ca, args.no_cache, echo=not args.quiet, base_id=base_id)
        except BuildError:
            if not docker_env.answers(c):  # not a failing step: the daemon itself went away
                raise docker_env.lost("the build") from None
            raise
    if args.no_test:
        log(f"built candidate {build.candidate_ref(image)} ({image_id[:19]}); --no-test: no public tag set")
        return 0
    code = test.code_hash(ROOT)  # hashed before the run: the record names the code that ran
    prior = None if args.retest else tag.reusable_pass(image_id, args.require_gpu, code)
    if prior:
        log(f"image {image_id[:19]} already passed its tests ({prior['mode']}) and the test code is unchanged; not re-testing (--retest to force)")
    else:
        with timer("test"):
            report = test.run(c, ROOT, image, image_id, results, args.require_gpu, log, matrix_path=args.matrix)
        tag.record_pass(image, image_id, report, code)
    with timer("sbom"):
        doc = sbom.generate(c, image_id)
        files.write_atomic(results / "sbom.cdx.json", json.dumps(doc, indent=1, sort_keys=True) + "\n")
    with timer("tag"):
        refs = tag.promote(c, image, image_id)
        c.images.remove(build.candidate_ref(image), noprune=True)
    _summary(c, image_id, refs, timer, results, base_id)
    if args.push:
        _publish(c, [image], args.registry_parsed, True, args)
    return 0


def _summary(c, image_id: str, refs: list[str], timer: build.Timer, results: Path, base_id: str) -> None:
    size = c.images.get(image_id).attrs.get("Size", 0)
    summary = {"image_id": image_id, "base_id": base_id, "tags": refs, "size_bytes": size, "seconds": {k: round(v, 1) for k, v in timer.stages.items()}}
    (results / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"image:  {image_id}")
    print(f"tags:   {' '.join(refs)}")
    print(f"size:   {size / 1e9:.2f} GB")
    print("time:   " + ", ".join(f"{k} {v:.1f}s" for k, v in timer.stages.items()))
    print(f"logs:   {results}")


def cmd_test(m: matrix.Matrix, args) -> int:
    image = m.select(args.torch, args.cuda, args.flavor)
    c = docker_env.ensure_engine(log)
    ref = args.image or image.refs()[0]
    try:
        image_id = c.images.get(ref).id
    except Exception:
        raise UsageError(f"no image {ref} on this daemon; build it first (python build.py --torch {image.torch_minor} --cuda {image.cuda})") from None
    code = test.code_hash(ROOT)
    report = test.run(c, ROOT, image, image_id, results_dir(image), args.require_gpu, log, matrix_path=args.matrix)
    mode = tag.record_pass(image, image_id, report, code)
    print(f"{ref} ({image_id[:19]}) passed the smoke and structure tests ({mode})")
    return 0


def _parse_registry(args) -> publish.Registry:
    if not args.registry:
        raise UsageError("no registry: pass --registry HOST[:PORT]/NAMESPACE or set PYTORCH_CUDA_REGISTRY")
    if args.retries < 1:
        raise UsageError(f"--retries must be at least 1, not {args.retries}")
    return publish.Registry.parse(args.registry)


def _publish(c, images: list[matrix.Image], reg: publish.Registry, push: bool, args) -> list[publish.Move]:
    backoff = float(os.environ.get("PYTORCH_CUDA_RETRY_BACKOFF", "2"))
    moves = publish.publish(c, images, reg, push=push, ca_bundle=ca_bundle(args.ca_bundle),
                            attempts=args.retries, backoff=backoff, log=log)
    rows = [("TAG", "NOW", "ACTION")]
    for mv in moves:
        now = mv.after if push else mv.before
        action = "already there" if mv.in_place else ("pushed, verified" if push else "would push")
        rows.append((mv.target(reg), now.digest if now else "absent", action))
    widths = [max(len(r[k]) for r in rows) for k in range(3)]
    for r in rows:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip())
    if not push:
        print("dry run: nothing pushed; add --push to publish")
        return moves
    for image in images:
        mine = [mv for mv in moves if mv.image is image]
        record = {"registry": str(reg), "repository": reg.repository(image), "image_id": mine[0].image_id,
                  "digest": mine[0].after.digest, "tags": [mv.tag for mv in mine]}
        files.write_atomic(results_dir(image) / "published.json", json.dumps(record, indent=2) + "\n")
        print(f"pull by digest: {record['repository']}@{record['digest']}")
    return moves


def cmd_publish(m: matrix.Matrix, args) -> int:
    reg = _parse_registry(args)
    if args.all == bool(args.torch):
        raise UsageError("pick the rows: --torch X [--cuda Y] for one, or --all")
    images = list(m.images) if args.all else [m.select(args.torch, args.cuda, args.flavor)]
    c = docker_env.ensure_engine(log)
    _publish(c, images, reg, args.push, args)
    return 0


def cmd_matrix(m: matrix.Matrix, args) -> int:
    if args.json:
        print(json.dumps(matrix.as_json(m), indent=2))
        return 0
    from . import propose
    print(propose.render(propose.candidates(m, ca_bundle(args.ca_bundle), log)), end="")
    return 0


def cmd_prune(m: matrix.Matrix, args) -> int:
    c = docker_env.ensure_engine(log)
    bc = docker_env.build_client(None)
    removed = 0
    for img in c.images.list(name=f"{m.repository}-candidate"):
        for ref in img.tags:
            c.images.remove(ref, noprune=False)
            removed += 1
    c.images.prune(filters={"dangling": True})
    docker_bin = bc.argv[0]
    subprocess.run([docker_bin, "builder", "prune", "--force", "--keep-storage", args.keep_storage], env={**os.environ, **bc.env}, check=False, stdout=subprocess.DEVNULL)
    print(f"removed {removed} candidate tag(s) and dangling images; build cache bounded to {args.keep_storage}")
    return 0


def cmd_verify(m: matrix.Matrix, args) -> int:
    image = m.select(args.torch, args.cuda, args.flavor)
    lock.check(ROOT, [image])
    render.check(ROOT, m, [image])
    ca = ca_bundle(args.ca_bundle)
    c = docker_env.ensure_engine(log)
    bc = docker_env.build_client(args.docker)
    build.check_disk(docker_env.root_dir(c))
    results = results_dir(image) / "verify"
    results.mkdir(parents=True, exist_ok=True)
    base_id = base.ensure(c, image, results, log, docker_cli=bc.argv[0])
    refs = [f"{image.repository}-verify:{image.name}-{n}" for n in (1, 2)]
    try:
        ids = []
        for n, ref in enumerate(refs, 1):
            log(f"verify: build {n} of 2 without the layer cache (log: {results / f'build{n}.log'})")
            ids.append(build.run(bc, ROOT, image, results / f"build{n}.log", ca, no_cache=True, echo=False, tag=ref, base_id=base_id))
        log("verify: comparing the two images layer by layer")
        a, b = (verify.layer_index(r, docker_cli=bc.argv[0]) for r in refs)
        same = c.images.get(ids[0]).attrs["RootFS"]["Layers"] == c.images.get(ids[1]).attrs["RootFS"]["Layers"]
        comparison = verify.compare(a, b, same)
    finally:
        for ref in refs:
            try:
                c.images.remove(ref)
            except Exception:
                pass
    note = f"{bc.description}: BuildKit here predates rewrite-timestamp (0.13), so layer tars carry build-time mtimes"
    files.write_atomic(results / "verdict.txt", verify.verdict(comparison, note, show=len(comparison.content)) + "\n")
    print(verify.verdict(comparison, note))
    return 0 if comparison.reproducible else 1


def cmd_sbom(m: matrix.Matrix, args) -> int:
    c = docker_env.ensure_engine(log)
    doc = sbom.generate(c, args.image)
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if args.output:
        files.write_atomic(args.output, text)
        log(f"{len(doc['components'])} components written to {args.output}")
    else:
        sys.stdout.write(text)
    return 0


def cmd_bench(m: matrix.Matrix, args) -> int:
    image = m.select(args.torch, args.cuda, args.flavor)
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    if not only or only - set(bench.MEASURES) or args.runs < 1 or args.cold_runs < 1:
        raise UsageError(f"--only takes {','.join(bench.MEASURES)}; --runs and --cold-runs at least 1")
    if args.full:  # before Docker is touched: nothing runs, nothing is pruned
        bench.check_consent(only, args.yes)
    c = docker_env.ensure_engine(log)
    ref = image.refs()[0]
    if tag.current(c, image)[ref] is None:
        raise UsageError(f"no image {ref}; build it first")
    if not args.full:
        result = bench.banner(image, ref, args.runs, ROOT / "build-results" / "bench", docker_cli=docker_env.docker_cli(args.docker))
        print(bench.markdown(result))
        return 0
    bc = docker_env.build_client(args.docker)
    if only & {"cold", "matrix"}:
        build.check_disk(docker_env.root_dir(c))
    try:
        result = bench.full(c, m, image, ROOT, bc, ca_bundle(args.ca_bundle), args.runs, args.cold_runs, only, ROOT / "bench", log, yes=args.yes)
    except bench.BenchError as e:
        raise PipelineError(f"benchmark step failed: {e}") from None
    print(bench.report_markdown(result))
    return 0


def cmd_selftest(m: matrix.Matrix, args) -> int:
    """Set up what the suite needs (Docker Engine, debootstrap, a registry), then run pytest.

    pytest's exit code is returned as it is: 5 (no tests ran) is a failure, not a pass.
    """
    proc = subprocess.run(["bash", str(docker_env.ENGINE_SCRIPT), "--with-registry"])
    if proc.returncode != 0:
        raise EnvironmentProblem("could not set up Docker Engine for the test suite (see the engine: lines above)")
    extra = [a for a in args.pytest_args if a != "--"]
    return subprocess.run([sys.executable, "-m", "pytest", str(ROOT / "tests"), "-ra", *extra], cwd=ROOT).returncode


def _terminated(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminated)  # CI cancels with SIGTERM: clean up as for Ctrl-C
    # A shell starting us in the background without job control leaves SIGINT ignored,
    # and Python then keeps it ignored: Ctrl-C and CI cancellations must always clean up.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    skip = 2 if argv[:1] == ["--matrix"] else 1 if argv[:1] and argv[0].startswith("--matrix=") else 0
    first = next((a for a in argv[skip:] if not a.startswith("-")), None)
    if first not in COMMANDS and not {"-h", "--help"} & set(argv):
        argv.insert(skip, "build")  # `build.py --torch 2.7` means `build.py build --torch 2.7`
    args = command = None
    try:
        args = parser().parse_args(argv)
        command = args.command
        m = matrix.load(args.matrix)
        handler = {"build": cmd_build, "list": cmd_list, "lock": cmd_lock, "render": cmd_render,
                   "test": cmd_test, "publish": cmd_publish, "matrix": cmd_matrix, "prune": cmd_prune, "selftest": cmd_selftest, "bench": cmd_bench, "sbom": cmd_sbom, "verify": cmd_verify}[args.command]
        return handler(m, args)
    except PipelineError as e:
        for line in e.lines():
            print(f"error: {line}" if line == e.lines()[0] else line, file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        if command == "publish" or getattr(args, "push", False):
            print("error: interrupted; no alias moved after the interrupt (where every tag is: the line above)", file=sys.stderr)
        else:
            print("error: interrupted; no tag was moved and the candidate's containers were removed", file=sys.stderr)
        return 130
    except (docker.errors.DockerException, requests.exceptions.ConnectionError) as e:
        # The SDK lost the daemon between two calls (it was up when the command started).
        err = docker_env.lost(f"`{command}`", e)
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
