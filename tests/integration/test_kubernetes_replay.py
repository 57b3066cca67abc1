"""Kubernetes, replayed (issue 28, item 4): each kind's manifests, rendered by the real CLI, run
as two pods would, with the environment each controller documents, on the built default row.

No Kubernetes cluster is reachable here, so two containers of the image play pod 0 and pod 1:
- the manifests come from `build.py job --scheduler kubernetes --kind KIND --nodes 2
  --gpus-per-node 2 -- /job/train.py ...`. The image is local and unpublished, so they are
  rendered for `pytorch-cuda@<its RepoDigest's digest>` (a fake digest where it has none) and
  the containers run the local image by tag, pytorch-cuda:v2.7;
- each container gets pod N's command exactly as the manifest has it (Kubernetes' `command`
  replaces the image's ENTRYPOINT: `--entrypoint`), the manifest's env, and what the controller
  adds (pytorch_cuda_runtime/launch/sources.py): TrainJob (Trainer v2.1) only PET_*, plus
  JOB_COMPLETION_INDEX (its nodes are an Indexed Job); PyTorchJob (training-operator v1.9)
  PET_*, MASTER_ADDR, MASTER_PORT, RANK (the node index) and WORLD_SIZE (processes); JobSet
  and Indexed Job JOB_COMPLETION_INDEX;
- ONE substitution: the master's DNS name becomes 127.0.0.1 and its port a free one, since there
  is no cluster DNS here. The test first checks that the manifest (or the controller's rule)
  gives the documented name, then substitutes;
- the pod's securityContext as docker options: runAsUser/runAsGroup 1000 (--user 1000:1000),
  fsGroup (--group-add), drop ALL capabilities, no privilege escalation; /dev/shm 1g where the
  manifest asks a 16Gi memory emptyDir; host networking on loopback. The nvidia.com/gpu limit is
  not replayed (no GPU): DS_ACCELERATOR=cpu, and each pod runs the manifest's 2 ranks on gloo.

tests/data/k8s_replay/train.py is the SCRIPT, in a host directory mounted at /job in both pods
(a shared volume, as a ReadWriteMany claim would be): ZeRO-3 through torchrun +
deepspeed.initialize (a raw config, torch's Adam) on every kind, then FSDP2 in the same launch
on two kinds, with the smoke suite's checks: the loss falls, each rank holds its share, and rank
0's consolidated checkpoint equals the gathered weights exactly. Every container is removed.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, code_blocks, free_port, one_error_line, owned_by_image_user, run_cli, shown, write_as_image_user

pytestmark = [pytest.mark.docker, pytest.mark.both_cores]

IMAGE = "pytorch-cuda:v2.7"
NAME = "replay"
NODES, NPROC = 2, 2
JOB_DIR = "/job"  # the manifests' SCRIPT is /job/train.py
SCRIPT = Path(__file__).resolve().parent.parent / "data" / "k8s_replay" / "train.py"
FAMILIES = {"trainjob": ("zero3",), "pytorchjob": ("zero3", "fsdp2"), "jobset": ("zero3",),
            "indexed-job": ("zero3", "fsdp2")}
CONSOLIDATED = {"zero3": "zero3.consolidated", "fsdp2": "fsdp2.consolidated"}
TIMEOUT = 420  # one launch of both pods; ZeRO-3 and FSDP2 on 4 CPU ranks take about a minute
ADDR_VARS = ("PET_MASTER_ADDR", "MASTER_ADDR", "PYTORCH_CUDA_MASTER_ADDR")
PORT_VARS = ("PET_MASTER_PORT", "MASTER_PORT", "PYTORCH_CUDA_MASTER_PORT")


@pytest.fixture(scope="module")
def reference(default_build) -> str:
    """The digest reference the manifests pin: the local image's own digest where it was pushed."""
    proc = subprocess.run(["docker", "image", "inspect", "-f", "{{json .RepoDigests}}", IMAGE],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, shown(proc)
    digests = [d.split("@")[1] for d in json.loads(proc.stdout) or [] if "@sha256:" in d]
    return f"pytorch-cuda@{digests[0] if digests else 'sha256:' + 'f' * 64}"


def render(kind: str, reference: str, args: tuple[str, ...], options: tuple[str, ...] = ()) -> list[dict]:
    proc = run_cli(ROOT, "job", "--torch", "2.7", "--scheduler", "kubernetes", "--kind", kind, "--nodes", str(NODES),
                   "--gpus-per-node", str(NPROC), "--image", reference, "--name", NAME, *options, "--", f"{JOB_DIR}/train.py", *args)
    assert proc.returncode == 0, shown(proc)
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert {d.get("spec", {}).get("trainer", {}).get("image") for d in docs if d["kind"] == "TrainJob"} <= {reference}
    return docs


def one(docs: list[dict], kind: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def trainjob_pods(docs: list[dict]) -> tuple[list[dict], list[dict[str, str]], str]:
    """Trainer v2.1's torch plugin: PET_* only; the trainer's command and env go onto the runtime's
    `node` container; its nodes are one Indexed Job, so Kubernetes adds JOB_COMPLETION_INDEX."""
    tj, rt = one(docs, "TrainJob"), one(docs, "TrainingRuntime")
    (rjob,) = rt["spec"]["template"]["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    (c,) = [c for c in pod["containers"] if c["name"] == rjob["name"]]
    trainer = tj["spec"]["trainer"]
    assert c["command"] == trainer["command"]
    c = {**c, "env": c.get("env", []) + trainer.get("env", [])}
    master = f"{tj['metadata']['name']}-{rjob['name']}-0-0.{tj['metadata']['name']}"
    envs = [{**env_of(c), "PET_NNODES": str(trainer["numNodes"]), "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
             "PET_NODE_RANK": str(i), "PET_MASTER_ADDR": master, "PET_MASTER_PORT": "29500",
             "JOB_COMPLETION_INDEX": str(i)} for i in range(trainer["numNodes"])]
    return [pod, pod], [c, c], envs


def pytorchjob_pods(docs: list[dict]) -> tuple[list[dict], list[dict], list[dict[str, str]]]:
    """training-operator v1.9: pod 0 is Master 0, pod 1 Worker 0 (node rank index+1)."""
    job = one(docs, "PyTorchJob")
    specs = job["spec"]["pytorchReplicaSpecs"]
    nodes = sum(s["replicas"] for s in specs.values())
    nproc = job["spec"]["nprocPerNode"]
    master_c = next(c for c in specs["Master"]["template"]["spec"]["containers"] if c["name"] == "pytorch")
    port = next(p["containerPort"] for p in master_c["ports"] if p["name"] == "pytorchjob-port")
    master = f"{job['metadata']['name']}-master-0"
    pods, containers, envs = [], [], []
    for role, rank in (("Master", 0), ("Worker", 1)):
        pod = specs[role]["template"]["spec"]
        c = next(c for c in pod["containers"] if c["name"] == "pytorch")
        pods.append(pod)
        containers.append(c)
        envs.append({**env_of(c), "MASTER_ADDR": master, "PET_MASTER_ADDR": master, "MASTER_PORT": str(port),
                     "PET_MASTER_PORT": str(port), "WORLD_SIZE": str(nodes * int(nproc)), "RANK": str(rank),
                     "PET_NODE_RANK": str(rank), "PET_NNODES": str(nodes), "PET_NPROC_PER_NODE": nproc})
    return pods, containers, envs


def indexed_pods(job_spec: dict, master: str) -> tuple[list[dict], list[dict], list[dict[str, str]]]:
    """An Indexed Job's pods: the manifest's env plus JOB_COMPLETION_INDEX; the manifest names
    pod 0 behind its headless service as the master."""
    assert job_spec["completionMode"] == "Indexed" and job_spec["completions"] == NODES
    pod = job_spec["template"]["spec"]
    (c,) = pod["containers"]
    assert env_of(c)["PYTORCH_CUDA_MASTER_ADDR"] == master, env_of(c)
    return [pod, pod], [c, c], [{**env_of(c), "JOB_COMPLETION_INDEX": str(i)} for i in range(NODES)]


def jobset_pods(docs: list[dict]):
    js = one(docs, "JobSet")
    (rjob,) = js["spec"]["replicatedJobs"]
    assert js["spec"]["network"].get("subdomain") is None  # so it defaults to the JobSet's name
    name = js["metadata"]["name"]
    return indexed_pods(rjob["template"]["spec"], f"{name}-{rjob['name']}-0-0.{name}")


def indexed_job_pods(docs: list[dict]):
    svc, job = one(docs, "Service"), one(docs, "Job")
    spec = job["spec"]
    sub = spec["template"]["spec"]["subdomain"]
    assert svc["spec"]["clusterIP"] == "None" and svc["metadata"]["name"] == sub
    assert svc["spec"]["selector"] == {"job-name": job["metadata"]["name"]}
    return indexed_pods(spec, f"{job['metadata']['name']}-0.{sub}")


PODS = {"trainjob": trainjob_pods, "pytorchjob": pytorchjob_pods, "jobset": jobset_pods, "indexed-job": indexed_job_pods}


def on_loopback(envs: list[dict[str, str]], master: str, port: str) -> list[dict[str, str]]:
    """The one substitution: the documented master name and port become 127.0.0.1 and a free port."""
    out = []
    for env in envs:
        assert {env[v] for v in ADDR_VARS if v in env} == {master}, env
        assert {env[v] for v in PORT_VARS if v in env} == {"29500"}, env
        out.append({**env, **{v: "127.0.0.1" for v in ADDR_VARS if v in env}, **{v: port for v in PORT_VARS if v in env}})
    return out


def docker_options(pod: dict, container: dict) -> list[str]:
    """The pod's securityContext and /dev/shm volume, as docker run options."""
    sc, csc = pod["securityContext"], container["securityContext"]
    assert sc["runAsNonRoot"] and csc["allowPrivilegeEscalation"] is False and csc["capabilities"]["drop"] == ["ALL"]
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"]["medium"] == "Memory" and {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    return ["--user", f"{sc['runAsUser']}:{sc['runAsGroup']}", "--group-add", str(sc["fsGroup"]), "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--shm-size", "1g"]


def start(pod: dict, container: dict, env: dict[str, str], job_dir: Path | None, label: str, image: str = IMAGE) -> str:
    """Pod N's container: its command, env and securityContext; job_dir mounted at /job (None: no mount)."""
    from pytorch_cuda_build.stages import gate

    command = container["command"]
    env = {**env, "DS_ACCELERATOR": "cpu"}
    mount = ["-v", f"{job_dir}:{JOB_DIR}"] if job_dir is not None else []
    proc = subprocess.run(["docker", "run", "-d", "--network", "host", "--label", f"{gate.RUN_LABEL}={gate.RUN_ID}",
                           "--label", f"pytorch-cuda.test={label}", *docker_options(pod, container),
                           *mount, *[a for k, v in env.items() for a in ("-e", f"{k}={v}")],
                           "--entrypoint", command[0], image, *command[1:]], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, shown(proc)
    return proc.stdout.strip()


def finish(cid: str, deadline: float) -> tuple[int, str]:
    """The container's exit code and its log, waiting until the deadline at most."""
    try:
        rc = subprocess.run(["docker", "wait", cid], capture_output=True, text=True,
                            timeout=max(deadline - time.monotonic(), 1)).stdout.strip()
    except subprocess.TimeoutExpired:
        rc = "timed out"
    log = subprocess.run(["docker", "logs", cid], capture_output=True, text=True, timeout=60)
    return (int(rc) if rc.lstrip("-").isdigit() else -1), f"exit {rc}\n{(log.stdout + log.stderr)[-6000:]}"


def replay(kind: str, reference: str, job_dir: Path, families: tuple[str, ...], options: tuple[str, ...] = (),
           before: tuple[str, ...] = (), extra: dict[str, str] | None = None) -> dict[int, tuple[int, str]]:
    """The pods' containers to their end. options: more `job` options; before: what the command has
    before the launch contract (--preflight's); extra: environment beyond the manifest's and the controller's."""
    pods, containers, envs = PODS[kind](render(kind, reference, families, options))
    assert [c["command"] for c in containers] == [[*before, "pytorch-cuda-launch", f"{JOB_DIR}/train.py", *families]] * NODES
    master = {"trainjob": f"{NAME}-node-0-0.{NAME}", "pytorchjob": f"{NAME}-master-0",
              "jobset": f"{NAME}-node-0-0.{NAME}", "indexed-job": f"{NAME}-0.{NAME}"}[kind]
    envs = [{**e, **(extra or {})} for e in on_loopback(envs, master, str(free_port()))]
    cids: list[str] = []
    try:
        for i in range(NODES):
            cids.append(start(pods[i], containers[i], envs[i], job_dir, f"k8s-replay-{kind}"))
        deadline = time.monotonic() + TIMEOUT
        return {i: finish(cid, deadline) for i, cid in enumerate(cids)}
    finally:
        for cid in cids:
            subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=120)


def job_dir(tmp_path: Path) -> Path:
    d = tmp_path / "job"
    d.mkdir()
    shutil.copy(SCRIPT, d / "train.py")
    return owned_by_image_user(d)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_replayed_pods_train(kind, reference, tmp_path):
    d = job_dir(tmp_path)
    t0 = time.monotonic()
    results = replay(kind, reference, d, FAMILIES[kind])
    print(f"{kind}: {' + '.join(FAMILIES[kind])} on 2 pods x {NPROC} ranks in {time.monotonic() - t0:.0f} s")
    for i, (rc, log) in results.items():
        assert rc == 0, f"pod {i}: {log}"
    for family in FAMILIES[kind]:
        recs = [r for f in sorted((d / "results" / family).glob("rank*.json")) for r in json.loads(f.read_text())]
        failed = [r for r in recs if r["status"] == "FAIL"]
        assert recs and not failed, json.dumps(failed or recs, indent=1)[-4000:]
        world = NODES * NPROC
        assert {r["rank"] for r in recs} == set(range(world))
        nodes = {r["rank"]: r["actual"] for r in recs if r["check"] == f"{family}.node"}
        # torchrun's GROUP_RANK: ranks 0-1 on pod 0 and 2-3 on pod 1, as the node ranks the pods got.
        assert nodes == {r: f"node {r // NPROC}" for r in range(world)}, nodes
        passed = {(r["check"], r["rank"]) for r in recs if r["status"] == "PASS"}
        sizes = {r["actual"] for r in recs if r["check"] == f"{family}.world_size"}
        assert sizes == {world}, sizes
        for rank in range(world):
            for check in ("world_size", "loss_falls", "param_share"):
                assert (f"{family}.{check}", rank) in passed, (family, check, rank)
        assert (f"{CONSOLIDATED[family]}.exact", 0) in passed, "rank 0 consolidated the checkpoint and compared it"


def test_bad_environment_exits_2_before_any_rank(reference, tmp_path):
    """A PyTorchJob pod whose node rank is not below the node count: one line, exit 2, nothing run."""
    d = job_dir(tmp_path)
    pods, containers, envs = pytorchjob_pods(render("pytorchjob", reference, ("zero3",)))
    env = {**on_loopback(envs, f"{NAME}-master-0", str(free_port()))[1], "PET_NODE_RANK": "2", "RANK": "2"}
    cid = start(pods[1], containers[1], env, d, "k8s-replay-bad-env")
    try:
        rc, _ = finish(cid, time.monotonic() + 120)
        out = subprocess.run(["docker", "logs", cid], capture_output=True, text=True, timeout=60)
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=120)
    proc = subprocess.CompletedProcess(containers[1]["command"], rc, out.stdout, out.stderr)
    one_error_line(proc, 2, "PET_NODE_RANK=2 is not below PET_NNODES=2", prefix="pytorch-cuda: error: ", only_line=True)
    assert out.stdout == "" and not (d / "results").exists(), shown(proc)


# --preflight, replayed in one kind of each source: Kubeflow's PET_* (PyTorchJob) and the contract's
# own variables (JobSet). The pods run it before the launch contract, which it execs once both
# passed. No GPU here: the preflight's test hook (PYTORCH_CUDA_PREFLIGHT_STANDIN) says what
# nvidia-smi would list, two stand-in GPUs per pod, and the fabric runs on the 2 gloo ranks.
PREFLIGHT = ("pytorch-cuda-preflight", "--gpus-per-node", str(NPROC), "--shm-size", "1Gi", "--")
STANDIN = {"*": [{"name": "stand-in GPU", "driver": "550.54.15", "capability": "9.0"}] * NPROC}


@pytest.mark.parametrize("kind", ["pytorchjob", "jobset"])
def test_replayed_pods_run_the_preflight_then_train(kind, reference, tmp_path):
    d = job_dir(tmp_path)
    write_as_image_user(d / "standin.json", json.dumps(STANDIN))  # d is uid 1000's; this user may not be root
    t0 = time.monotonic()
    results = replay(kind, reference, d, ("zero3",), ("--preflight", "--shm-size", "1Gi"), PREFLIGHT,
                     {"PYTORCH_CUDA_PREFLIGHT_STANDIN": f"{JOB_DIR}/standin.json",
                      "PYTORCH_CUDA_PREFLIGHT_REPORT": f"{JOB_DIR}/preflight.json", "PYTORCH_CUDA_PREFLIGHT_JOIN_TIMEOUT": "120"})
    print(f"{kind}: preflight + zero3 on 2 pods x {NPROC} ranks in {time.monotonic() - t0:.0f} s")
    for i, (rc, log) in results.items():
        assert rc == 0, f"pod {i}: {log}"
        assert "2 node(s) answered and passed their checks: node 0, node 1" in log, log
        assert "pytorch-cuda-preflight: passed; starting pytorch-cuda-launch" in log, log
    report = json.loads((d / "preflight.json").read_text())
    assert report["passed"] and report["ranks"] == NODES * NPROC and report["backend"] == "gloo"
    assert all("2 GPU(s) via stand-in GPUs" in line for line in report["node_checks"]), report["node_checks"]
    recs = [r for f in sorted((d / "results" / "zero3").glob("rank*.json")) for r in json.loads(f.read_text())]
    assert recs and not [r for r in recs if r["status"] == "FAIL"] and {r["rank"] for r in recs} == set(range(NODES * NPROC))


# docs/kubernetes.md, "The code in an image of your own": the worked example baked into an image
# built FROM the default row's, pushed to the session's registry (where publish pushed the row, so
# the push sends the new layer and mounts the rest), pinned by the digest the page's inspect line
# prints, and the page's job line's Indexed Job replayed from that image alone (no volume).
DERIVED_DOC = (ROOT / "docs" / "kubernetes.md").read_text().split("## The code in an image of your own", 1)[1].split("\n## ", 1)[0]


def derived_journey() -> tuple[str, list[str]]:
    """The section's Dockerfile and its command lines."""
    blocks = code_blocks(DERIVED_DOC)
    (dockerfile,) = [b for lang, b, _ in blocks if lang == "dockerfile"]
    (commands,) = [b for lang, b, _ in blocks if lang == "" and "docker push" in b]
    return dockerfile, commands.splitlines()


def test_a_derived_image_pushed_and_pinned_by_its_digest_runs_the_indexed_job_s_pods(default_published, session_registry, tmp_path):
    dockerfile, lines = derived_journey()
    assert dockerfile.startswith(f"FROM {IMAGE}\n")
    assert [ln.split()[0] for ln in lines] == ["mkdir", "docker", "docker", "docker", "python3", "kubectl"], lines
    folder = tmp_path / "my-train"

    def filled(line: str) -> str:
        """The page's line with the suite's registry and the folder in tmp_path (not the repository's name, ml/my-train)."""
        return re.sub(r"(?<![/\w-])my-train(?=/|\s|$)", str(folder), line.replace("127.0.0.1:5000", session_registry.host))

    folder.mkdir()
    (folder / "Dockerfile").write_text(dockerfile)
    tag = filled("127.0.0.1:5000/ml/my-train:1")
    # 20.10's own client where it is installed: its BuildKit is built in (a newer client first on PATH may lack buildx)
    env = {**os.environ, "PATH": f"/usr/bin:{os.environ['PATH']}"} if Path("/usr/bin/docker").exists() else None
    ref = None
    try:
        said = []
        for line in lines[:4]:  # mkdir and cp, build, push, inspect: as the page has them, in the checkout
            proc = subprocess.run(["bash", "-c", filled(line)], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
            assert proc.returncode == 0, shown(proc)
            said.append(proc.stdout)
        ref = said[3].strip()
        assert re.fullmatch(rf"{re.escape(session_registry.host)}/ml/my-train@sha256:[0-9a-f]{{64}}", ref), ref
        # what the page says: the push's last line names the same digest
        assert re.search(rf"^1: digest: {ref.split('@')[1]} size: \d+$", said[2], re.M), said[2]
        # the registry serves that manifest under the tag: the digest is the pushed one, not the engine's own ID
        served = subprocess.run(["skopeo", "inspect", "--tls-verify=false", "--format", "{{.Digest}}", f"docker://{tag}"],
                                capture_output=True, text=True, timeout=120)
        assert served.returncode == 0 and served.stdout.strip() == ref.split("@")[1], shown(served)
        job_line = filled(lines[4]).replace("sha256:<digest>", ref.split("@")[1]).replace("--gpus-per-node 8", f"--gpus-per-node {NPROC}")
        argv = shlex.split(job_line)
        out = tmp_path / "job.yaml"
        proc = run_cli(ROOT, *[str(out) if a == "job.yaml" else a for a in argv[2:]])
        assert proc.returncode == 0, shown(proc)
        docs = [d for d in yaml.safe_load_all(out.read_text()) if d]
        pods, containers, envs = indexed_job_pods(docs)
        assert {c["image"] for c in containers} == {ref} and containers[0]["command"] == [
            "pytorch-cuda-launch", "train.py", "--deepspeed_config", "ds_config.json"]
        name = one(docs, "Job")["metadata"]["name"]
        envs = on_loopback(envs, f"{name}-0.{name}", str(free_port()))
        cids: list[str] = []
        try:
            for i in range(NODES):
                cids.append(start(pods[i], containers[i], envs[i], None, "k8s-replay-derived", image=ref))
            deadline = time.monotonic() + TIMEOUT
            results = {i: finish(cid, deadline) for i, cid in enumerate(cids)}
        finally:
            for cid in cids:
                subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=120)
        for i, (rc, log) in results.items():
            assert rc == 0, f"pod {i}: {log}"
        first, last = map(float, re.search(r"first ([\d.]+) last ([\d.]+)", results[0][1]).groups())
        assert last < first / 2, results[0][1]
    finally:
        for name in (tag, ref):
            if name:
                subprocess.run(["docker", "image", "rm", name], capture_output=True, timeout=120)
