"""`build.py job`: the sbatch script and the Kubernetes manifests it writes, offline.

Every manifest validates: core kinds (Job, Service) with kubernetes-validate against the API
schemas of Kubernetes 1.30, 1.33 and 1.37, the CRDs (TrainJob, TrainingRuntime, PyTorchJob, JobSet)
with jsonschema against their published openAPIV3Schema (tests/data/crds/SOURCE.md), unknown
fields refused. The sbatch script passes `bash -n` and shellcheck, and runs against a stand-in
`srun` that records its argv: what reaches srun is checked word for word (pyxis's `#`, quoting).
--mount reaches every runtime and kind, and the working directory is set, never the ARGS rewritten.
Every kind's pods request memory (at least /dev/shm's) in the QoS class asked for, and every kind
fails the whole gang on one failed pod, in its own fields, with the deadline where one is given.
"""
from __future__ import annotations

import json
import os
import pwd
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pytorch_cuda_build import jobs, pipeline
from pytorch_cuda_build.errors import BadValue, NotReady
from pytorch_cuda_build.jobs import kubernetes, mounts, ocibundle, ocigpus, slurm
from pytorch_cuda_build.jobs.options import Job

from helpers import ROOT, one_error_line, require, run_cli

DIGEST = "sha256:" + "0123456789abcdef" * 4
REPO = "127.0.0.1:5000/ml/pytorch-cuda"
IMAGE = f"{REPO}@{DIGEST}"
ROW = "2.7.1-cuda12.1-runtime"
CRDS = ROOT / "tests" / "data" / "crds"
CRD_FILES = {"TrainJob": "trainer.kubeflow.org_trainjobs.yaml", "TrainingRuntime": "trainer.kubeflow.org_trainingruntimes.yaml",
             "PyTorchJob": "kubeflow.org_pytorchjobs.yaml", "JobSet": "jobset.x-k8s.io_jobsets.yaml"}
K8S_VERSIONS = ("1.30.0", "1.33.0", "1.37.0")  # the oldest we name in the docs, 1.33, and the newest kubernetes-validate carries
NO_DOCKER = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}
SCRIPT = ("train.py", "--lr", "1e-4", "--note", "it's a \"test\" $HOME", "--tag", "a#b")


def make(scheduler: str = "slurm", **kw) -> Job:
    """A Job as `build.py job` makes it, its options given as the command line gives them."""
    fields = dict(scheduler=scheduler, name="train", row_name=ROW, ref=jobs.parse_image(IMAGE), nodes=2, gpus_per_node=8,
                  script=SCRIPT, runtime="oci" if scheduler == "slurm" else "")
    if scheduler == "kubernetes":
        fields["kind"] = "jobset"
    return Job(**{**fields, **kw})


# --- the image reference ---------------------------------------------------------------------

@pytest.mark.parametrize("text, repository, pyxis", [
    (IMAGE, REPO, f"127.0.0.1:5000#ml/pytorch-cuda@{DIGEST}"),
    (f"{REPO}:v2.7@{DIGEST}", REPO, f"127.0.0.1:5000#ml/pytorch-cuda@{DIGEST}"),  # the tag goes: the digest decides
    (f"ghcr.io/acme/pytorch-cuda@{DIGEST}", "ghcr.io/acme/pytorch-cuda", f"ghcr.io#acme/pytorch-cuda@{DIGEST}"),
    (f"localhost/pytorch-cuda@{DIGEST}", "localhost/pytorch-cuda", f"localhost#pytorch-cuda@{DIGEST}"),
    (f"acme/pytorch-cuda@{DIGEST}", "acme/pytorch-cuda", f"acme/pytorch-cuda@{DIGEST}"),  # Docker Hub: no registry part
])
def test_an_image_reference_is_read_with_its_digest(text, repository, pyxis):
    ref = jobs.parse_image(text)
    assert (ref.repository, ref.digest, ref.pyxis()) == (repository, DIGEST, pyxis)


@pytest.mark.parametrize("text", [f"{REPO}:v2.7", REPO, f"{REPO}@sha256:abc", f"{REPO}@md5:{'0' * 32}", f"UPPER/x@{DIGEST}", ""])
def test_a_reference_without_a_full_digest_is_refused(text):
    with pytest.raises(BadValue, match="pinned by digest"):
        jobs.parse_image(text)


def test_the_published_record_gives_the_reference(tmp_path):
    (tmp_path / "published.json").write_text(json.dumps({"registry": "127.0.0.1:5000/ml", "repository": REPO, "digest": DIGEST}))
    assert str(jobs.published(tmp_path, ROW)) == IMAGE
    (tmp_path / "published.json").write_text(json.dumps({"repository": REPO}))
    with pytest.raises(BadValue, match="pinned by digest"):
        jobs.published(tmp_path, ROW)
    with pytest.raises(NotReady, match=r"no published record .*publish --push.*--image"):
        jobs.published(tmp_path / "none", ROW)


def test_the_cli_takes_the_image_from_the_published_record(monkeypatch, tmp_path):
    (tmp_path / "published.json").write_text(json.dumps({"repository": REPO, "digest": DIGEST, "tags": ["v2.7"]}))
    monkeypatch.setattr(pipeline, "results_dir", lambda root, image: tmp_path)
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--cuda", "12.1", "--scheduler", "slurm", "--nodes", "2", "--", "train.py",
                   env=NO_DOCKER)
    assert proc.returncode == 0, proc.stderr
    assert f"# Image: {ROW}, pinned by digest: {IMAGE}" in proc.stdout


def test_without_a_published_record_or_image_the_cli_says_how_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(pipeline, "results_dir", lambda root, image: tmp_path / "none")
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "slurm", "--nodes", "2", "--", "train.py", env=NO_DOCKER)
    one_error_line(proc, 2, "has no published record")


# --- bad input: one line, exit 2 (the full table is in test_validate.py) -----------------------

@pytest.mark.parametrize("argv, says", [
    (["--scheduler", "slurm", "--image", f"{REPO}:v2.7"], "--image takes an image pinned by digest"),
    (["--scheduler", "slurm", "--kind", "jobset"], "--kind needs --scheduler kubernetes"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--runtime", "pyxis"], "--runtime needs --scheduler slurm"),
    (["--scheduler", "kubernetes"], "--scheduler kubernetes needs --kind"),
    (["--scheduler", "kubernetes", "--kind", "deployment"], "argument --kind: invalid choice: 'deployment'"),
    (["--scheduler", "slurm", "--runtime", "pyxis", "--bundle", "/shared/b"], "--bundle needs --runtime oci"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--mount", "code:/code"], "SOURCE 'code' is relative"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--mount", "/shared/code:code"], "TARGET 'code' is relative"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--mount", "nfs:server:/code"], "unknown SOURCE kind 'nfs:'"),
    (["--scheduler", "slurm", "--mount", "pvc:code:/code"], "--mount 'pvc:code:/code' needs --scheduler kubernetes"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--mount", "pvc:a:/data", "--mount", "/b:/data"], "both mount on /data"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--mount", "pvc:a:/dev/shm"], "TARGET /dev/shm is /dev/shm, which the job mounts"),
    (["--scheduler", "slurm", "--workdir", "src"], "--workdir takes an absolute directory"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--memory-per-node", "16Gi"],
     "--memory-per-node 16Gi must be larger than --shm-size 16Gi"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--shm-size", "32Gi", "--memory-per-node", "24Gi"],
     "--memory-per-node 24Gi must be larger than --shm-size 32Gi"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--memory-per-node", "64GB"], "--memory-per-node takes a size like 64Gi"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--qos", "guaranteed", "--memory-per-node", "64Gi"],
     "--qos guaranteed needs --cpus-per-node and --memory-per-node"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--qos", "besteffort"], "argument --qos: invalid choice: 'besteffort'"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--cpus-per-node", "0"], "argument --cpus-per-node: must be at least 1, not 0"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--image-pull-secret", "Reg_Cred"], "--image-pull-secret takes a Secret's name"),
    (["--scheduler", "kubernetes", "--kind", "jobset", "--deadline", "1 day"], "--deadline takes a duration"),
    (["--scheduler", "kubernetes", "--kind", "trainjob", "--cluster-runtime", "torch-distributed", "--deadline", "24h"],
     "--cluster-runtime and --deadline do not go together"),
    (["--scheduler", "slurm", "--memory-per-node", "64Gi"], "--memory-per-node needs --scheduler kubernetes"),
    (["--scheduler", "slurm", "--deadline", "24h"], "--deadline needs --scheduler kubernetes"),
])
def test_bad_job_input_is_one_line_and_exit_2(argv, says):
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--nodes", "2", *(["--image", IMAGE] if "--image" not in argv else []),
                   *argv, "--", "train.py", env=NO_DOCKER)
    one_error_line(proc, 2, says)
    assert proc.stdout == ""


@pytest.mark.parametrize("tail, says", [(["--nodes", "0", "--", "t.py"], "argument --nodes: must be at least 1, not 0"),
                                        (["--nodes", "2", "--"], "job needs SCRIPT [ARGS] after --"),
                                        (["--nodes", "2"], "job needs SCRIPT [ARGS] after --")])
def test_no_nodes_or_no_script_is_one_line_and_exit_2(tail, says):
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "slurm", "--image", IMAGE, *tail, env=NO_DOCKER)
    one_error_line(proc, 2, says)


def test_job_is_in_help():
    proc = run_cli(ROOT, "--help")
    assert "job" in proc.stdout and "launch contract" in proc.stdout


def test_job_help_shows_how_code_and_data_reach_the_tasks():
    proc = run_cli(ROOT, "job", "--help")
    assert proc.returncode == 0, proc.stderr
    for said in ("--mount SOURCE:TARGET[:ro]", "--workdir DIR", "code and data:", "--mount /shared/datasets:/data:ro",
                 "--mount pvc:code:/code:ro", "ignores fsGroup", "uid 1000 or group 1000"):
        assert said in proc.stdout, said


# --- Slurm -------------------------------------------------------------------------------------

def sbatch_argument(text: str) -> str:
    """One #SBATCH argument as sbatch reads it (src/sbatch/opt.c, _get_argument): quotes group,
    a backslash escapes the next character, an unescaped # ends the line."""
    out, quoted, escape = [], None, False
    for ch in text.strip():
        if escape:
            escape = False
        elif ch == "\\":
            escape = True
            continue
        elif quoted:
            if ch == quoted:
                quoted = None
                continue
        elif ch in "\"'":
            quoted = ch
            continue
        elif ch == "#":
            break
        elif ch.isspace():
            break
        out.append(ch)
    return "".join(out)


def sbatch_lines(text: str) -> list[str]:
    """The #SBATCH options sbatch would take: those before the first command."""
    found = []
    for line in text.splitlines()[1:]:
        if line.startswith("#SBATCH"):
            found.append(sbatch_argument(line[len("#SBATCH"):]))
        elif line.strip() and not line.startswith("#"):
            break
    return found


USER = pwd.getpwuid(os.getuid()).pw_name  # the oci bundle is per user: bundles/$(id -un)/
SUBMIT = "/submit dir"


def run_script(tmp_path: Path, text: str, *args: str, bundle: bool = True) -> tuple[list[str], dict[str, str]]:
    """The script run by bash with a stand-in srun on PATH: srun's argv and the exported environment,
    with the submit directory (a temporary one, with the oci runtime's bundle unless not `bundle`)
    written as SUBMIT."""
    submit = tmp_path / "submit dir"
    if bundle:
        (submit / "bundles" / USER / f"{ROW}-0123456789ab").mkdir(parents=True, exist_ok=True)
        (submit / "bundles" / USER / f"{ROW}-0123456789ab" / "config.json").write_text("{}")
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" > "$OUT/argv"\nenv -0 > "$OUT/env"\n')
    (bindir / "srun").chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "OUT": str(tmp_path), "SLURM_SUBMIT_DIR": str(submit), "HOME": "/home/u"}
    r = subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    argv = [a.replace(str(submit), SUBMIT) for a in (tmp_path / "argv").read_text().split("\0")[:-1]]
    environ = dict(kv.replace(str(submit), SUBMIT).split("=", 1) for kv in (tmp_path / "env").read_text().split("\0") if "=" in kv)
    return argv, environ


# One task per node, the step ended when one fails, each line labelled with its task.
SRUN = ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "--label"]
LAUNCHED = ["/usr/local/bin/pytorch-cuda-launch", *SCRIPT]  # SCRIPT and ARGS as written: the working directory does the rest


@pytest.mark.parametrize("runtime, srun_argv", [
    ("oci", [*SRUN, f"--container=/submit dir/bundles/{USER}/2.7.1-cuda12.1-runtime-0123456789ab", *LAUNCHED]),
    ("pyxis", [*SRUN, f"--container-image=127.0.0.1:5000#ml/pytorch-cuda@{DIGEST}", "--no-container-entrypoint",
               "--container-mounts=/submit dir:/submit dir", "--container-workdir=/submit dir", *LAUNCHED]),
    ("apptainer", [*SRUN, "apptainer", "exec", "--nv", "--bind", "/submit dir", "--pwd", "/submit dir",
                   f"docker://{IMAGE}", *LAUNCHED]),
])
def test_the_sbatch_script_runs_the_launch_contract_under_each_runtime(tmp_path, runtime, srun_argv):
    text = slurm.render(make(runtime=runtime))
    assert sbatch_lines(text) == ["--job-name=train", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive",
                                  "--mem=0", "--output=train-%j.out"]
    argv, env = run_script(tmp_path, text)
    assert argv == srun_argv
    assert env["PYTORCH_CUDA_NPROC_PER_NODE"] == "8"
    assert env["PYTORCH_CUDA_RDZV_TIMEOUT"] == "1800" and env["PYTORCH_CUDA_RANK_LABELS"] == "1"
    assert env["PYTORCH_CUDA_WORKDIR"] == "/submit dir"  # the launch contract changes to it: relative ARGS resolve there
    assert "NCCL_IB_DISABLE" not in env and "NCCL_SOCKET_IFNAME" not in env  # NCCL finds InfiniBand itself
    # enroot's 99-mellanox hook mounts InfiniBand devices only where this is set; the others need nothing
    assert env.get("MELLANOX_VISIBLE_DEVICES") == ("all" if runtime == "pyxis" else None)


MOUNTS = ("/shared/datasets:/data:ro", "/shared/out:/out")
BINDS = "/shared/datasets:/data:ro,/shared/out:/out"


@pytest.mark.parametrize("workdir, cwd", [(None, "/submit dir"), ("/data", "/data"), ("$SLURM_SUBMIT_DIR/src", "/submit dir/src")])
@pytest.mark.parametrize("runtime, srun_argv", [
    ("oci", [*SRUN, f"--container=/submit dir/bundles/{USER}/2.7.1-cuda12.1-runtime-0123456789ab", *LAUNCHED]),
    ("pyxis", [*SRUN, f"--container-image=127.0.0.1:5000#ml/pytorch-cuda@{DIGEST}", "--no-container-entrypoint",
               f"--container-mounts=/submit dir:/submit dir,{BINDS}", "--container-workdir={cwd}", *LAUNCHED]),
    ("apptainer", [*SRUN, "apptainer", "exec", "--nv", "--bind", f"/submit dir,{BINDS}", "--pwd", "{cwd}",
                   f"docker://{IMAGE}", *LAUNCHED]),
])
def test_mounts_reach_each_slurm_runtime_and_the_tasks_start_in_the_workdir(tmp_path, runtime, srun_argv, workdir, cwd):
    text = slurm.render(make(runtime=runtime, mount=MOUNTS, workdir=workdir))
    argv, env = run_script(tmp_path, text)
    assert argv == [a.format(cwd=cwd) for a in srun_argv]
    assert env["PYTORCH_CUDA_WORKDIR"] == cwd
    assert "#   /shared/datasets at /data (read-only)" in text and "#   /shared/out at /out" in text
    if runtime == "oci":  # the bundle's config.json holds the binds: the script's --make-bundle makes them
        step = next(line for line in text.splitlines() if line.startswith('  python3 - "$NEW"'))
        assert step.endswith('16384 "$PWD:$PWD:rw" /shared/datasets:/data:ro /shared/out:/out:rw <<\'PY\'')


@pytest.mark.parametrize("runtime", jobs.RUNTIMES)
def test_the_sbatch_script_passes_bash_n_and_shellcheck(tmp_path, runtime):
    path = tmp_path / "job.sbatch"
    path.write_text(slurm.render(make(runtime=runtime, socket_ifname="^docker,lo", network="socket", mount=MOUNTS,
                                      workdir="${SLURM_SUBMIT_DIR}/src")))
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    require(shutil.which("shellcheck"), "shellcheck is not installed (Debian: apt-get install shellcheck)")
    r = subprocess.run(["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout


def test_a_socket_network_and_an_interface_set_ncclenvironment(tmp_path):
    _, env = run_script(tmp_path, slurm.render(make(network="socket", socket_ifname="^docker,lo")))
    assert (env["NCCL_IB_DISABLE"], env["NCCL_SOCKET_IFNAME"]) == ("1", "^docker,lo")


def test_without_gpus_the_script_requests_none_and_apptainer_drops_nv(tmp_path):
    text = slurm.render(make(runtime="apptainer", gpus_per_node=0, sif="$SLURM_SUBMIT_DIR/img.sif"))
    assert not any(line.startswith("--gpus") for line in sbatch_lines(text))
    argv, env = run_script(tmp_path, text)
    assert "--nv" not in argv and "/submit dir/img.sif" in argv and "PYTORCH_CUDA_NPROC_PER_NODE" not in env


def test_pyxis_registry_hash_is_escaped_where_sbatch_reads_it():
    text = slurm.render(make(runtime="pyxis"))
    example = next(line for line in text.splitlines() if "#SBATCH --container-image=" in line)
    written = example.split("#SBATCH", 1)[1]
    assert "\\#" in written and sbatch_argument(written) == f"--container-image=127.0.0.1:5000#ml/pytorch-cuda@{DIGEST}"
    assert sbatch_argument(written.replace("\\#", "#")) == "--container-image=127.0.0.1:5000"  # what no escape would give
    assert slurm.sbatch_escape("a#b\\c") == "a\\#b\\\\c"


def test_the_oci_header_gives_the_bundle_step_and_oci_conf_for_22_05():
    text = slurm.render(make(runtime="oci"))
    assert "bash train.sbatch --make-bundle" in text and "PYTORCH_CUDA_IMAGE_SOURCE" in text
    conf = [line.removeprefix("#   ") for line in text.splitlines() if line.startswith("#   RunTime")]
    assert conf == slurm.oci_conf() and len(conf) == 4
    assert all("nvidia-container-runtime --rootless=true --root=/tmp/runc-%u " in line for line in conf)
    assert conf[-1].startswith(f'RunTimeRun="{slurm.GPU_WRAPPER} nvidia-container-runtime') and "%b %n.%u.%j.%s.%t" in conf[-1]
    assert "%U" not in "".join(conf) and all("%U" in line for line in slurm.oci_conf(user="%U"))  # 22.05 aborts on %U


def test_a_job_without_its_bundle_stops_before_srun_saying_how_to_make_it(tmp_path):
    script = tmp_path / "train.sbatch"
    script.write_text(slurm.render(make(runtime="oci")))
    r = subprocess.run(["bash", str(script)], env={"PATH": "/usr/bin:/bin", "SLURM_SUBMIT_DIR": str(tmp_path)},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 1 and r.stderr.startswith(f"error: no bundle at {tmp_path}/bundles/{USER}/{ROW}-0123456789ab: ")
    assert "bash train.sbatch --make-bundle" in r.stderr


def _stand_ins(bindir: Path, log: Path) -> None:
    """umoci and skopeo that record their arguments; umoci unpack writes a rootless config.json."""
    bindir.mkdir()
    (bindir / "skopeo").write_text(f'#!/bin/bash\necho "skopeo $*" >> {log}\n')
    (bindir / "umoci").write_text(f'#!/bin/bash\necho "umoci $*" >> {log}\n[ "$FAIL" = umoci ] && exit 1\n'
                                  f'mkdir -p "${{@: -1}}"\necho \'{json.dumps(ROOTLESS_CONFIG)}\' > "${{@: -1}}/config.json"\n')
    for tool in ("skopeo", "umoci"):
        (bindir / tool).chmod(0o755)


def test_make_bundle_copies_unpacks_rootless_and_edits_config_json_without_the_checkout(tmp_path):
    script = tmp_path / "train.sbatch"
    script.write_text(slurm.render(make(runtime="oci", mount=MOUNTS)))
    log = tmp_path / "calls"
    _stand_ins(tmp_path / "bin", log)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}  # no PYTHONPATH: ocibundle is inlined
    r = subprocess.run(["bash", str(script), "--make-bundle"], env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    made = tmp_path / "bundles" / USER / f"{ROW}-0123456789ab"
    assert r.stdout == f"bundle: {made}\n"
    calls = log.read_text().splitlines()
    assert calls[0].startswith(f"skopeo copy --src-no-creds docker://{IMAGE} oci:{made}.new.") and calls[0].endswith(".oci:image")
    assert calls[1].startswith("umoci --log error unpack --rootless --image ")
    config = json.loads((made / "config.json").read_text())
    assert config == ocibundle.patch(ROOTLESS_CONFIG, 16384, [(str(tmp_path), str(tmp_path), False),
                                                               ("/shared/datasets", "/data", True), ("/shared/out", "/out", False)])
    assert [p.name for p in made.parent.iterdir()] == [made.name]  # no .new or .oci left


def test_make_bundle_takes_an_oci_layout_in_place_and_leaves_nothing_when_a_step_fails(tmp_path):
    script = tmp_path / "train.sbatch"
    script.write_text(slurm.render(make(runtime="oci")))
    log = tmp_path / "calls"
    _stand_ins(tmp_path / "bin", log)
    env = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "PYTORCH_CUDA_IMAGE_SOURCE": "oci:/images/layout:v2.7"}
    r = subprocess.run(["bash", str(script), "--make-bundle"], env={**env, "FAIL": "umoci"}, capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and log.read_text().startswith("umoci --log error unpack --rootless --image /images/layout:v2.7 ")
    assert not (tmp_path / "bundles" / USER).exists() or not list((tmp_path / "bundles" / USER).iterdir())
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "id").symlink_to(shutil.which("id"))  # coreutils, not the tools it needs
    r = subprocess.run([shutil.which("bash"), str(script), "--make-bundle"], env={**env, "PATH": str(tmp_path / "empty")}, capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 1 and r.stderr == "error: --make-bundle needs umoci on PATH\n"


def _make_bundle_as_is(tmp_path: Path, env: dict[str, str], source: str | None = None) -> tuple[subprocess.CompletedProcess, list[str]]:
    """`bash train.sbatch --make-bundle` with stand-in skopeo and umoci, HOME in tmp_path/home, and
    only env beside PATH and HOME (no XDG_RUNTIME_DIR unless given): the run and skopeo's calls."""
    script = tmp_path / "train.sbatch"
    script.write_text(slurm.render(make(runtime="oci")))
    log = tmp_path / "calls"
    if not (tmp_path / "bin").exists():
        _stand_ins(tmp_path / "bin", log)
    (tmp_path / "home").mkdir(exist_ok=True)
    base = {"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path / "home")}
    r = subprocess.run(["bash", str(script), "--make-bundle"], env={**base, **env, **({"PYTORCH_CUDA_IMAGE_SOURCE": source} if source else {})},
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    calls = log.read_text().splitlines() if log.exists() else []
    log.unlink(missing_ok=True)
    return r, [c for c in calls if c.startswith("skopeo ")]


def _auth_file(path: Path, theirs: bool = False) -> Path:
    """An auth file; theirs: another user's (chown as root, else a link to a file root owns)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if theirs and os.geteuid() != 0:
        path.symlink_to("/etc/hostname")  # [ -O ] follows the link: root's file, not ours
        return path
    path.write_text('{"auths": {}}\n')
    if theirs:
        os.chown(path, 65534, 65534)
    return path


def test_make_bundle_always_names_skopeo_s_credentials_the_user_s_own_file_or_none(tmp_path):
    """skopeo never chooses for itself: unnamed, with XDG_RUNTIME_DIR unset, it reads
    /run/containers/UID/auth.json first and stops where that directory is 0700 (test_slurm.py runs it so)."""
    home, copy = tmp_path / "home", f"docker://{IMAGE} oci:"
    r, calls = _make_bundle_as_is(tmp_path, {})
    assert r.returncode == 0 and len(calls) == 1 and calls[0].startswith(f"skopeo copy --src-no-creds {copy}"), (r.stderr, calls)
    # containers-auth.json(5)'s order among the user's own files; a file of another user's is passed over
    docker = _auth_file(home / ".docker" / "config.json")
    assert _make_bundle_as_is(tmp_path, {})[1][0].startswith(f"skopeo copy --src-authfile={docker} {copy}")
    config = _auth_file(home / ".config" / "containers" / "auth.json")
    assert _make_bundle_as_is(tmp_path, {})[1][0].startswith(f"skopeo copy --src-authfile={config} {copy}")
    xdg_config = _auth_file(tmp_path / "xdg config" / "containers" / "auth.json")
    assert _make_bundle_as_is(tmp_path, {"XDG_CONFIG_HOME": str(tmp_path / "xdg config")})[1][0].startswith(
        f"skopeo copy --src-authfile={xdg_config} {copy}")
    runtime = _auth_file(tmp_path / "run" / "containers" / "auth.json")
    assert _make_bundle_as_is(tmp_path, {"XDG_RUNTIME_DIR": str(tmp_path / "run")})[1][0].startswith(
        f"skopeo copy --src-authfile={runtime} {copy}")
    _auth_file(tmp_path / "run0" / "containers" / "auth.json", theirs=True)  # su without -l: root's XDG_RUNTIME_DIR
    assert _make_bundle_as_is(tmp_path, {"XDG_RUNTIME_DIR": str(tmp_path / "run0")})[1][0].startswith(
        f"skopeo copy --src-authfile={config} {copy}")
    # a named file wins, the user's or not
    named = _auth_file(tmp_path / "site" / "auth.json", theirs=True)
    r, calls = _make_bundle_as_is(tmp_path, {"REGISTRY_AUTH_FILE": str(named), "XDG_RUNTIME_DIR": str(tmp_path / "run")})
    assert r.returncode == 0 and calls[0].startswith(f"skopeo copy --src-authfile={named} {copy}"), (r.stderr, calls)


@pytest.mark.parametrize("named", ["absent.json", "a-directory"])
def test_make_bundle_refuses_a_named_auth_file_it_cannot_read_in_one_line_before_writing_anything(tmp_path, named):
    (tmp_path / "a-directory").mkdir()
    r, calls = _make_bundle_as_is(tmp_path, {"REGISTRY_AUTH_FILE": str(tmp_path / named)})
    assert r.returncode == 1 and not calls, (r.stderr, calls)
    assert r.stderr == f"error: --make-bundle cannot read the registry credentials in {tmp_path / named} (REGISTRY_AUTH_FILE)\n"
    assert not (tmp_path / "bundles").exists()
    # an oci: layout needs no registry, and no credentials are looked for
    r, calls = _make_bundle_as_is(tmp_path, {"REGISTRY_AUTH_FILE": str(tmp_path / named)}, source="oci:/images/layout:v2.7")
    assert r.returncode == 0 and not calls, r.stderr


def test_the_cli_writes_mounts_and_workdir_into_the_script_and_its_header(tmp_path):
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "slurm", "--runtime", "apptainer", "--nodes", "2", "--image", IMAGE,
                   "--mount", "/shared/datasets:/data:ro", "--workdir", "/data", "--output", str(tmp_path), "--",
                   "train.py", "--deepspeed", "ds.json", env=NO_DOCKER)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    text = (tmp_path / "pytorch-cuda-2-7.sbatch").read_text()
    command = header_command(text)
    assert command[-4:] == ["--", "train.py", "--deepspeed", "ds.json"] and "--output" not in command
    assert {"--runtime apptainer", "--mount /shared/datasets:/data:ro", "--workdir /data"} <= pairs(command)
    assert rendered_again(command) == text
    argv, env = run_script(tmp_path, text)
    assert argv[-3:] == ["train.py", "--deepspeed", "ds.json"] and env["PYTORCH_CUDA_WORKDIR"] == "/data"


def test_the_cli_writes_the_script_into_a_directory(tmp_path):
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "slurm", "--runtime", "pyxis", "--nodes", "4", "--image", IMAGE,
                   "--name", "llm", "--output", str(tmp_path), "--", "train.py", env=NO_DOCKER)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    text = (tmp_path / "llm.sbatch").read_text()
    assert {"--runtime pyxis", "--nodes 4", "--name llm"} <= pairs(header_command(text)) and "#SBATCH --nodes=4" in text
    assert rendered_again(header_command(text)) == text


def header_command(text: str) -> list[str]:
    """The `build.py` arguments the script's GENERATED line names."""
    m = re.search(r"^# GENERATED by `python3 build\.py (job .*)`$", text, re.M)
    assert m, text[:500]
    return shlex.split(m.group(1))


def pairs(command: list[str]) -> set[str]:
    return {f"{a} {b}" for a, b in zip(command, command[1:])}


def rendered_again(command: list[str]) -> str:
    """What that command writes: the header's promise is that it renders this file again."""
    proc = run_cli(ROOT, *command, env=NO_DOCKER)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


# --- the OCI bundle ----------------------------------------------------------------------------

ROOTLESS_CONFIG = {  # what `umoci unpack --rootless` writes, cut down
    "ociVersion": "1.0.0", "hostname": "umoci-default",
    "process": {"terminal": True, "user": {"uid": 1000, "gid": 1000}, "cwd": "/workspace",
                "env": ["PATH=/opt/venv/bin:/usr/bin", "HOME=/home/user"], "args": ["bash"]},
    "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
               {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["size=65536k"]}],
    "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "user")],
              "uidMappings": [{"containerID": 0, "hostID": 1001, "size": 1}],
              "gidMappings": [{"containerID": 0, "hostID": 1001, "size": 1}]}}


def test_the_bundle_patch_shares_the_node_network_sizes_dev_shm_and_runs_as_the_mapped_user():
    out = ocibundle.patch(ROOTLESS_CONFIG, 16 * 1024, [("/shared/work", "/shared/work", False)])
    assert [ns["type"] for ns in out["linux"]["namespaces"]] == ["pid", "ipc", "mount", "user"]
    assert "hostname" not in out  # runc: "unable to set hostname without a private UTS namespace"
    shm = [m for m in out["mounts"] if m["destination"] == "/dev/shm"]
    assert len(shm) == 1 and shm[0]["type"] == "tmpfs" and "size=16384m" in shm[0]["options"]
    binds = {m["destination"]: m["options"] for m in out["mounts"] if m["type"] == "bind"}
    assert binds == {"/etc/hosts": ["rbind", "ro"], "/etc/resolv.conf": ["rbind", "ro"], "/shared/work": ["rbind", "rw"]}
    # uid 0 of the namespace is the bundle's maker, its only mapped id; srun gives pipes, not a terminal
    assert out["process"]["user"] == {"uid": 0, "gid": 0} and out["process"]["terminal"] is False
    assert {k: out["process"][k] for k in ("cwd", "env", "args")} == {k: ROOTLESS_CONFIG["process"][k] for k in ("cwd", "env", "args")}
    assert out["linux"]["uidMappings"] == ROOTLESS_CONFIG["linux"]["uidMappings"]
    assert [ns["type"] for ns in ROOTLESS_CONFIG["linux"]["namespaces"]][1] == "network"  # the input is untouched
    assert ocibundle.patch(out, 16 * 1024, [("/shared/work", "/shared/work", False)]) == out  # twice is once


def test_the_bundle_patch_refuses_a_bundle_unpacked_without_rootless_and_bad_binds():
    as_root = {**ROOTLESS_CONFIG, "linux": {"namespaces": ROOTLESS_CONFIG["linux"]["namespaces"]}}
    with pytest.raises(ValueError, match="umoci unpack --rootless"):
        ocibundle.patch(as_root, 1024, [])
    assert ocibundle.parse_bind("/shared/datasets:/data:ro") == ("/shared/datasets", "/data", True)
    for bad in ("relative:/data:ro", "/a:/b", "/a:/b:rx"):
        with pytest.raises(ValueError):
            ocibundle.parse_bind(bad)


def test_the_bundle_step_edits_config_json_whole_or_not_at_all(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ROOTLESS_CONFIG))
    ocibundle.main([str(tmp_path), "8192", "/shared:/shared:rw"])
    patched = json.loads((tmp_path / "config.json").read_text())
    assert "size=8192m" in next(m for m in patched["mounts"] if m["destination"] == "/dev/shm")["options"]
    before = (tmp_path / "config.json").read_text()
    with pytest.raises(SystemExit, match="a bind is SRC:DST"):
        ocibundle.main([str(tmp_path), "8192", "relative"])
    with pytest.raises(SystemExit, match="config.json: .*No such file"):
        ocibundle.main([str(tmp_path / "none"), "8192"])
    assert (tmp_path / "config.json").read_text() == before and [p.name for p in tmp_path.iterdir()] == ["config.json"]


# --- pytorch-cuda-oci-gpus: the step's GPUs named to NVIDIA's runtime -----------------------------

SHOW_JOB = """JobId=42 JobName=train
   JOB_GRES=gpu:a100:4
     Nodes=gpu[01-02] CPU_IDs=0-63 Mem=0 GRES=gpu:a100:2(IDX:0-1)
     Nodes=gpu03 CPU_IDs=0-63 Mem=0 GRES=gpu:a100:1(IDX:3),nic:1(IDX:0)
     Nodes=cpu01 CPU_IDs=0-63 Mem=0 GRES=
"""


def expand(nodes: str) -> list[str]:
    return {"gpu[01-02]": ["gpu01", "gpu02"]}.get(nodes, [nodes])


def test_the_wrapper_reads_each_node_s_gpu_indexes_from_scontrol():
    assert ocigpus.allocated(SHOW_JOB, "gpu02", expand) == [0, 1]
    assert ocigpus.allocated(SHOW_JOB, "gpu03", expand) == [3]  # not the NIC's index
    assert ocigpus.allocated(SHOW_JOB, "cpu01", expand) == []
    assert ocigpus.indexes("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    with pytest.raises(ocigpus.Refused, match="node gpu09 is not in the job's allocation"):
        ocigpus.allocated(SHOW_JOB, "gpu09", expand)


def test_the_wrapper_replaces_the_image_s_all_and_the_batch_node_s_variables():
    config = {"process": {"env": ["PATH=/usr/bin", "NVIDIA_VISIBLE_DEVICES=all", "CUDA_VISIBLE_DEVICES=2,3",
                                  "SLURM_JOB_GPUS=2,3", "GPU_DEVICE_ORDINAL=2,3", "SLURM_JOB_ID=42"]}, "mounts": []}
    out = ocigpus.edit(json.loads(json.dumps(config)), [0, 1], "/dev/infiniband")
    assert out["process"]["env"] == ["PATH=/usr/bin", "SLURM_JOB_ID=42", "NVIDIA_VISIBLE_DEVICES=0,1"]
    assert out["mounts"] == [{"destination": "/dev/infiniband", "type": "bind", "source": "/dev/infiniband",
                              "options": ["rbind", "nosuid", "noexec"]}]
    assert ocigpus.edit(out, [0, 1], "/dev/infiniband") == out  # twice is once
    assert "NVIDIA_VISIBLE_DEVICES=void" in ocigpus.edit(json.loads(json.dumps(config)), [], None)["process"]["env"]


def test_the_wrapper_finds_the_bundle_and_refuses_without_it_starting_nothing(tmp_path, capsys):
    assert ocigpus.bundle_of(["rt", "--rootless=true", "run", "--bundle", "/b", "id"]) == "/b"
    assert ocigpus.bundle_of(["rt", "create", "-b", "/c", "id"]) == "/c"
    with pytest.raises(SystemExit, match="no --bundle BUNDLE among the runtime's arguments.*no container started"):
        ocigpus.main(["true", "run", "id"])
    (tmp_path / "config.json").write_text(json.dumps({"process": {"env": ["PATH=/usr/bin"]}}))
    with pytest.raises(SystemExit, match="no SLURM_JOB_ID .*no container started"):
        ocigpus.main(["true", "run", "--bundle", str(tmp_path), "id"])
    with pytest.raises(SystemExit, match="usage: "):
        ocigpus.main(["true", "state", "id"])


def test_the_wrapper_runs_create_then_start_and_returns_the_container_s_exit_status(tmp_path):
    """A stand-in runtime: create forks the 'container' (it waits for start's signal file) and exits,
    as runc create does; start releases it. The wrapper, its subreaper, returns its status."""
    runtime = tmp_path / "rt"
    runtime.write_text(f"""#!/bin/bash
case " $* " in
  *" create "*) pidfile=$(sed -n 's/.*--pid-file \\([^ ]*\\).*/\\1/p' <<< "$*")
                (while [ ! -e {tmp_path}/go ]; do sleep 0.05; done; exit 7) & echo $! > "$pidfile"; echo "$*" >> {tmp_path}/calls ;;
  *" start "*) touch {tmp_path}/go; echo "$*" >> {tmp_path}/calls ;;
esac
""")
    runtime.chmod(0o755)
    # In a process of its own: it makes its caller a subreaper, which would keep every later test's
    # orphans as zombies of pytest's process
    code = f"import sys; from pytorch_cuda_build.jobs import ocigpus; sys.exit(ocigpus.create_then_start({[str(runtime), '--root=/r', 'run', '--bundle', '/b', 'cid']!r}))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 7
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[0].startswith("--root=/r create --pid-file ") and calls[0].endswith(" --bundle /b cid")
    assert calls[1] == "--root=/r start cid"

# --- Kubernetes --------------------------------------------------------------------------------

def strict(schema):
    """A CRD schema that refuses unknown fields where it lists properties, as --validate=strict."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema \
                and not schema.get("x-kubernetes-preserve-unknown-fields"):
            schema["additionalProperties"] = False
        return schema
    return [strict(s) for s in schema] if isinstance(schema, list) else schema


_SCHEMAS: dict[str, dict] = {}


def crd_schema(api_version: str, kind: str) -> dict:
    if kind not in _SCHEMAS:
        crd = yaml.safe_load((CRDS / CRD_FILES[kind]).read_text())
        group, version = api_version.split("/")
        assert crd["spec"]["group"] == group and crd["spec"]["names"]["kind"] == kind
        served = {v["name"]: v for v in crd["spec"]["versions"]}
        _SCHEMAS[kind] = strict(served[version]["schema"]["openAPIV3Schema"])
    return _SCHEMAS[kind]


def validate(doc: dict) -> None:
    if doc["kind"] in CRD_FILES:
        jsonschema.Draft7Validator(crd_schema(doc["apiVersion"], doc["kind"])).validate(doc)
    else:
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def pod_specs(doc: dict) -> list[dict]:
    spec = doc["spec"]
    if doc["kind"] == "PyTorchJob":
        return [r["template"]["spec"] for r in spec["pytorchReplicaSpecs"].values()]
    if doc["kind"] == "JobSet":
        return [r["template"]["spec"]["template"]["spec"] for r in spec["replicatedJobs"]]
    if doc["kind"] == "TrainingRuntime":
        return [r["template"]["spec"]["template"]["spec"] for r in spec["template"]["spec"]["replicatedJobs"]]
    if doc["kind"] == "Job":
        return [spec["template"]["spec"]]
    return []


VARIANTS = [dict(gpus_per_node=8, rdma=("rdma/ib=1",), namespace="ml", network="socket", socket_ifname="eth0"),
            dict(gpus_per_node=0, nodes=1),
            dict(cpus_per_node=32, memory_per_node="256Gi", qos="guaranteed", image_pull_secret=("regcred", "mirror.pull"), deadline="86400")]


@pytest.mark.parametrize("variant", VARIANTS, ids=["gpu-rdma", "cpu-one-node", "guaranteed-secrets-deadline"])
@pytest.mark.parametrize("kind", jobs.KINDS)
def test_every_manifest_validates_against_its_schema(kind, variant):
    job = make("kubernetes", kind=kind, **variant)
    docs = list(yaml.safe_load_all(kubernetes.render(job)))
    for doc in docs:
        validate(doc)
        assert doc["metadata"]["name"] == "train" and doc["metadata"].get("namespace") == variant.get("namespace")
    pods = [p for d in docs for p in pod_specs(d)]
    assert pods
    for pod in pods:
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000}
        assert pod["volumes"] == [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}]
        (c,) = pod["containers"]
        assert c["image"] == IMAGE and c["command"] == ["pytorch-cuda-launch", *SCRIPT]
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        devices = {k: v for k, v in c["resources"].get("limits", {}).items() if k not in ("cpu", "memory")}
        assert devices == ({"nvidia.com/gpu": 8, **({"rdma/ib": 1} if job.rdma else {})} if job.gpus_per_node else {})
        assert "memory" in c["resources"]["requests"]  # never BestEffort
        assert ("IPC_LOCK" in c["securityContext"]["capabilities"].get("add", [])) == bool(job.rdma)


K8S_MOUNTS = {"pvc": ("pvc:code:/code:ro", "pvc:datasets:/data"), "hostpath": ("/shared/code:/code:ro", "/shared/datasets:/data")}
K8S_VOLUMES = {"pvc": [{"name": "mount-0", "persistentVolumeClaim": {"claimName": "code"}},
                       {"name": "mount-1", "persistentVolumeClaim": {"claimName": "datasets"}}],
               "hostpath": [{"name": "mount-0", "hostPath": {"path": "/shared/code", "type": "Directory"}},
                            {"name": "mount-1", "hostPath": {"path": "/shared/datasets", "type": "Directory"}}]}
K8S_MOUNT_POINTS = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "mount-0", "mountPath": "/code", "readOnly": True},
                    {"name": "mount-1", "mountPath": "/data"}]


@pytest.mark.parametrize("workdir", [None, "/data"])
@pytest.mark.parametrize("source", ["pvc", "hostpath"])
@pytest.mark.parametrize("kind", jobs.KINDS)
def test_manifests_with_a_pvc_or_a_hostpath_mount_validate_and_start_in_the_code(kind, source, workdir):
    job = make("kubernetes", kind=kind, mount=K8S_MOUNTS[source], workdir=workdir, script=("train.py", "--deepspeed", "ds.json"))
    text = kubernetes.render(job)
    docs = list(yaml.safe_load_all(text))
    for doc in docs:
        validate(doc)  # Job and Service against Kubernetes 1.30, 1.33 and 1.37, strict; the others against their CRDs
    pods = [p for d in docs for p in pod_specs(d)]
    assert pods
    for pod in pods:
        assert pod["volumes"][1:] == K8S_VOLUMES[source] and pod["securityContext"]["fsGroup"] == 1000
        (c,) = pod["containers"]
        assert c["volumeMounts"] == K8S_MOUNT_POINTS
        assert c["workingDir"] == (workdir or "/code")  # the first mount, the code, unless --workdir
        assert c["command"] == ["pytorch-cuda-launch", "train.py", "--deepspeed", "ds.json"]  # as written
    header = [line for line in text.splitlines() if line.startswith("#")]
    assert f"# The working directory is {workdir or '/code'}: relative paths in SCRIPT and ARGS are taken from there." in header
    said = " ".join(line[2:] for line in header)
    if source == "hostpath":
        assert "hostPath volumes ignore fsGroup: on every node, /shared/code, /shared/datasets must exist and be readable " \
               "(and writable where outputs go) by uid 1000 or group 1000." in said
    else:
        assert "A PersistentVolumeClaim's files get fsGroup's group where its volume plugin supports it" in said
        assert "ignores fsGroup" not in said and "ignore fsGroup" not in said


@pytest.mark.parametrize("source", ["pvc", "hostpath"])
def test_a_trainjob_over_a_cluster_runtime_gets_the_mounts_as_overrides_and_the_workdir_as_the_contracts_variable(source):
    (doc,) = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="trainjob", cluster_runtime="torch-distributed",
                                                      mount=K8S_MOUNTS[source])))
    validate(doc)
    (override,) = doc["spec"]["podTemplateOverrides"]
    assert override["spec"]["volumes"][1:] == K8S_VOLUMES[source]
    assert override["spec"]["containers"] == [{"name": "node", "volumeMounts": K8S_MOUNT_POINTS}]
    assert {"name": "PYTORCH_CUDA_WORKDIR", "value": "/code"} in doc["spec"]["trainer"]["env"]  # v2.1's override has no workingDir


def test_without_a_mount_the_pods_keep_the_images_working_directory():
    for kind in jobs.KINDS:
        text = kubernetes.render(make("kubernetes", kind=kind))
        assert "workingDir" not in text and "PYTORCH_CUDA_WORKDIR" not in text and "fsGroup:" in text
    (_, job) = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="indexed-job", workdir="/app")))
    assert job["spec"]["template"]["spec"]["containers"][0]["workingDir"] == "/app"


@pytest.mark.parametrize("text, mount", [
    ("pvc:code:/code", mounts.Mount("code", "/code", pvc=True)),
    ("pvc:my.claim-1:/data:ro", mounts.Mount("my.claim-1", "/data", read_only=True, pvc=True)),
    ("/shared/code:/workspace", mounts.Mount("/shared/code", "/workspace")),
    ("/:/host:ro", mounts.Mount("/", "/host", read_only=True)),
])
def test_a_mount_is_read_and_written_back_as_given(text, mount):
    assert mounts.parse(text) == mount and str(mount) == text


@pytest.mark.parametrize("text, says", [
    ("/a", "--mount takes SOURCE:TARGET[:ro]"),
    ("pvc:code", "--mount takes SOURCE:TARGET[:ro]"),
    ("/a:/b:ro:x", "--mount takes SOURCE:TARGET[:ro]"),
    ("/a:/b:rw", "'rw' is no option of a mount; the one option is ro"),
    ("data:/data:ro", "SOURCE 'data' is relative"),
    ("s3:bucket:/data", "unknown SOURCE kind 's3:'"),
    ("pvc:Code:/code", "CLAIM 'Code' is not a PersistentVolumeClaim's name"),
    ("/a:/b/", "TARGET '/b/' is not in normal form (/b)"),
    ("/a$HOME:/b", "SOURCE '/a$HOME' holds a blank, quote, backslash, $, : or comma"),
    ("/a:/", "TARGET / would hide /dev/shm"),
    ("/a:/dev", "TARGET /dev would hide /dev/shm"),
    ("/a:/dev/shm/x", "TARGET /dev/shm/x is inside /dev/shm, which the job mounts (--shm-size)"),
    ("/a:/proc/x", "TARGET /proc/x is inside /proc"),
    ("/a:/etc", "TARGET /etc would hide /etc/hosts"),
    ("/a:/etc/resolv.conf", "TARGET /etc/resolv.conf is /etc/resolv.conf"),
    ("/a:/opt", "TARGET /opt would hide /opt/venv, which holds the image's Python and torch"),
    ("/a:/usr/local/bin", "TARGET /usr/local/bin is inside /usr"),
])
def test_a_bad_mount_is_one_line_naming_what_is_wrong(text, says):
    with pytest.raises(BadValue) as e:
        mounts.parse(text)
    assert says in str(e.value) and "\n" not in str(e.value)


def env_of(doc: dict) -> dict[str, str]:
    (pod,) = pod_specs(doc)[:1]
    return {e["name"]: e["value"] for e in pod["containers"][0].get("env", [])}


def test_jobset_and_indexed_job_name_pod_0_as_their_controllers_do():
    js = yaml.safe_load(kubernetes.render(make("kubernetes", kind="jobset", nodes=4)))
    assert js["spec"]["network"] == {"enableDNSHostnames": True}  # the subdomain defaults to the JobSet's name
    (rjob,) = js["spec"]["replicatedJobs"]
    assert (rjob["name"], rjob["replicas"]) == ("node", 1)
    assert {k: rjob["template"]["spec"][k] for k in ("completionMode", "completions", "parallelism")} == \
        {"completionMode": "Indexed", "completions": 4, "parallelism": 4}
    assert env_of(js) == {"PYTORCH_CUDA_NNODES": "4", "PYTORCH_CUDA_MASTER_ADDR": "train-node-0-0.train",
                          "PYTORCH_CUDA_MASTER_PORT": "29500", "PYTORCH_CUDA_NPROC_PER_NODE": "8"}
    service, job = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="indexed-job", nodes=4)))
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": "train"} and job["spec"]["template"]["spec"]["subdomain"] == "train"
    assert env_of(job)["PYTORCH_CUDA_MASTER_ADDR"] == "train-0.train"


def test_pytorchjob_has_a_master_and_n_minus_1_workers_in_containers_named_pytorch():
    (doc,) = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="pytorchjob", nodes=3)))
    replicas = doc["spec"]["pytorchReplicaSpecs"]
    assert {role: r["replicas"] for role, r in replicas.items()} == {"Master": 1, "Worker": 2}
    assert {r["template"]["spec"]["containers"][0]["name"] for r in replicas.values()} == {"pytorch"}
    assert doc["spec"]["nprocPerNode"] == "8"


def test_trainjob_brings_its_runtime_or_overrides_an_installed_one():
    runtime, train = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="trainjob", nodes=3)))
    assert runtime["kind"] == "TrainingRuntime" and train["spec"]["runtimeRef"] == \
        {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime", "name": "train"}
    (rjob,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    assert rjob["name"] == "node" and rjob["template"]["metadata"]["labels"] == {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}
    assert train["spec"]["trainer"]["numNodes"] == 3 and train["spec"]["trainer"]["image"] == IMAGE
    (only,) = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="trainjob", cluster_runtime="torch-distributed")))
    validate(only)
    assert only["spec"]["runtimeRef"]["kind"] == "ClusterTrainingRuntime"
    (override,) = only["spec"]["podTemplateOverrides"]
    assert override["spec"]["volumes"][0]["emptyDir"]["medium"] == "Memory"


def test_strict_validation_catches_a_misplaced_field():
    (doc,) = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="trainjob", cluster_runtime="torch-distributed")))
    doc["spec"]["podTemplateOverrides"][0]["spec"]["securityContext"] = {"runAsNonRoot": True}  # not in v2.1's override
    with pytest.raises(jsonschema.ValidationError, match="securityContext"):
        validate(doc)
    service, job = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="indexed-job")))
    job["spec"]["template"]["spec"]["containers"][0]["shmSize"] = "1Gi"
    with pytest.raises(Exception):
        validate(job)


# --- resources, pull secrets, failure policy and deadline ---------------------------------------

def containers_of(docs: list[dict]) -> list[dict]:
    """Every container the pods run, and a TrainJob's trainer (resourcesPerNode replaces the runtime
    container's resources, so it must say the same)."""
    out = [p["containers"][0] for d in docs for p in pod_specs(d)]
    out += [{"resources": d["spec"]["trainer"]["resourcesPerNode"]} for d in docs if d["kind"] == "TrainJob"]
    return out


QOS_CASES = {
    "default": (dict(), {"requests": {"memory": "16Gi"}, "limits": {"nvidia.com/gpu": 8}}),
    "default-no-gpu": (dict(gpus_per_node=0, shm_size="512Mi"), {"requests": {"memory": "512Mi"}}),
    "burstable": (dict(cpus_per_node=16, memory_per_node="64Gi"), {"requests": {"cpu": 16, "memory": "64Gi"}, "limits": {"nvidia.com/gpu": 8}}),
    "guaranteed": (dict(cpus_per_node=16, memory_per_node="66048Mi", qos="guaranteed", rdma=("rdma/ib=1",)),
                   {"requests": {"cpu": 16, "memory": "66048Mi"},
                    "limits": {"cpu": 16, "memory": "66048Mi", "nvidia.com/gpu": 8, "rdma/ib": 1}}),
}


@pytest.mark.parametrize("case", QOS_CASES)
@pytest.mark.parametrize("kind", jobs.KINDS)
def test_every_pod_requests_memory_and_guaranteed_limits_equal_the_requests(kind, case):
    fields, resources = QOS_CASES[case]
    docs = list(yaml.safe_load_all(kubernetes.render(make("kubernetes", kind=kind, **fields))))
    for doc in docs:
        validate(doc)
    found = containers_of(docs)
    assert len(found) == {"trainjob": 2, "pytorchjob": 2, "jobset": 1, "indexed-job": 1}[kind]
    assert all(c["resources"] == resources for c in found)
    header = " ".join(line[2:] for line in kubernetes.render(make("kubernetes", kind=kind, **fields)).splitlines()
                      if line.startswith("# "))
    assert f"QoS class {'Guaranteed' if fields.get('qos') == 'guaranteed' else 'Burstable'}" in header
    if "memory_per_node" in fields:
        assert "of working memory" in header
    else:
        assert "The memory request is /dev/shm's" in header and "--memory-per-node sets /dev/shm plus" in header


def qos_class(pod: dict) -> str:
    """Kubernetes' rule (pkg/apis/core/helper/qos): cpu and memory only; Guaranteed where every
    container limits both and any request equals its limit, BestEffort where none sets either."""
    cs = pod["containers"]
    named = [{k: v for k, v in c.get("resources", {}).get(part, {}).items() if k in ("cpu", "memory")}
             for c in cs for part in ("requests", "limits")]
    if not any(named):
        return "BestEffort"
    if all({"cpu", "memory"} <= set(c["resources"].get("limits", {})) and
           all(c["resources"]["limits"][k] == v for k, v in c["resources"].get("requests", {}).items()) for c in cs):
        return "Guaranteed"
    return "Burstable"


@pytest.mark.parametrize("kind", jobs.KINDS)
def test_the_qos_option_gives_its_class_and_no_pod_is_besteffort(kind):
    for fields, expected in [(dict(), "Burstable"), (dict(gpus_per_node=0), "Burstable"), (dict(cpus_per_node=8), "Burstable"),
                             (dict(cpus_per_node=8, memory_per_node="40Gi", qos="guaranteed"), "Guaranteed")]:
        pods = [p for d in yaml.safe_load_all(kubernetes.render(make("kubernetes", kind=kind, **fields))) for p in pod_specs(d)]
        assert pods and {qos_class(p) for p in pods} == {expected}, fields


@pytest.mark.parametrize("kind", jobs.KINDS)
def test_image_pull_secrets_reach_every_pod(kind):
    docs = list(yaml.safe_load_all(kubernetes.render(make("kubernetes", kind=kind, image_pull_secret=("regcred", "mirror.pull")))))
    for doc in docs:
        validate(doc)
    pods = [p for d in docs for p in pod_specs(d)]
    assert pods and all(p["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror.pull"}] for p in pods)
    assert not any("imagePullSecrets" in p for d in yaml.safe_load_all(kubernetes.render(make("kubernetes", kind=kind)))
                   for p in pod_specs(d))


GANG = {"backoffLimit": 0,
        "podFailurePolicy": {"rules": [
            {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            {"action": "FailJob", "onExitCodes": {"containerName": "node", "operator": "NotIn", "values": [0]}}]}}


def failure_fields(doc: dict) -> dict:
    """The failure and deadline fields of one document, where its kind keeps them."""
    spec, keys = doc["spec"], ("backoffLimit", "podFailurePolicy", "activeDeadlineSeconds", "backoffLimitPerIndex")
    if doc["kind"] == "Job":
        return {k: spec[k] for k in keys if k in spec}
    if doc["kind"] == "JobSet":
        (rjob,) = spec["replicatedJobs"]
        return {"failurePolicy": spec["failurePolicy"], **{k: rjob["template"]["spec"][k] for k in keys if k in rjob["template"]["spec"]}}
    if doc["kind"] == "TrainingRuntime":
        template = spec["template"]["spec"]
        (rjob,) = template["replicatedJobs"]
        return {"failurePolicy": template["failurePolicy"], **{k: rjob["template"]["spec"][k] for k in keys if k in rjob["template"]["spec"]}}
    if doc["kind"] == "PyTorchJob":
        assert {r["restartPolicy"] for r in spec["pytorchReplicaSpecs"].values()} == {"Never"}  # one failed pod fails the job
        return {"runPolicy": spec["runPolicy"]}
    return {}


@pytest.mark.parametrize("deadline", [None, 5400])
@pytest.mark.parametrize("kind, kinds, expected", [
    ("indexed-job", ["Service", "Job"], [{}, GANG]),
    ("jobset", ["JobSet"], [{"failurePolicy": {"maxRestarts": 0}, **GANG}]),
    ("trainjob", ["TrainingRuntime", "TrainJob"], [{"failurePolicy": {"maxRestarts": 0}, **GANG}, {}]),
    ("pytorchjob", ["PyTorchJob"], [{"runPolicy": {"cleanPodPolicy": "Running"}}]),
])
def test_each_kind_fails_the_gang_on_one_pod_and_takes_the_deadline_in_its_own_fields(kind, kinds, expected, deadline):
    docs = list(yaml.safe_load_all(kubernetes.render(make("kubernetes", kind=kind, deadline=deadline and str(deadline)))))
    for doc in docs:
        validate(doc)
    assert [d["kind"] for d in docs] == kinds
    if deadline:
        expected = [{**e, **({"activeDeadlineSeconds": deadline} if "podFailurePolicy" in e else {})} for e in expected]
        expected = [{"runPolicy": {**e["runPolicy"], "activeDeadlineSeconds": deadline}} if "runPolicy" in e else e for e in expected]
    assert [failure_fields(d) for d in docs] == expected
    said = " ".join(line[2:] for line in kubernetes.render(make("kubernetes", kind=kind, deadline=deadline and str(deadline))).splitlines()
                    if line.startswith("# "))
    assert "One failed or disrupted pod fails the whole job, with no retry" in said
    assert (f"Deadline: activeDeadlineSeconds {deadline}." if deadline else "No deadline (--deadline sets activeDeadlineSeconds).") in said


def test_a_trainjob_over_a_cluster_runtime_sets_requests_and_pull_secrets_and_says_what_it_cannot_set():
    text = kubernetes.render(make("kubernetes", kind="trainjob", cluster_runtime="torch-distributed", cpus_per_node=16, memory_per_node="64Gi",
                                  qos="guaranteed", image_pull_secret=("regcred",)))
    (doc,) = yaml.safe_load_all(text)
    validate(doc)
    assert doc["spec"]["trainer"]["resourcesPerNode"] == {"requests": {"cpu": 16, "memory": "64Gi"},
                                                          "limits": {"cpu": 16, "memory": "64Gi", "nvidia.com/gpu": 8}}
    (override,) = doc["spec"]["podTemplateOverrides"]
    assert override["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert not {"failurePolicy", "activeDeadlineSeconds", "backoffLimit", "runPolicy"} & set(doc["spec"])
    said = " ".join(line[2:] for line in text.splitlines() if line.startswith("# "))
    for fact in ("Trainer v2.1's TrainJob has no failure policy or deadline, nor do its podTemplateOverrides: the "
                 "ClusterTrainingRuntime torch-distributed decides them (its JobSet's failurePolicy, its Job's backoffLimit, "
                 "podFailurePolicy and activeDeadlineSeconds), and the pods' securityContext.",
                 "trainer.resourcesPerNode replaces the runtime container's resources; podTemplateOverrides' imagePullSecrets "
                 "are merged into the runtime's, by name.",
                 "QoS Guaranteed holds only where the runtime's other containers, if any, have limits equal to their requests."):
        assert fact in said
    assert "One failed or disrupted pod" not in said


def test_the_schemas_refuse_what_the_kinds_do_not_have():
    """The validation is not vacuous: a TrainJob has no deadline or failure policy of its own and
    its v2.1 overrides no resources; a misspelt failure field is refused in every kind."""
    (train,) = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="trainjob", cluster_runtime="torch-distributed")))
    for path, field in [(("spec",), "activeDeadlineSeconds"), (("spec",), "failurePolicy"), (("spec", "trainer"), "backoffLimit")]:
        doc = yaml.safe_load(yaml.safe_dump(train))
        target = doc
        for key in path:
            target = target[key]
        target[field] = 0
        with pytest.raises(jsonschema.ValidationError, match=field):
            validate(doc)
    doc = yaml.safe_load(yaml.safe_dump(train))
    doc["spec"]["podTemplateOverrides"][0]["spec"]["containers"][0]["resources"] = {"requests": {"memory": "1Gi"}}
    with pytest.raises(jsonschema.ValidationError, match="resources"):
        validate(doc)
    (js,) = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="jobset")))
    js["spec"]["failurePolicy"]["maxRestart"] = 0
    with pytest.raises(jsonschema.ValidationError, match="maxRestart"):
        validate(js)
    (pj,) = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="pytorchjob")))
    pj["spec"]["runPolicy"]["activeDeadline"] = 60
    with pytest.raises(jsonschema.ValidationError, match="activeDeadline"):
        validate(pj)
    runtime, _ = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="trainjob")))
    runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["deadlineSeconds"] = 60
    with pytest.raises(jsonschema.ValidationError, match="deadlineSeconds"):
        validate(runtime)
    _, job = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="indexed-job")))
    job["spec"]["podFailurePolicy"]["rules"][1]["onExitCodes"]["exitCodes"] = [1]
    with pytest.raises(Exception, match="exitCodes"):
        kubernetes_validate.validate(job, "1.33.0", strict=True)
    _, job = yaml.safe_load_all(kubernetes.render(make("kubernetes", kind="indexed-job")))
    job["spec"]["template"]["spec"]["containers"][0]["resources"]["request"] = {"cpu": 1}
    with pytest.raises(Exception, match="request"):
        kubernetes_validate.validate(job, "1.33.0", strict=True)


@pytest.mark.parametrize("text, mib", [("64Gi", 65536), ("64G", 65536), ("1536Mi", 1536), ("512M", 512)])
def test_a_memory_size_is_read_in_mib(text, mib):
    assert jobs.memory_mib(text) == mib


@pytest.mark.parametrize("text, seconds", [("24h", 86400), ("90m", 5400), ("1h30m", 5400), ("2d", 172800), ("45s", 45),
                                           ("3600", 3600), ("1d2h3m4s", 93784)])
def test_a_deadline_is_read_in_seconds(text, seconds):
    assert jobs.deadline_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "0h", "1.5h", "24H", "1 h", "30m1h", "h", "-1", "1w"])
def test_a_bad_deadline_is_one_line(text):
    with pytest.raises(BadValue, match=r"--deadline takes a duration of at least 1s") as e:
        jobs.deadline_seconds(text)
    assert "\n" not in str(e.value)


def test_the_cli_writes_the_resources_secrets_and_deadline_and_its_header_says_them(tmp_path):
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "kubernetes", "--kind", "indexed-job", "--nodes", "2",
                   "--gpus-per-node", "8", "--image", IMAGE, "--cpus-per-node", "32", "--memory-per-node", "256Gi", "--qos", "guaranteed",
                   "--image-pull-secret", "regcred", "--image-pull-secret", "mirror", "--deadline", "1h30m", "--output", str(tmp_path),
                   "--", "train.py", env=NO_DOCKER)
    assert proc.returncode == 0 and proc.stdout == "", proc.stderr
    text = (tmp_path / "pytorch-cuda-2-7.yaml").read_text()
    assert ("--cpus-per-node 32 --memory-per-node 256Gi --qos guaranteed --image-pull-secret regcred --image-pull-secret mirror "
            "--deadline 1h30m -- train.py") in text.splitlines()[0]
    _, job = yaml.safe_load_all(text)
    validate(job)
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"] == {"requests": {"cpu": 32, "memory": "256Gi"},
                                                 "limits": {"cpu": 32, "memory": "256Gi", "nvidia.com/gpu": 8}}
    assert pod["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}] and job["spec"]["activeDeadlineSeconds"] == 5400
    assert "# Each pod: QoS class Guaranteed; requests cpu 32, memory 256Gi; limits cpu 32, memory 256Gi," in text
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "kubernetes", "--kind", "jobset", "--nodes", "2", "--image", IMAGE,
                   "--", "train.py", env=NO_DOCKER)
    assert proc.returncode == 0, proc.stderr
    (js,) = yaml.safe_load_all(proc.stdout)
    (c,) = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"]
    assert c["resources"] == {"requests": {"memory": "16Gi"}}  # nothing given: /dev/shm's size, Burstable, not BestEffort
    assert "--qos" not in proc.stdout.splitlines()[0]


def test_yaml_1_2_numbers_in_the_command_stay_strings():
    text = kubernetes.render(make("kubernetes", kind="jobset", script=("train.py", "1e-4", "0x1F", "yes", "on", ".5")))
    for word in ("1e-4", "0x1F", "yes", "on", ".5"):
        assert f"- '{word}'" in text


def test_rendering_is_deterministic():
    job = make("kubernetes", kind="trainjob")
    assert kubernetes.render(job) == kubernetes.render(job)


def test_the_scripts_comment_shows_the_rank_prefix_the_launcher_writes():
    """The sbatch script's comment about rank labels shows the launcher's own prefix for rank N."""
    from pytorch_cuda_runtime.launch.cli import RANK_PREFIX

    assert slurm.RANK_LABEL_SHOWN == RANK_PREFIX.replace("${rank}", "N")
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--cuda", "12.1", "--scheduler", "slurm", "--nodes", "2", "--image",
                   "127.0.0.1:5000/ml/pytorch-cuda@sha256:" + "0123456789abcdef" * 4, "--", "train.py")
    assert proc.returncode == 0, proc.stderr
    assert f"# Every line of every rank starts with '{slurm.RANK_LABEL_SHOWN}';" in proc.stdout


# --preflight: pytorch-cuda-preflight on every node first, training only if it passed.
PREFLIGHT = ["/usr/local/bin/pytorch-cuda-preflight", "--gpus-per-node", "8", "--shm-size", "16Gi",
             "--report", "pytorch-cuda-preflight-4242.json"]


def run_steps(tmp_path: Path, text: str, preflight_rc: int) -> tuple[int, list[list[str]], str]:
    """The script under bash with a stand-in srun that records each step's argv and fails the
    preflight's step with preflight_rc: (exit status, the steps' argv, stderr)."""
    submit = tmp_path / "submit dir"
    (submit / "bundles" / USER / f"{ROW}-0123456789ab").mkdir(parents=True, exist_ok=True)
    (submit / "bundles" / USER / f"{ROW}-0123456789ab" / "config.json").write_text("{}")
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "srun").write_text('#!/bin/bash\nprintf "%s\\0" "$@" >> "$OUT/steps"; printf "\\n" >> "$OUT/steps"\n'
                                 'case "$*" in *pytorch-cuda-preflight*) echo "pytorch-cuda-preflight: FAILED: node n2: x" >&2;'
                                 ' exit "$PREFLIGHT_RC";; esac\n')
    (bindir / "srun").chmod(0o755)
    (tmp_path / "job.sbatch").write_text(text)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "OUT": str(tmp_path), "SLURM_SUBMIT_DIR": str(submit), "HOME": "/home/u",
           "SLURM_JOB_ID": "4242", "PREFLIGHT_RC": str(preflight_rc)}
    r = subprocess.run(["bash", str(tmp_path / "job.sbatch")], env=env, capture_output=True, text=True, timeout=30)
    steps = [[a.replace(str(submit), SUBMIT) for a in step.split("\0") if a] for step in
             (tmp_path / "steps").read_text().split("\n") if step] if (tmp_path / "steps").exists() else []
    return r.returncode, steps, r.stderr


@pytest.mark.parametrize("runtime", jobs.RUNTIMES)
def test_preflight_is_a_step_before_training_with_the_same_runtime_and_training_starts_only_if_it_passed(tmp_path, runtime):
    text = slurm.render(make(runtime=runtime, preflight=True))
    rc, steps, _ = run_steps(tmp_path, text, 0)
    assert rc == 0 and len(steps) == 2, steps
    first, second = steps
    assert first[first.index(PREFLIGHT[0]):] == PREFLIGHT  # what the job asked of each node, and its report
    assert second[second.index(LAUNCHED[0]):] == LAUNCHED
    assert first[:first.index(PREFLIGHT[0])] == second[:second.index(LAUNCHED[0])]  # the same image, runtime and flags
    (tmp_path / "failed").mkdir()
    rc, steps, err = run_steps(tmp_path / "failed", text, 1)
    assert rc == 1 and len(steps) == 1, steps  # no training step
    assert "pytorch-cuda-preflight: FAILED: node n2: x" in err and "the preflight failed (its lines above): training not started" in err
    assert "PYTORCH_CUDA_PREFLIGHT_JOIN_TIMEOUT (600 s)" in text and "PYTORCH_CUDA_PREFLIGHT_TIMEOUT (300 s) + 60 s" in text


def test_without_preflight_the_script_has_no_preflight_step(tmp_path):
    text = slurm.render(make())
    assert "pytorch-cuda-preflight" not in text
    assert len(run_steps(tmp_path, text, 1)[1]) == 1


@pytest.mark.parametrize("runtime", jobs.RUNTIMES)
def test_the_preflight_script_passes_bash_n_and_shellcheck(tmp_path, runtime):
    path = tmp_path / "job.sbatch"
    path.write_text(slurm.render(make(runtime=runtime, preflight=True, script=("train.py", "$HOME"))))
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    require(shutil.which("shellcheck"), "shellcheck is not installed (Debian: apt-get install shellcheck)")
    r = subprocess.run(["shellcheck", "--shell=bash", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout


@pytest.mark.parametrize("variant", VARIANTS, ids=["gpu-rdma", "cpu-one-node", "guaranteed-secrets-deadline"])
@pytest.mark.parametrize("kind", jobs.KINDS)
def test_with_preflight_every_pod_runs_it_before_the_launch_contract_and_validates(kind, variant):
    job = make("kubernetes", kind=kind, preflight=True, **variant)
    docs = list(yaml.safe_load_all(kubernetes.render(job)))
    for doc in docs:
        validate(doc)
    gpus = str(variant.get("gpus_per_node", 8))
    want = ["pytorch-cuda-preflight", "--gpus-per-node", gpus, "--shm-size", "16Gi", *(["--rdma"] if job.rdma else []),
            "--", "pytorch-cuda-launch", *SCRIPT]
    commands = [c["command"] for d in docs for p in pod_specs(d) for c in p["containers"] if "command" in c]
    commands += [d["spec"]["trainer"]["command"] for d in docs if d["kind"] == "TrainJob"]
    assert commands and all(c == want for c in commands), commands
    header = " ".join(line.removeprefix("# ") for line in kubernetes.render(job).splitlines() if line.startswith("#"))
    assert "Preflight (--preflight): each pod runs pytorch-cuda-preflight first" in header
    assert "PYTORCH_CUDA_PREFLIGHT_JOIN_TIMEOUT (600 s)" in header and "PYTORCH_CUDA_PREFLIGHT_TIMEOUT (300 s) + 60 s" in header


def test_the_cli_writes_preflight_into_the_header_and_the_script(tmp_path):
    out = tmp_path / "job.sbatch"
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "slurm", "--nodes", "2", "--image", IMAGE, "--preflight",
                   "--output", str(out), "--", "train.py")
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "--preflight -- train.py`" in text.splitlines()[1] and "/usr/local/bin/pytorch-cuda-preflight --gpus-per-node 0" in text
