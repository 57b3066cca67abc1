"""The command line's arguments: every command and option of build.py, with its help.
Bad arguments are UsageErrors (one line each, exit 2) like every other bad input: validate.py reports them."""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from .errors import UsageErrors
from .jobs import kubernetes, slurm
from .stages import matrix
from .tools import bench, engine_current

COMPRESSIONS = ("gzip", "zstd")  # publish's layer compression (registry/zstd.py)
COMMANDS = ("build", "list", "matrix", "lock", "render", "test", "publish", "prune", "selftest", "bench", "sbom", "verify", "record", "base", "signing-key", "engine", "gpu-bundle", "job")


BAD = "_bad_arguments"  # the namespace's {dest: problem} of values argparse's types or choices refused


class _Parser(argparse.ArgumentParser):
    """argparse, except that a value its type or choices refuse is kept as a problem (the value
    left None, or as given) instead of ending the parse: validate() reports it with every other
    problem of the command line at once, and skips the checks that read it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._bad: dict[str, str] = {}

    def parse_known_args(self, args=None, namespace=None):
        self._bad = {}
        ns, extras = super().parse_known_args(args, namespace)
        # A subcommand's parser ran inside this one and copied its namespace, BAD included, into ns.
        self._bad = {**getattr(ns, BAD, {}), **self._bad}
        setattr(ns, BAD, self._bad)
        return ns, extras

    def _get_value(self, action, arg_string):
        try:
            return super()._get_value(action, arg_string)
        except argparse.ArgumentError as e:
            self._bad.setdefault(action.dest, f"{e} (see --help)")
            return None

    def _check_value(self, action, value):
        if isinstance(action, argparse._SubParsersAction):
            return super()._check_value(action, value)
        if action.dest in self._bad:  # its type refused it already
            return None
        try:
            return super()._check_value(action, value)
        except argparse.ArgumentError as e:
            self._bad[action.dest] = f"{e} (see --help)"
            return None

    def error(self, message: str):  # each problem one line, exit 2, like every other bad input
        raise UsageErrors([*self._bad.values(), f"{message} (see --help)"])


def _at_least(low: int):
    """An argparse type: a whole number of at least `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"takes a whole number, not {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, not {value}")
        return value
    return parse


positive_int = _at_least(1)  # a count of at least 1 (--jobs, --retries, --runs, --cold-runs)
whole = _at_least(0)  # a count that may be 0 (--gpus-per-node)


# What Docker's --keep-storage takes (go-units RAMInBytes): bytes, or a number with k/m/g/t/p,
# an optional i and an optional b, in either case (10GB, 512mb, 10GiB, 1.5g, 1048576).
SIZE = re.compile(r"\d+(\.\d+)? ?([kmgtp]i?)?b?", re.IGNORECASE)


def docker_size(text: str) -> str:
    """A size as Docker's CLI takes it, passed on as the user wrote it."""
    if not SIZE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 40GB, 512MB, 10GiB, or bytes)")
    return text


def _selection(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--torch", required=required, help="torch minor (2.7) or full version (2.7.1)")
    p.add_argument("--cuda", help="CUDA platform, e.g. 12.1; default: the torch minor's default row")
    p.add_argument("--flavor", default="runtime", choices=matrix.FLAVORS,
                   help="image flavor: runtime (default), devel (adds the CUDA toolkit) or train (adds TE, FA4, Liger, torchao)")


PLATFORM_CHOICES = (*matrix.OS_PLATFORMS, "all")


def _platform(p: argparse.ArgumentParser) -> None:
    p.add_argument("--platform", choices=PLATFORM_CHOICES, metavar="PLATFORM",
                   help="linux/amd64, linux/arm64 (emulated on an x86-64 host) or all the row's platforms "
                        "(default: this host's)")


def _flags(p: argparse._ActionsContainer, **helps: str) -> None:  # a parser or a mutually exclusive group
    for name, text in helps.items():
        p.add_argument("--" + name.replace("_", "-"), action="store_true", help=text)


def _docker_ca(p: argparse.ArgumentParser, ca_help: str | None = None, docker: bool = True) -> None:
    if docker:
        p.add_argument("--docker", help="Docker CLI to use (default: $PYTORCH_CUDA_DOCKER, else detected)")
    p.add_argument("--ca-bundle", help=ca_help or "CA bundle for HTTPS (default: pip's configured cert)")


def _registry(p: argparse.ArgumentParser, push_help: str) -> None:
    p.add_argument("--registry", default=os.environ.get("PYTORCH_CUDA_REGISTRY"), help="HOST[:PORT]/NAMESPACE (default: $PYTORCH_CUDA_REGISTRY)")
    p.add_argument("--push", action="store_true", help=push_help)
    p.add_argument("--retries", type=positive_int, help="attempts per registry call (default 4, exponential backoff)")
    p.add_argument("--allow-vulnerable", action="append", default=[], metavar="ID",
                   help="publish despite this critical advisory of vulnerabilities.json (its ID or an alias); repeatable")
    p.add_argument("--compression", choices=COMPRESSIONS,
                   help="the pushed layers: gzip (default: as the engine holds them; every Docker pulls them) or zstd "
                        "(the containerd image store; Docker >= 23 and containerd >= 1.5 pull them, Docker 20.10 cannot)")
    if not any(a.dest == "ca_bundle" for a in p._actions):
        p.add_argument("--ca-bundle", help="CA bundle for an HTTPS registry (default: pip's configured cert)")


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="build.py", description="Build, test and tag pinned PyTorch + CUDA images from matrix.yaml.")
    p.add_argument("--matrix", type=Path, help="matrix file (default: the project's matrix.yaml)")
    sub = p.add_subparsers(dest="command", parser_class=_Parser)

    b = sub.add_parser("build", help="build, test and tag one row (the default command), or many with --all")
    _selection(b, required=False)
    b.add_argument("--all", action="store_true", help="every row (of --torch, if given): each built, tested and tagged as on its own")
    _platform(b)
    b.add_argument("--jobs", type=positive_int, help="with --all: rows built at once (default 1; shared layers are built once)")
    _docker_ca(b, "CA bundle for HTTPS inside the build (default: pip's configured cert)")
    _flags(b, no_test="build only; sets no public tag", retest="test even if this image ID already passed",
           no_cache="build without the layer cache", require_gpu="fail instead of testing on the CPU when no GPU runtime exists",
           dry_run="print the plan without calling Docker")
    b.add_argument("--cache-from", action="append", default=[], metavar="SPEC",
                   help="import BuildKit's cache (buildx; e.g. type=registry,ref=HOST/NS/pytorch-cuda-cache:{image}); repeatable")
    b.add_argument("--cache-to", action="append", default=[], metavar="SPEC",
                   help="export BuildKit's cache (buildx on the containerd store; add mode=max for every stage); repeatable")
    shown = b.add_mutually_exclusive_group()
    shown.add_argument("--quiet", action="store_true", help="show no build progress (the log is still saved)")
    shown.add_argument("--verbose", action="store_true", help="stream BuildKit's raw log instead of one line per step")
    b.add_argument("--result-json", type=Path, help=argparse.SUPPRESS)  # where a child of --all writes its RowResult
    _registry(b, "after tagging, publish the row (see `publish`)")

    sub.add_parser("list", help="the matrix: what can be built, what is built")

    mx = sub.add_parser("matrix", help="the matrix for machines: --json rows for a CI fan-out, --propose new torch releases")
    mode = mx.add_mutually_exclusive_group(required=True)
    _flags(mode, json="every row and platform with its tags, build arguments and runner, as JSON",
           indexes="the rows built on several platforms, whose images CI merges into one index, as JSON",
           propose="candidate rows for torch releases on the index that the matrix lacks (network)")
    _docker_ca(mx, docker=False)

    pb = sub.add_parser("publish", help="push tested images and their tags to a registry (dry run without --push)")
    _selection(pb, required=False)
    pb.add_argument("--all", action="store_true", help="every row of the matrix (each must be built and tested)")
    pb.add_argument("--platform", choices=PLATFORM_CHOICES, metavar="PLATFORM",
                    help="all: one image index of each row's platforms, every one built and tested here (build --platform all); "
                         "default: this host's platform: its image, or for a row on several platforms its part <dated>-<arch>")
    pb.add_argument("--merge", action="store_true",
                    help="a row on several platforms: one index of the parts each platform's build published (CI's merge job)")
    _registry(pb, "push for real; without it, print what would move")
    pb.add_argument("--sign-key", type=Path, metavar="FOLDER",
                    help="with --push: sign each row's image (GPG, containers' simple signing) with the key signing-key "
                         "wrote in FOLDER; its passphrase in $PYTORCH_CUDA_SIGN_PASSPHRASE")
    pb.add_argument("--signatures", type=Path, metavar="DIR",
                    help="with --sign-key: the lookaside directory the signatures go to, to be served over HTTP(S) "
                         "(default: build-results/signatures)")

    sk = sub.add_parser("signing-key", help="make a GPG signing key for publish --sign-key in FOLDER/gnupg, its public "
                                            "half in FOLDER/signing-key.pub.asc; passphrase from $PYTORCH_CUDA_SIGN_PASSPHRASE")
    sk.add_argument("folder", type=Path, help="where to write them (created if absent; an existing key is never replaced)")

    lk = sub.add_parser("lock", help="resolve rows into images/<image>/ lock files (network)")
    _selection(lk, required=False)
    _flags(lk, check="fail if any lock is stale (offline)", upgrade="re-resolve and print the version changes",
           check_security="list locked Python packages with advisories and Debian pins behind the security suite; exit 1 if any (network)")
    lk.add_argument("--record", action="store_true",
                    help="with --check-security: write images/<image>/security.json (the README table's counts)")
    lk.add_argument("--security-snapshot", type=Path, metavar="DIR",
                    help="with --check-security: recorded answers instead of the network (pypi.json, <suite>-security.Packages)")
    _docker_ca(lk, docker=False)

    r = sub.add_parser("render", help="render images/<image>/Dockerfile (offline)")
    r.add_argument("--check", action="store_true", help="fail on drift from templates/ and the locks")

    t = sub.add_parser("test", help="run the smoke and structure tests against a built image")
    _selection(t)
    t.add_argument("--image", help="image reference or ID to test (default: the row's own tag)")
    _platform(t)
    t.add_argument("--require-gpu", action="store_true")

    vf = sub.add_parser("verify", help="build a row twice without cache and compare the images file by file; with --image, "
                                       "rebuild a published image's row from this checkout and compare")
    _selection(vf, required=False)
    vf.add_argument("--image", help="a published image, HOST[:PORT]/NAMESPACE/NAME@sha256:<64 hex>: its labels name the commit "
                                    "and the row; exit 0 same, 1 different, 2 bad input, 3 not rebuildable here")
    vf.add_argument("--against", metavar="LOCAL", help="with --image or --record: compare with this local image instead of "
                                                       "rebuilding (--record: default the row's own tag)")
    vf.add_argument("--record", type=Path, metavar="FILE",
                    help="compare the row's local image with a record (`build.py record`, another machine's build): "
                         "exit 0 the same image, 1 another; the differing layers and files are named")
    vf.add_argument("--compile-ops", action="store_true",
                    help="compile the DeepSpeed ops in both builds instead of taking the host's ops seed, as a "
                         "rebuild on a fresh machine does (about 4 min more per build on 2 cores)")
    _platform(vf)
    _docker_ca(vf)

    rc = sub.add_parser("record", help="write a local image's record for another machine to compare its build with: the "
                                       "image and config digests, the config, every layer's files (xz-compressed JSON)")
    _selection(rc)
    rc.add_argument("--image", help="local image reference or ID (default: the row's own tag)")
    rc.add_argument("--output", type=Path, metavar="FILE",
                    help="where to write it, a new .json.xz (default: build-results/<image>/record.json.xz)")
    _platform(rc)
    rc.add_argument("--docker", help="Docker CLI to use (default: $PYTORCH_CUDA_DOCKER, else detected)")

    bs = sub.add_parser("base", help="build (or, --rebuild, build anew) a row's local base and say whether it is the "
                                     "recorded one: its diff_id, image ID and the mirror state it came from")
    _selection(bs)
    bs.add_argument("--rebuild", action="store_true", help="build the base anew even if this machine has it")
    bs.add_argument("--record", action="store_true",
                    help="write its identity to images/<image>/base.json of every row that shares this base")
    _platform(bs)
    _docker_ca(bs)

    sb = sub.add_parser("sbom", help="CycloneDX SBOM (Python and Debian packages) of any local image")
    sb.add_argument("image", help="image reference or ID")
    sb.add_argument("--output", type=Path, help="file to write (default: stdout)")

    bn = sub.add_parser("bench", help="measure (never assert): --full for size, build times and banner, else the banner only")
    _selection(bn)
    bn.add_argument("--runs", type=positive_int, default=10, help="repetitions of the quick measurements (default 10)")
    bn.add_argument("--full", action="store_true", help="every benchmark; report in bench/ (hours on 2 cores: cold builds, two naive images, the matrix and pull measures; --only picks some; empties the build cache for the cold builds)")
    bn.add_argument("--cold-runs", type=positive_int, help="with --full: cold builds of each kind (default 1)")
    bn.add_argument("--only", help="with --full: comma list of " + ",".join(bench.MEASURES) + " (default: every one)")
    bn.add_argument("--pull-rows", type=positive_int, metavar="N",
                    help="with --only pull: build the first N CUDA 13 rows, oldest first (default: every one)")
    _flags(bn, yes="allow the cold and matrix measures to empty this daemon's whole build cache")
    _docker_ca(bn)

    st = sub.add_parser("selftest", help="this project's own test suite (sets up Docker first)")
    st.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments")

    en = sub.add_parser("engine", help="bring up a current Docker Engine (26, buildx) beside this host's; "
                                      "prints the environment that points build.py at it (root)")
    en.add_argument("--store", default="containerd", choices=tuple(engine_current.STORES),
                    help="image store: containerd (default, Docker 29's) or classic")
    en.add_argument("--down", action="store_true", help="stop that engine instead")
    _docker_ca(en, docker=False)

    gb = sub.add_parser("gpu-bundle", help="write DIR: DeepSpeed with the row's ops prebuilt, libaio, wheels, smoke suite and "
                                         "run.sh, to prove the row's GPU half on a GPU machine without Docker, network or "
                                         "compiler (`bash DIR/run.sh` there)")
    _selection(gb)
    gb.add_argument("dir", type=Path, metavar="DIR", help="new or empty directory to write")
    gb.add_argument("--python", help="the GPU machine's Python, MAJOR.MINOR (default: the row's)")
    gb.add_argument("--build-python", metavar="PATH", help="the Python of that version (with its headers) that builds the "
                    "ops wheel here (default: found: pythonX.Y or python3 on PATH, `uv python find X.Y`, pyenv's versions)")
    gb.add_argument("--ops-wheel", type=Path, metavar="FILE", help="a DeepSpeed wheel with the row's ops built before, for "
                    "that Python and the row's torch, instead of building one")
    gb.add_argument("--ops-arch", default="9.0", metavar="LIST", help="TORCH_CUDA_ARCH_LIST the ops are built for "
                    "(default 9.0: H100, H200; e.g. '8.0;9.0;10.0')")
    gb.add_argument("--limit-mib", type=int, default=64, help="refuse a bundle that, with the repository's tracked files "
                    "beside it, is larger than this (default 64)")
    _docker_ca(gb, docker=False)

    _job(sub)

    pr = sub.add_parser("prune", help="remove candidate images and bound the build cache")
    pr.add_argument("--keep-storage", default="40GB", type=docker_size, help="build cache to keep (default 40GB)")
    return p


JOB_EPILOG = """\
code and data:
  Slurm: submit from the directory that holds SCRIPT, on a filesystem every node mounts. The
  submit directory is bound at the same path and is the working directory; --mount binds more
  shared directories (the oci runtime's bundle step in the script's header binds them).
    python3 build.py job --torch 2.7 --scheduler slurm --nodes 2 --gpus-per-node 8 \\
      --mount /shared/datasets:/data:ro --output . -- train.py --deepspeed ds.json --data /data
  Kubernetes: --mount pvc:CLAIM:TARGET (a PersistentVolumeClaim) or HOSTDIR:TARGET (a hostPath,
  which ignores fsGroup: uid 1000 or group 1000 must be able to read it on every node). The first
  mount's TARGET is the working directory, so put the code first.
    python3 build.py job --torch 2.7 --scheduler kubernetes --kind jobset --nodes 2 \\
      --mount pvc:code:/code:ro --mount pvc:datasets:/data:ro --output job.yaml \\
      -- train.py --deepspeed ds.json
  Relative paths in SCRIPT and ARGS are taken from the working directory (--workdir to pick it);
  the ARGS reach the script as written."""


def _job(sub) -> None:
    jb = sub.add_parser("job", help="write a multi-node job that runs SCRIPT through the image's launch contract: an sbatch "
                                     "script (--scheduler slurm) or manifests (--scheduler kubernetes), image pinned by digest",
                        description="After `--`, SCRIPT [ARGS] as `pytorch-cuda-launch` takes them, e.g.\n"
                                    "`job --torch 2.7 --scheduler slurm --nodes 2 --gpus-per-node 8 -- train.py --lr 1e-4`.",
                        epilog=JOB_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _selection(jb)
    jb.add_argument("--scheduler", required=True, choices=("slurm", "kubernetes"), help="what runs the job")
    jb.add_argument("--nodes", required=True, type=positive_int, help="nodes (pods), one launch per node")
    jb.add_argument("--gpus-per-node", type=whole, default=0, metavar="N",
                    help="GPUs each node requests, one rank each (default 0: none requested, the contract decides)")
    jb.add_argument("--image", metavar="REPO@sha256:...",
                    help="the image by digest (default: the row's build-results/<image>/published.json, from publish --push)")
    jb.add_argument("--name", help="job (and Kubernetes object) name, a DNS label of at most 40 characters (default: pytorch-cuda-<torch>)")
    jb.add_argument("--shm-size", default="16Gi", metavar="SIZE", help="/dev/shm for each node, e.g. 16Gi or 512Mi (default 16Gi)")
    jb.add_argument("--network", default="auto", choices=("auto", "socket"),
                    help="auto (default): NCCL uses InfiniBand where present; socket: TCP only (NCCL_IB_DISABLE=1)")
    jb.add_argument("--socket-ifname", metavar="IFNAME", help="NCCL_SOCKET_IFNAME, e.g. eth0 or ^docker,lo (default: NCCL picks)")
    jb.add_argument("--mount", action="append", default=[], metavar="SOURCE:TARGET[:ro]",
                    help="the user's code or data at TARGET in every task; repeatable. SOURCE: Kubernetes pvc:CLAIM or an "
                         "absolute host path (hostPath, type Directory); Slurm an absolute path on the shared filesystem")
    jb.add_argument("--workdir", metavar="DIR",
                    help="the tasks' working directory, where relative paths in SCRIPT and ARGS are taken from "
                         "(default: Slurm the submit directory; Kubernetes the first --mount's TARGET, else the image's /workspace)")
    jb.add_argument("--output", type=Path, metavar="FILE|DIR", help="file to write, or a directory for <name>.sbatch / <name>.yaml (default: stdout)")
    jb.add_argument("--runtime", choices=slurm.RUNTIMES, help="slurm: oci (default; srun --container), pyxis (enroot) or apptainer")
    jb.add_argument("--bundle", metavar="DIR", help="slurm oci: the OCI bundle on a shared filesystem "
                                                    "(default: $SLURM_SUBMIT_DIR/bundles/<image>-<digest>)")
    jb.add_argument("--sif", metavar="FILE", help="slurm apptainer: a .sif to run instead of docker://IMAGE")
    jb.add_argument("--kind", choices=kubernetes.KINDS, help="kubernetes: trainjob, pytorchjob, jobset or indexed-job")
    jb.add_argument("--rdma", action="append", default=[], metavar="RESOURCE=COUNT",
                    help="kubernetes: an RDMA device resource per node, e.g. rdma/ib=1 (adds IPC_LOCK); repeatable")
    jb.add_argument("--namespace", help="kubernetes: the namespace (default: none written, kubectl's current)")
    jb.add_argument("--cluster-runtime", metavar="NAME",
                    help="trainjob: use this installed ClusterTrainingRuntime (e.g. torch-distributed) instead of writing a TrainingRuntime")
    jb.add_argument("--cpus-per-node", type=positive_int, metavar="N", help="kubernetes: CPUs each pod requests (default: none)")
    jb.add_argument("--memory-per-node", metavar="SIZE",
                    help="kubernetes: memory each pod requests, /dev/shm and working memory together, e.g. 64Gi; "
                         "more than --shm-size (default: --shm-size's, /dev/shm alone)")
    jb.add_argument("--qos", choices=kubernetes.QOS,
                    help="kubernetes: burstable (default: requests, and limits only for GPUs and RDMA) or guaranteed "
                         "(cpu and memory limits equal to the requests; needs --cpus-per-node and --memory-per-node)")
    jb.add_argument("--image-pull-secret", action="append", default=[], metavar="NAME",
                    help="kubernetes: a Secret in the job's namespace that the pods pull the image with; repeatable")
    jb.add_argument("--deadline", metavar="DURATION",
                    help="kubernetes: the job's activeDeadlineSeconds, e.g. 24h, 90m, 1h30m, 2d or seconds "
                         "(default: none); not with --cluster-runtime")
    jb.add_argument("--preflight", action="store_true",
                    help="run pytorch-cuda-preflight on every node first (driver, GPUs, /dev/shm, RDMA, the fabric measured, a "
                         "slow node named) and start training only if it passed; bounded (docs/clusters.md#preflight)")
    jb.add_argument("script", nargs="*", metavar="SCRIPT", help="after --: SCRIPT [ARGS...], run by pytorch-cuda-launch in the image")
