"""The sbatch script: one task per node, each running the launch contract in the image.

Sections, one function each: the header (what the script is and how to prepare its runtime),
the #SBATCH lines, the environment (NCCL, ranks per node), and the srun line for the runtime.

What the runtimes need, checked against their own sources:
- Slurm's OCI support (22.05, measured here, ../shared/ENVIRONMENT.md): `srun --container=BUNDLE`
  with oci.conf's RunTimeQuery/Kill/Delete/Run and the patterns %b %n %u %j %s %t (%U makes
  slurmstepd abort). The job's environment is merged into the bundle's; srun's PATH and HOME
  replace the image's, so the launcher is called by absolute path.
- pyxis (NVIDIA/pyxis README, `srun --help`): `--container-image=[USER@][REGISTRY#]IMAGE[:TAG]|PATH`,
  `--container-mounts=SRC:DST[:FLAGS][,...]`, `--container-workdir=PATH`,
  `--no-container-entrypoint`. pyxis hands the image to `enroot import docker://...`, whose
  parser (NVIDIA/enroot src/docker.sh) accepts `REGISTRY#IMAGE@sha256:...` from enroot 4.0.0 on;
  3.x accepts tags only. enroot's default fstab (conf/mounts/10-system.fstab) bind-mounts the
  host's /dev/shm.
- sbatch reads `#SBATCH` lines with src/sbatch/opt.c's _get_argument, where an unescaped `#`
  starts a comment ("found an un-escaped #, rest of line is a comment"): pyxis's `#` must be
  written `\\#` there. On the srun line, quoted, bash passes it as it is.
- Apptainer (cmd/internal/cli/action_flags.go): `exec --nv --bind SRC[:DST[:ro]] --pwd DIR IMAGE CMD`.
  Its defaults `mount dev = yes` share the host's /dev, so /dev/shm is the host's. Not
  --contain/--containall: --contain puts a tmpfs of `sessiondir max size` (64 MiB by default)
  on /dev/shm, and --containall also cleans the environment, which drops SLURM_*.

The working directory: the submit directory (bound at the same path under every runtime), or
--workdir. The script exports it as PYTORCH_CUDA_WORKDIR, which the launch contract changes to
before it starts torchrun: an OCI bundle's cwd is fixed in config.json, made once for any number
of submit directories, while the job's environment reaches the container. pyxis and Apptainer
get it as --container-workdir and --pwd as well. SCRIPT and ARGS go as the user wrote them.
"""
from __future__ import annotations

import shlex
import textwrap
from pathlib import Path

from . import LAUNCH_PATH, PREFLIGHT_PATH, ocibundle
from .options import Job

# One task per node. --kill-on-bad-exit: a task that exits non-zero (torchrun does when one of its
# ranks fails) ends every other task of the step at once, rather than leaving them waiting in a
# collective until its timeout; the job ends FAILED. --label: each output line names its task
# (its node's number in the allocation).
SRUN_FLAGS = "--ntasks-per-node=1 --kill-on-bad-exit=1 --label"
RDZV_TIMEOUT_S = 1800
SUBMIT = "${SLURM_SUBMIT_DIR}"
WORKDIR = "PYTORCH_CUDA_WORKDIR"  # the launch contract changes to it (pytorch_cuda_runtime/launch)
WIDTH = 96  # the header's prose, wrapped
# oci.conf for a site. Slurm calls each as the job's user (its containers guide: every OCI container
# runs rootless), so runc runs --rootless with a state directory per user. NVIDIA's runtime is a shim
# over runc that edits the spec on `create` only; pytorch-cuda-oci-gpus (ocigpus.py) names the step's
# GPUs in the spec and turns RunTimeRun into the runtime's create and start (22.05 hangs on
# RunTimeCreate). 22.05 has no %U (slurmstepd aborts on it): the state directory is keyed by user
# name there, by uid from 23.02 on.
NVIDIA_RUNTIME = "nvidia-container-runtime"
GPU_WRAPPER = "/usr/local/libexec/pytorch-cuda-oci-gpus"
CONTAINER_ID = "%n.%u.%j.%s.%t"


# What the launch contract prefixes each rank's lines with under PYTORCH_CUDA_RANK_LABELS=1: its
# RANK_PREFIX ("[rank${rank}]: ", torchrun's template) for rank N. tests/unit/test_job.py holds the two equal.
RANK_LABEL_SHOWN = "[rankN]: "

def oci_conf(runtime: str = NVIDIA_RUNTIME, user: str = "%u") -> list[str]:
    """oci.conf's lines: Slurm 22.05's form (user "%u"), or 23.02's and later (user "%U")."""
    rt = f"{runtime} --rootless=true --root=/tmp/runc-{user}"
    return [f'RunTimeQuery="{rt} state {CONTAINER_ID}"',
            f'RunTimeKill="{rt} kill -a {CONTAINER_ID}"',
            f'RunTimeDelete="{rt} delete --force {CONTAINER_ID}"',
            f'RunTimeRun="{GPU_WRAPPER} {rt} run --bundle %b {CONTAINER_ID}"']


OCI_CONF = oci_conf()


def ocibundle_code() -> list[str]:
    """ocibundle.py's code, its docstring left out, for the script's heredoc."""
    body = Path(ocibundle.__file__).read_text().split('"""', 2)[2].strip("\n")
    return ["# pytorch_cuda_build/jobs/ocibundle.py: the change to config.json, explained there", *body.splitlines()]


def _make_bundle(job: Job) -> list[str]:
    """BUNDLE, and `bash NAME.sbatch --make-bundle`: the bundle for the user who runs it (the header says what it does)."""
    binds = " ".join(['"$PWD:$PWD:rw"', *(shlex.quote(f"{m.source}:{m.target}:{'ro' if m.read_only else 'rw'}")
                                         for m in job.mounts)])
    return [f'BUNDLE="{bundle_dir(job)}"',
            'if [ "${1:-}" = --make-bundle ]; then',
            f'  SOURCE="${{PYTORCH_CUDA_IMAGE_SOURCE:-docker://{job.ref}}}"',
            '  NEEDS="umoci python3"',
            '  case "$SOURCE" in oci:*) ;; *) NEEDS="$NEEDS skopeo" ;; esac',
            "  for tool in $NEEDS; do",
            '    command -v "$tool" >/dev/null || { echo "error: --make-bundle needs $tool on PATH" >&2; exit 1; }',
            "  done",
            *_registry_credentials(),
            '  NEW="$BUNDLE.new.$$"',
            "  # whole or absent: a failed step leaves nothing half-made",
            "  trap 'chmod -R u+w \"$NEW\" \"$NEW.oci\" 2>/dev/null || true; rm -rf \"$NEW\" \"$NEW.oci\"' EXIT",
            '  mkdir -p "$(dirname "$BUNDLE")"',
            '  case "$SOURCE" in',
            '    oci:*) LAYOUT="${SOURCE#oci:}" ;;',
            '    *) skopeo copy "$CREDS" "$SOURCE" "oci:$NEW.oci:image"; LAYOUT="$NEW.oci:image" ;;',
            "  esac",
            '  umoci --log error unpack --rootless --image "$LAYOUT" "$NEW"',
            f"  python3 - \"$NEW\" {job.shm_mib} {binds} <<'PY'",
            *ocibundle_code(),
            "PY",
            '  if [ -e "$BUNDLE" ]; then chmod -R u+w "$BUNDLE"; rm -rf "$BUNDLE"; fi',
            '  mv "$NEW" "$BUNDLE"',
            '  echo "bundle: $BUNDLE"',
            "  exit 0",
            "fi"]


# The user's own auth files, in containers-auth.json(5)'s order (its legacy ~/.dockercfg left out).
USER_AUTH_FILES = ('${XDG_RUNTIME_DIR:+"$XDG_RUNTIME_DIR/containers/auth.json"}',
                   '"${XDG_CONFIG_HOME:-${HOME:-}/.config}/containers/auth.json"', '"${HOME:-}/.docker/config.json"')


def _registry_credentials() -> list[str]:
    """CREDS, skopeo's credentials option: the file REGISTRY_AUTH_FILE names, else the first of the
    user's own auth files that exists, else none (anonymous). Always named: left to itself where
    XDG_RUNTIME_DIR is unset (runuser, cron, many batch environments), skopeo 1.9 first reads
    /run/containers/UID/auth.json, and stops when it cannot (a root podman leaves /run/containers
    at 0700). A file that is not the user's is never read unless named: an XDG_RUNTIME_DIR or HOME
    inherited from another user (su without -l) points at theirs. Checked before anything is
    written, and only where skopeo runs."""
    return ["  # skopeo's credentials (the header says which), always named: it then never looks in /run/containers",
            '  case "$SOURCE" in oci:*) ;; *)',
            '    AUTH="${REGISTRY_AUTH_FILE:-}"',
            '    if [ -z "$AUTH" ]; then',
            f"      for f in {' '.join(USER_AUTH_FILES)}; do",
            '        if [ -O "$f" ]; then AUTH="$f"; break; fi',
            "      done",
            "    fi",
            '    if [ -z "$AUTH" ]; then CREDS=--src-no-creds',
            '    elif [ -f "$AUTH" ] && [ -r "$AUTH" ]; then CREDS="--src-authfile=$AUTH"',
            '    else echo "error: --make-bundle cannot read the registry credentials in $AUTH${REGISTRY_AUTH_FILE:+ (REGISTRY_AUTH_FILE)}" >&2; exit 1',
            "    fi ;;",
            "  esac"]


def sbatch_escape(value: str) -> str:
    """A value as an #SBATCH line must carry it: sbatch cuts the line at an unescaped #."""
    return value.replace("\\", "\\\\").replace("#", "\\#")


def bundle_dir(job: Job) -> str:
    """The OCI bundle: --bundle, or one per user and image digest under the submit directory (a
    rootless bundle maps its maker's uid: another user's cannot be run). The script also makes it
    on a login node, where SLURM_SUBMIT_DIR is not set."""
    return job.bundle or f"${{SLURM_SUBMIT_DIR:-$PWD}}/bundles/$(id -un)/{job.row_name}-{job.ref.digest[7:19]}"


def workdir(job: Job) -> str:
    """The tasks' working directory, as the script writes it in double quotes."""
    return job.workdir or SUBMIT


def _binds(job: Job, submit: str) -> str:
    """The submit directory's bind, then each --mount's, as pyxis's and Apptainer's SRC:DST[:ro] lists."""
    return ",".join([submit, *(m.bind() for m in job.mounts)])


def render(job: Job) -> str:
    lines = ["#!/bin/bash", *[f"# {h}" for h in job.header()], "#", *[f"# {c}".rstrip() for c in _prepare(job)],
             *_sbatch(job), "", "set -euo pipefail", "",
             *((_make_bundle(job) + [""]) if job.runtime == "oci" else []), *_environment(job), "", *_srun(job)]
    return "\n".join(lines) + "\n"


def _sbatch(job: Job) -> list[str]:
    lines = [f"--job-name={job.name}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    if job.gpus_per_node:
        lines.append(f"--gpus-per-node={job.gpus_per_node}")
    # --mem=0: all of each node's memory. With --exclusive alone the job gets the site's default
    # memory, and the /dev/shm tmpfs (--shm-size) counts against the job's memory.
    lines += ["--exclusive", "--mem=0", f"--output={job.name}-%j.out"]
    return [f"#SBATCH {sbatch_escape(line)}" for line in lines]


def _prepare(job: Job) -> list[str]:
    common = ["Site options (partition, account, time limit) go on sbatch's command line, which overrides",
              f"the #SBATCH lines: sbatch -p PARTITION -A ACCOUNT -t 04:00:00 {job.name}.sbatch",
              "The launch contract, /usr/local/bin/pytorch-cuda-launch in the image, runs torchrun on each node",
              "with a c10d rendezvous on the first node of the allocation: no ssh, no per-task variables needed.", ""]
    return common + {"oci": _prepare_oci, "pyxis": _prepare_pyxis, "apptainer": _prepare_apptainer}[job.runtime](job) + [""]


def _prepare_oci(job: Job) -> list[str]:
    shm = f"{job.shm_mib // 1024}Gi" if job.shm_mib % 1024 == 0 else f"{job.shm_mib}Mi"
    return ["Runtime: Slurm's own OCI support (srun --container=BUNDLE), Slurm 22.05 or newer, rootless runc",
            "under NVIDIA's container runtime.",
            *textwrap.wrap(
                "The bundle: make it once per user, on a filesystem every node mounts, from the directory you "
                f"submit from: bash {job.name}.sbatch --make-bundle (on a login node; needs skopeo, umoci and "
                "python3, no Docker and no checkout of pytorch-cuda). It copies the image by digest (or from "
                "PYTORCH_CUDA_IMAGE_SOURCE, any skopeo source; an oci:DIR:TAG layout is unpacked in place), runs "
                "umoci unpack --rootless, and edits config.json: no network or uts namespace of its own (the "
                "ranks of two nodes reach each other over the node's network, under the node's hostname), the "
                f"process as the bundle's user, a {shm} tmpfs on /dev/shm, the node's /etc/hosts and "
                "/etc/resolv.conf, and the submit directory" + (" and each --mount" if job.mounts else "") + " bound. "
                "A rootless bundle maps its maker's uid, so bundles are per user, under bundles/USER/. The binds "
                "are the bundle's own: make it again when the submit directory or the --mount list changes.", WIDTH, break_on_hyphens=False),
            *textwrap.wrap(
                "Registry credentials: the file REGISTRY_AUTH_FILE names, else the first of your own "
                "$XDG_RUNTIME_DIR/containers/auth.json, ~/.config/containers/auth.json and ~/.docker/config.json "
                "that exists, else none (an anonymous pull). No other file is read, so the step works where "
                "XDG_RUNTIME_DIR is unset (cron, runuser, batch jobs).", WIDTH, break_on_hyphens=False),
            "/etc/slurm/oci.conf on every node (Slurm 22.05; from 23.02 on, /tmp/runc-%U keys it by uid):",
            *[f"  {line}" for line in OCI_CONF],
            *textwrap.wrap(
                f"{GPU_WRAPPER} is pytorch_cuda_build/jobs/ocigpus.py, installed by the site: it names the node's "
                "share of the job's GPUs as NVIDIA_VISIBLE_DEVICES (Slurm 22.05 gives a container none of its GPU "
                "variables) and binds /dev/infiniband where the node has it. NVIDIA's runtime in legacy mode runs "
                "rootless with no-cgroups = true in /etc/nvidia-container-runtime/config.toml; confining each job "
                "to its GPUs is then the cgroup plugin's (ConstrainDevices=yes in cgroup.conf).", WIDTH, break_on_hyphens=False),
            *_workdir_note(job)]


def _prepare_pyxis(job: Job) -> list[str]:
    return ["Runtime: pyxis and enroot (srun --container-image). The image is pulled by digest, which",
            "enroot accepts from 4.0.0 on (enroot 3.x takes tags only). pyxis writes a registry as",
            "REGISTRY#IMAGE; on the srun line below the value is quoted, and bash passes the # as it is.",
            "In an #SBATCH line sbatch cuts at an unescaped #, so there the same image is written:",
            f"  #SBATCH --container-image={sbatch_escape(job.ref.pyxis())}",
            "  (that line runs the whole batch script in the container; this script does not use it).",
            "A plain-HTTP registry needs ENROOT_ALLOW_HTTP=yes in the environment srun passes on.",
            "/dev/shm: enroot bind-mounts the node's own /dev/shm (conf/mounts/10-system.fstab), so its",
            f"size is the node's; this job asked for {job.shm_mib} MiB (--shm-size), which the node must have.",
            *_workdir_note(job)]


def _prepare_apptainer(job: Job) -> list[str]:
    source = ("a SIF file (--sif); make one with: apptainer pull IMAGE.sif docker://" + str(job.ref)) if job.sif else \
        ("docker:// by digest: each node converts it to SIF in its own cache on first use; "
         "for many nodes pull a .sif once (apptainer pull) and render with --sif")
    return ["Runtime: Apptainer (srun apptainer exec), as the calling user.",
            f"The image comes from {source}.",
            "/dev/shm: Apptainer shares the node's /dev (mount dev = yes), and with it the node's /dev/shm;",
            f"this job asked for {job.shm_mib} MiB (--shm-size), which the node must have. Not --contain or",
            "--containall: the first puts a 64 MiB tmpfs on /dev/shm, the second also drops SLURM_*.",
            *_workdir_note(job)]


def _workdir_note(job: Job) -> list[str]:
    where = "the submit directory" if job.workdir is None else job.workdir
    lines = ["The submit directory is bound at the same path" + (", and each --mount at its TARGET." if job.mounts else ".")]
    lines += [f"  {m.source} at {m.target}{' (read-only)' if m.read_only else ''}" for m in job.mounts]
    return lines + textwrap.wrap(f"The working directory is {where}: the script exports it as {WORKDIR}, which the "
                                 "launch contract changes to; relative paths in SCRIPT and ARGS are taken from it.", WIDTH)


# How the node's InfiniBand (and RoCE) devices reach the ranks, where the node has them; NCCL finds them there.
FABRIC = {
    "oci": ["# InfiniBand: pytorch-cuda-oci-gpus (oci.conf) binds the node's /dev/infiniband into the container."],
    "pyxis": ["# InfiniBand: enroot's 99-mellanox hook mounts the node's devices only where MELLANOX_VISIBLE_DEVICES",
              "# is set (and its GPUs from NVIDIA_VISIBLE_DEVICES, which the image sets to all)."],
    "apptainer": ["# InfiniBand: Apptainer shares the node's /dev, /dev/infiniband with it."],
}


def _environment(job: Job) -> list[str]:
    lines = list(FABRIC[job.runtime])
    nccl = job.nccl_env()
    if "NCCL_IB_DISABLE" in nccl:
        lines.append("# --network socket: TCP sockets only, InfiniBand off.")
    elif job.runtime == "pyxis":
        nccl = {"MELLANOX_VISIBLE_DEVICES": "all", **nccl}
    lines += [f"export {k}={shlex.quote(v)}" for k, v in {**nccl, **job.launch_env()}.items()]
    if job.scheduler == "slurm" and not job.gpus_per_node:
        lines.append("# No GPU requested: the launch contract starts one rank per GPU the node shows, else one CPU rank.")
    lines += ["# The tasks' working directory, which the launch contract changes to.", f'export {WORKDIR}="{workdir(job)}"']
    return lines + [
        "# How long the first node's rendezvous waits for every node to join, in seconds: raise it where a",
        "# node can take longer to start (pulling or unpacking the image, a slow shared filesystem).",
        f"export PYTORCH_CUDA_RDZV_TIMEOUT={RDZV_TIMEOUT_S}",
        f"# Every line of every rank starts with '{RANK_LABEL_SHOWN}'; srun --label puts the node's task number before it.",
        "export PYTORCH_CUDA_RANK_LABELS=1"]


def _command(job: Job) -> str:
    """The launch contract and SCRIPT [ARGS], shell-quoted, as the user wrote them."""
    return " ".join([LAUNCH_PATH, *map(shlex.quote, job.script)])


def _preflight_command(job: Job) -> str:
    """--preflight's step: its report is named by the job, in the working directory."""
    return " ".join([PREFLIGHT_PATH, *job.preflight_args(), "--report", '"pytorch-cuda-preflight-${SLURM_JOB_ID}.json"'])


# --preflight's step, before the training step: the bound the script states (pytorch_cuda_runtime/preflight).
PREFLIGHT_NOTE = [
    "# Preflight (--preflight): every node checks its driver, GPUs, /dev/shm and RDMA against the image's",
    "# row, then the fabric is measured (all_reduce, all_gather, each pair of ring neighbours) and a slow",
    "# node named, with the same image and launch contract; training starts only if it passed. Bound: every",
    "# node answers within PYTORCH_CUDA_PREFLIGHT_JOIN_TIMEOUT (600 s), then the fabric within",
    "# PYTORCH_CUDA_PREFLIGHT_TIMEOUT (300 s) + 60 s; the table and pytorch-cuda-preflight-JOBID.json are",
    "# written in the working directory."]


def _srun(job: Job) -> list[str]:
    prelude, launcher = _run(job)
    lines = list(prelude)
    if job.preflight:
        lines += [*PREFLIGHT_NOTE, f"if ! {launcher[0]}", *launcher[1:], f"  {_preflight_command(job)}; then",
                  '  echo "error: the preflight failed (its lines above): training not started" >&2', "  exit 1", "fi"]
    if any(c in a for a in job.script for c in "$`"):  # a directive applies to the command right after it
        lines.append("# shellcheck disable=SC2016  # the ARGS reach the script as written, $ and all")
    return lines + [*launcher, f"  {_command(job)}"]


def _run(job: Job) -> tuple[list[str], list[str]]:
    """(what comes before the steps, the srun lines of a step up to its command, each ending in a backslash)."""
    if job.runtime == "oci":
        return ([
            'if [ ! -f "$BUNDLE/config.json" ]; then',
            f'  echo "error: no bundle at $BUNDLE: make it first, from the submit directory: bash {job.name}.sbatch --make-bundle" >&2',
            "  exit 1",
            "fi"], [f"srun {SRUN_FLAGS} --container=\"$BUNDLE\" \\"])
    if job.runtime == "pyxis":
        return ([f"IMAGE={shlex.quote(job.ref.pyxis())}"],
                [f"srun {SRUN_FLAGS} --container-image=\"$IMAGE\" --no-container-entrypoint \\",
                 f'  --container-mounts="{_binds(job, f"{SUBMIT}:{SUBMIT}")}" --container-workdir="${WORKDIR}" \\'])
    image = job.sif or f"docker://{job.ref}"
    nv = "--nv " if job.gpus_per_node else ""
    return ([f'IMAGE="{image}"'],  # validated: no quote, backslash or backquote; a $VAR in --sif expands
            [f"srun {SRUN_FLAGS} apptainer exec {nv}--bind \"{_binds(job, SUBMIT)}\" --pwd \"${WORKDIR}\" \"$IMAGE\" \\"])
