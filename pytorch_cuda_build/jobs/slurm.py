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

from . import LAUNCH_PATH, Job

RUNTIMES = ("oci", "pyxis", "apptainer")
# One task per node. --kill-on-bad-exit: a task that exits non-zero (torchrun does when one of its
# ranks fails) ends every other task of the step at once, rather than leaving them waiting in a
# collective until its timeout; the job ends FAILED. --label: each output line names its task
# (its node's number in the allocation).
SRUN_FLAGS = "--ntasks-per-node=1 --kill-on-bad-exit=1 --label"
RDZV_TIMEOUT_S = 1800
SUBMIT = "${SLURM_SUBMIT_DIR}"
WORKDIR = "PYTORCH_CUDA_WORKDIR"  # the launch contract changes to it (pytorch_cuda_runtime/launch)
WIDTH = 96  # the header's prose, wrapped
OCI_CONF = [  # Slurm 22.05 knows these four keys (or RunTimeCreate plus RunTimeStart instead of RunTimeRun)
    'RunTimeQuery="runc --root=/run/runc-slurm state %n.%u.%j.%s.%t"',
    'RunTimeKill="runc --root=/run/runc-slurm kill -a %n.%u.%j.%s.%t"',
    'RunTimeDelete="runc --root=/run/runc-slurm delete --force %n.%u.%j.%s.%t"',
    'RunTimeRun="runc --root=/run/runc-slurm run --bundle %b %n.%u.%j.%s.%t"',
]


def sbatch_escape(value: str) -> str:
    """A value as an #SBATCH line must carry it: sbatch cuts the line at an unescaped #."""
    return value.replace("\\", "\\\\").replace("#", "\\#")


def bundle_dir(job: Job) -> str:
    """The OCI bundle: --bundle, or one per image digest under the submit directory."""
    return job.bundle or f"{SUBMIT}/bundles/{job.row}-{job.image.digest[7:19]}"


def workdir(job: Job) -> str:
    """The tasks' working directory, as the script writes it in double quotes."""
    return job.workdir or SUBMIT


def _binds(job: Job, submit: str) -> str:
    """The submit directory's bind, then each --mount's, as pyxis's and Apptainer's SRC:DST[:ro] lists."""
    return ",".join([submit, *(m.bind() for m in job.mounts)])


def render(job: Job) -> str:
    lines = ["#!/bin/bash", *[f"# {h}" for h in job.header()], "#", *[f"# {c}".rstrip() for c in _prepare(job)],
             *_sbatch(job), "", "set -euo pipefail", "", *_environment(job), "", *_srun(job)]
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
    bundle = bundle_dir(job).replace(f"{SUBMIT}/", "").replace("$SLURM_SUBMIT_DIR/", "")
    store = "bundles/oci"
    shm = f"{job.shm_mib // 1024}Gi" if job.shm_mib % 1024 == 0 else f"{job.shm_mib}Mi"
    return ["Runtime: Slurm's own OCI support (srun --container=BUNDLE), Slurm 22.05 or newer, runc.",
            "Make the bundle once, on a filesystem every node mounts, in the directory you submit from:",
            f"  skopeo copy docker://{job.image} oci:{store}:{job.row}",
            "    (a plain-HTTP registry: add --src-tls-verify=false; from this host's Docker instead:",
            f"    skopeo copy docker-daemon:REPO:TAG oci:{store}:{job.row}, after checking that tag's digest)",
            f"  umoci unpack --image {store}:{job.row} {bundle}",
            f"  python3 -m pytorch_cuda_build.jobs.bundle {bundle} --shm-size {shm} --bind \"$PWD\""
            + "".join(f" --bind {m.bind()}" for m in job.mounts),
            *textwrap.wrap(
                "The last step edits the bundle's config.json: it drops the network namespace (the ranks of two nodes "
                "reach each other over the node's network) and the uts namespace (the node's hostname), mounts a "
                f"{shm} tmpfs on /dev/shm (NCCL's and the data loaders' shared memory), binds the node's /etc/hosts and "
                "/etc/resolv.conf and the submit directory" + (" and each --mount" if job.mounts else "") + ", and keeps "
                "the image's user (1000), working directory (/workspace) and environment. The binds are the bundle's "
                "own: run the step again when the submit directory or the --mount list changes.", WIDTH),
            "/etc/slurm/oci.conf on every node, for runc as root (22.05 refuses the %U pattern):",
            *[f"  {line}" for line in OCI_CONF],
            *_workdir_note(job)]


def _prepare_pyxis(job: Job) -> list[str]:
    return ["Runtime: pyxis and enroot (srun --container-image). The image is pulled by digest, which",
            "enroot accepts from 4.0.0 on (enroot 3.x takes tags only). pyxis writes a registry as",
            "REGISTRY#IMAGE; on the srun line below the value is quoted, and bash passes the # as it is.",
            "In an #SBATCH line sbatch cuts at an unescaped #, so there the same image is written:",
            f"  #SBATCH --container-image={sbatch_escape(job.image.pyxis())}",
            "  (that line runs the whole batch script in the container; this script does not use it).",
            "A plain-HTTP registry needs ENROOT_ALLOW_HTTP=yes in the environment srun passes on.",
            "/dev/shm: enroot bind-mounts the node's own /dev/shm (conf/mounts/10-system.fstab), so its",
            f"size is the node's; this job asked for {job.shm_mib} MiB (--shm-size), which the node must have.",
            *_workdir_note(job)]


def _prepare_apptainer(job: Job) -> list[str]:
    source = ("a SIF file (--sif); make one with: apptainer pull IMAGE.sif docker://" + str(job.image)) if job.sif else \
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


def _environment(job: Job) -> list[str]:
    lines = ["# NCCL finds InfiniBand (and RoCE) where the nodes have it; nothing to set for it."]
    nccl = job.nccl_env()
    if "NCCL_IB_DISABLE" in nccl:
        lines.append("# --network socket: TCP sockets only, InfiniBand off.")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in {**nccl, **job.launch_env()}.items()]
    if job.scheduler == "slurm" and not job.gpus_per_node:
        lines.append("# No GPU requested: the launch contract starts one rank per GPU the node shows, else one CPU rank.")
    lines += ["# The tasks' working directory, which the launch contract changes to.", f'export {WORKDIR}="{workdir(job)}"']
    return lines + [
        "# How long the first node's rendezvous waits for every node to join, in seconds: raise it where a",
        "# node can take longer to start (pulling or unpacking the image, a slow shared filesystem).",
        f"export PYTORCH_CUDA_RDZV_TIMEOUT={RDZV_TIMEOUT_S}",
        "# Every line of every rank starts with [rank N]; srun --label puts the node's task number before it.",
        "export PYTORCH_CUDA_RANK_LABELS=1"]


def _command(job: Job) -> str:
    """The launch contract and SCRIPT [ARGS], shell-quoted, as the user wrote them."""
    return " ".join([LAUNCH_PATH, *map(shlex.quote, job.command)])


def _srun(job: Job) -> list[str]:
    lines = _run(job)
    if any(c in a for a in job.command for c in "$`"):  # a directive applies to the command right after it
        at = next(i for i, line in enumerate(lines) if line.startswith("srun "))
        lines.insert(at, "# shellcheck disable=SC2016  # the ARGS reach the script as written, $ and all")
    return lines


def _run(job: Job) -> list[str]:
    if job.runtime == "oci":
        return [f'BUNDLE="{bundle_dir(job)}"',
                f"srun {SRUN_FLAGS} --container=\"$BUNDLE\" \\",
                f"  {_command(job)}"]
    if job.runtime == "pyxis":
        return [f"IMAGE={shlex.quote(job.image.pyxis())}",
                f"srun {SRUN_FLAGS} --container-image=\"$IMAGE\" --no-container-entrypoint \\",
                f'  --container-mounts="{_binds(job, f"{SUBMIT}:{SUBMIT}")}" --container-workdir="${WORKDIR}" \\',
                f"  {_command(job)}"]
    image = job.sif or f"docker://{job.image}"
    nv = "--nv " if job.gpus_per_node else ""
    return [f'IMAGE="{image}"',  # validated: no quote, backslash or backquote; a $VAR in --sif expands
            f"srun {SRUN_FLAGS} apptainer exec {nv}--bind \"{_binds(job, SUBMIT)}\" --pwd \"${WORKDIR}\" \"$IMAGE\" \\",
            f"  {_command(job)}"]
