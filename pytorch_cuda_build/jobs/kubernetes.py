"""Kubernetes manifests for one job: the launch contract as the command, the image by digest.

Every pod gets the same pieces (pod_spec): /dev/shm as a memory-backed emptyDir, the image's
user (1000:1000) as a non-root securityContext with fsGroup, nvidia.com/gpu and optional RDMA
limits (with IPC_LOCK, which RDMA's memory registration needs), and NCCL's environment. The
kinds differ in how a pod learns its place, read from each controller's source
(pytorch_cuda_runtime/launch/sources.py):

  trainjob     Kubeflow Trainer v2.1 (trainer.kubeflow.org/v1alpha1): the torch plugin sets PET_*.
               A TrainJob's podTemplateOverrides (v2.1) carry volumes, volumeMounts and env, but no
               securityContext or capabilities, so the job comes with its own TrainingRuntime
               holding the pod template; --cluster-runtime NAME uses an installed
               ClusterTrainingRuntime instead (its securityContext is then that runtime's).
               v2.0 called the field podSpecOverrides and v2.2 replaced it with runtimePatches.
  pytorchjob   training-operator v1.8/v1.9 (kubeflow.org/v1): Master 1 + Worker N-1, container
               `pytorch`; the operator sets PET_* and MASTER_*.
  jobset       JobSet v0.12 (jobset.x-k8s.io/v1alpha2): one replicated Job, Indexed, N pods; the
               subdomain defaults to the JobSet's name, so pod 0 is <jobset>-node-0-0.<jobset>.
  indexed-job  batch/v1 Job, Indexed, N pods, behind a headless Service named as the subdomain:
               pod 0 is <job>-0.<job>.
JobSet and Indexed Jobs set no rendezvous variables: the manifest sets the contract's own
PYTORCH_CUDA_NNODES and PYTORCH_CUDA_MASTER_ADDR, and Kubernetes sets JOB_COMPLETION_INDEX.

--preflight (Job.entry): each pod's command is `pytorch-cuda-preflight ARGS -- pytorch-cuda-launch
SCRIPT [ARGS]`; the preflight execs the launch contract once every node has passed, and a failure
is the container's non-zero exit, which fails the gang as below.

Code and data (--mount, mounts.py): each mount is a volume, a PersistentVolumeClaim or a hostPath
of type Directory, and a volumeMount in the container. The working directory (`workingDir`) is
--workdir, else the first mount's TARGET; with neither, the image's /workspace. A TrainJob over a
ClusterTrainingRuntime cannot set workingDir (v2.1's overrides carry no such field), so it gets
PYTORCH_CUDA_WORKDIR, which the launch contract changes to. hostPath volumes ignore fsGroup, which
the header says, beside the paths it concerns.

Resources (resources): a memory-backed /dev/shm counts against the container's memory, so every
pod requests memory: --memory-per-node (/dev/shm plus working memory), else /dev/shm's size, so
that no pod is BestEffort. --qos burstable (the default) writes requests, and limits only for the
GPUs and RDMA devices; --qos guaranteed also limits cpu and memory to the requests, which needs
both --cpus-per-node and --memory-per-node. --image-pull-secret names the pods' imagePullSecrets.

Failure (gang): a static rendezvous cannot take a replacement pod, so one failed pod fails the
whole job, with no retry, and --deadline bounds the job's time, each in the kind's own terms:
the Indexed Job (alone, in a JobSet or in the TrainingRuntime's JobSet template) has backoffLimit
0, a podFailurePolicy that fails the Job on a non-zero exit and on a disruption (a replaced pod
could not rejoin: the survivors would wait on it until NCCL's timeout), and activeDeadlineSeconds;
a JobSet adds failurePolicy maxRestarts 0. A PyTorchJob's replicas have restartPolicy Never, with
which training-operator v1.8/v1.9 fails the job on one failed pod; its runPolicy has cleanPodPolicy
Running (once the job has ended, its running and pending pods go, the failed ones stay for their
logs) and activeDeadlineSeconds, and no backoffLimit: past one, the operator deletes every pod at
once, the failed one and its logs included. A TrainJob over a ClusterTrainingRuntime can set
neither: v2.1's TrainJob has no such fields, and that runtime decides (notes() says so).
"""
from __future__ import annotations

import re
import textwrap
from typing import Any

import yaml

from . import quantity
from .options import Job

TRAINER = "trainer.kubeflow.org/v1alpha1"
UID = GID = 1000  # the image's user (templates/finish.j2: USER 1000:1000)
SHM = "dshm"
WORKDIR = "PYTORCH_CUDA_WORKDIR"  # the launch contract changes to it (pytorch_cuda_runtime/launch)
RJOB = "node"  # Trainer's replicated job and container name, reused for JobSet
PORT = 29500  # torchrun's default, and Trainer's PET_MASTER_PORT
# 24h, 90m, 1h30m, 2d, 45s, or a number of seconds


# What YAML 1.2's core schema (Kubernetes' sigs.k8s.io/yaml) reads as a number, boolean or null
# but PyYAML's YAML 1.1 writes bare: `1e-4` would reach the API server as a float in `command`.
NOT_STR_12 = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|0o[0-7]+|0x[0-9a-fA-F]+|"
                        r"[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)|true|True|TRUE|false|False|FALSE|null|Null|NULL|~|")


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # each document whole, no &id001 anchors
        return True

    def represent_str(self, data: str) -> yaml.ScalarNode:
        style = "'" if NOT_STR_12.fullmatch(data) else None
        return self.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _Dumper.represent_str)


def dump(doc: dict) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def render(job: Job) -> str:
    assert job.kind is not None  # --scheduler kubernetes needs --kind (validate)
    docs = {"trainjob": trainjob, "pytorchjob": pytorchjob, "jobset": jobset, "indexed-job": indexed_job}[job.kind](job)
    head = "".join(f"# {line}".rstrip() + "\n" for line in [*job.header(), *notes(job), *_mount_notes(job)])
    return head + "---\n".join(dump(d) for d in docs)


# Where each kind says that one failed pod fails the whole job (the header's words).
FAILURE = {"trainjob": "the TrainingRuntime's JobSet has failurePolicy maxRestarts 0, its Job backoffLimit 0 and a podFailurePolicy",
           "pytorchjob": "the replicas' restartPolicy Never, and runPolicy cleanPodPolicy Running: once the job has ended, "
                         "its running pods are deleted and the failed ones kept for their logs",
           "jobset": "the JobSet has failurePolicy maxRestarts 0, its Job backoffLimit 0 and a podFailurePolicy",
           "indexed-job": "the Job has backoffLimit 0 and a podFailurePolicy"}


def _listed(values: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in values.items()) or "none"


def notes(job: Job) -> list[str]:
    """The header's lines on each pod's resources, the failure policy and the deadline, and, over
    a ClusterTrainingRuntime, what the TrainJob cannot set."""
    r = resources(job)
    shm = quantity(job.shm_mib)
    said = [f"Each pod: QoS class {job.qos.capitalize()}; requests {_listed(r['requests'])}; limits {_listed(r.get('limits', {}))}. "
            + (f"The memory holds /dev/shm ({shm}, memory-backed, so counted against it) and "
               f"{quantity(job.memory_mib - job.shm_mib)} of working memory."
               if job.memory_mib else f"The memory request is /dev/shm's {shm} alone (memory-backed, so counted against it): "
                                      "--memory-per-node sets /dev/shm plus the processes' working memory.")]
    if job.cluster_runtime:
        said.append(f"Trainer v2.1's TrainJob has no failure policy or deadline, nor do its podTemplateOverrides: the "
                    f"ClusterTrainingRuntime {job.cluster_runtime} decides them (its JobSet's failurePolicy, its Job's "
                    "backoffLimit, podFailurePolicy and activeDeadlineSeconds), and the pods' securityContext. "
                    "trainer.resourcesPerNode replaces the runtime container's resources"
                    + ("; podTemplateOverrides' imagePullSecrets are merged into the runtime's, by name" if job.image_pull_secret else "")
                    + (". QoS Guaranteed holds only where the runtime's other containers, if any, have limits equal to "
                       "their requests." if job.qos == "guaranteed" else "."))
    else:
        assert job.kind is not None  # --scheduler kubernetes needs --kind (validate)
        said.append("One failed or disrupted pod fails the whole job, with no retry (a static rendezvous cannot take a "
                    f"replacement pod): {FAILURE[job.kind]}. "
                    + (f"Deadline: activeDeadlineSeconds {job.deadline_s}." if job.deadline_s
                       else "No deadline (--deadline sets activeDeadlineSeconds)."))
    if job.preflight:
        said.append("Preflight (--preflight): each pod runs pytorch-cuda-preflight first, which checks the node's driver, "
                    "GPUs, /dev/shm and RDMA against the image's row, measures the fabric and names a slow node, then "
                    "execs the launch contract; a failure is the container's non-zero exit. Bound: every pod answers "
                    "within PYTORCH_CUDA_PREFLIGHT_JOIN_TIMEOUT (600 s), then the fabric within "
                    "PYTORCH_CUDA_PREFLIGHT_TIMEOUT (300 s) + 60 s; set either in the pods' env.")
    return [""] + [wrapped for line in said for wrapped in textwrap.wrap(line, 96)]



def _mount_notes(job: Job) -> list[str]:
    """The header's lines on --mount: each volume, the working directory, and what fsGroup does
    and does not do for the image's uid 1000."""
    if not job.mounts and not job.workdir:
        return []
    who = ("the installed ClusterTrainingRuntime's securityContext sets the pods' user and fsGroup"
           if job.cluster_runtime else f"the pods run as uid {UID}, gid {GID}, with fsGroup {GID}")
    lines = [""] + ([f"Code and data (--mount); {who}:"] if job.mounts else [])
    lines += [f"  {m.target}: {'PersistentVolumeClaim ' + m.source if m.pvc else 'hostPath ' + m.source + ' (type Directory)'}"
              f"{', read-only' if m.read_only else ''}" for m in job.mounts]
    notes = [f"The working directory is {workdir(job)}: relative paths in SCRIPT and ARGS are taken from there."]
    if any(m.pvc for m in job.mounts):
        notes.append("A PersistentVolumeClaim's files get fsGroup's group where its volume plugin supports it "
                     "(for a CSI driver its fsGroupPolicy decides; an NFS volume does not).")
    hosts = [m.source for m in job.mounts if not m.pvc]
    if hosts:
        notes.append(f"hostPath volumes ignore fsGroup: on every node, {', '.join(hosts)} must exist and be readable "
                     f"(and writable where outputs go) by uid {UID} or group {GID}"
                     + (", or by the runtime's user." if job.cluster_runtime else "."))
    return lines + [wrapped for note in notes for wrapped in textwrap.wrap(note, 96)]


def _meta(job: Job, name: str | None = None) -> dict:
    meta: dict = {"name": name or job.name}
    if job.namespace:
        meta["namespace"] = job.namespace
    meta["labels"] = {"app.kubernetes.io/name": "pytorch-cuda", "pytorch-cuda/image": job.row_name}
    return meta


def _env(values: dict[str, str]) -> list[dict]:
    return [{"name": k, "value": v} for k, v in values.items()]


def limits(job: Job) -> dict:
    """The device limits (GPUs, RDMA): a device resource's request is its limit."""
    out: dict = {}
    if job.gpus_per_node:
        out["nvidia.com/gpu"] = job.gpus_per_node
    out.update({resource: count for resource, count in job.rdma_counts})
    return out


def resources(job: Job) -> dict:
    """The container's requests and limits. Memory is always requested, at least /dev/shm's size:
    a memory-backed emptyDir counts against the container's memory, and a pod with no request
    would be BestEffort, the first evicted. Guaranteed limits cpu and memory to the requests."""
    requests: dict = {**({"cpu": job.cpus_per_node} if job.cpus_per_node else {}), "memory": quantity(job.memory_mib or job.shm_mib)}
    out: dict = {"requests": requests}
    lim = {**(requests if job.qos == "guaranteed" else {}), **limits(job)}
    if lim:
        out["limits"] = lim
    return out


def pull_secrets(job: Job) -> dict:
    return {"imagePullSecrets": [{"name": name} for name in job.image_pull_secret]} if job.image_pull_secret else {}


def shm_volume(job: Job) -> dict:
    return {"name": SHM, "emptyDir": {"medium": "Memory", "sizeLimit": quantity(job.shm_mib)}}


def workdir(job: Job) -> str | None:
    """--workdir, else the first mount's TARGET (the code); None: the image's."""
    return job.workdir or (job.mounts[0].target if job.mounts else None)


def volumes(job: Job) -> list[dict]:
    """/dev/shm, then one volume per --mount."""
    out = [shm_volume(job)]
    for i, m in enumerate(job.mounts):
        source = {"persistentVolumeClaim": {"claimName": m.source}} if m.pvc else {"hostPath": {"path": m.source, "type": "Directory"}}
        out.append({"name": f"mount-{i}", **source})
    return out


def volume_mounts(job: Job) -> list[dict]:
    out: list[dict] = [{"name": SHM, "mountPath": "/dev/shm"}]
    for i, m in enumerate(job.mounts):
        out.append({"name": f"mount-{i}", "mountPath": m.target, **({"readOnly": True} if m.read_only else {})})
    return out


def container(job: Job, name: str, env: dict[str, str], image: bool = True, ports: list | None = None) -> dict:
    c: dict = {"name": name}
    if image:
        c["image"] = str(job.ref)
        c["command"] = job.entry()
    if image and workdir(job):
        c["workingDir"] = workdir(job)
    if env:
        c["env"] = _env(env)
    if ports:
        c["ports"] = ports
    if image:
        c["resources"] = resources(job)
    caps: dict = {"drop": ["ALL"]}
    if job.rdma:  # RDMA registers (pins) memory; where the runtime grants it, IPC_LOCK lifts RLIMIT_MEMLOCK
        caps["add"] = ["IPC_LOCK"]
    c["securityContext"] = {"allowPrivilegeEscalation": False, "capabilities": caps}
    c["volumeMounts"] = volume_mounts(job)
    return c


def pod_spec(job: Job, c: dict, restart: bool = True, **extra: Any) -> dict:
    """restart False: the owner sets restartPolicy (a PyTorchJob's replica spec)."""
    return {**extra, **({"restartPolicy": "Never"} if restart else {}),
            "securityContext": {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": GID, "fsGroup": GID},
            **pull_secrets(job), "containers": [c], "volumes": volumes(job)}


def gang_job(job: Job, container_name: str) -> dict:
    """An Indexed Job's failure fields: no retry, a failed Job on a non-zero exit of the container or
    a disruption (eviction, preemption, node drain), and the deadline where one is given. Ignoring a
    disruption would only replace the pod, which cannot rejoin the survivors' rendezvous."""
    return {"backoffLimit": 0,
            "podFailurePolicy": {"rules": [
                {"action": "FailJob", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                {"action": "FailJob", "onExitCodes": {"containerName": container_name, "operator": "NotIn", "values": [0]}}]},
            **({"activeDeadlineSeconds": job.deadline_s} if job.deadline_s else {})}


NO_RESTART = {"failurePolicy": {"maxRestarts": 0}}  # a JobSet's: a failed Job fails the JobSet, never recreated


def _nproc(job: Job) -> int:
    return job.gpus_per_node or 1


def trainjob(job: Job) -> list[dict]:
    trainer = {"image": str(job.ref), "command": job.entry(), "numNodes": job.nodes,
               "numProcPerNode": _nproc(job)}
    env = {**job.nccl_env(), **({WORKDIR: wd} if job.cluster_runtime and (wd := workdir(job)) else {})}
    if env:
        trainer["env"] = _env(env)
    trainer["resourcesPerNode"] = resources(job)  # it replaces the runtime container's resources whole
    spec: dict = {"trainer": trainer}
    if job.cluster_runtime:
        spec = {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime", "name": job.cluster_runtime},
                **spec,
                "podTemplateOverrides": [{"targetJobs": [{"name": RJOB}],
                                          "spec": {**pull_secrets(job), "volumes": volumes(job),
                                                   "containers": [{"name": RJOB, "volumeMounts": volume_mounts(job)}]}}]}
        return [{"apiVersion": TRAINER, "kind": "TrainJob", "metadata": _meta(job), "spec": spec}]
    runtime = {"apiVersion": TRAINER, "kind": "TrainingRuntime", "metadata": {**_meta(job), "labels": {
        **_meta(job)["labels"], "trainer.kubeflow.org/framework": "torch"}},
        "spec": {"mlPolicy": {"numNodes": job.nodes, "torch": {"numProcPerNode": _nproc(job)}},
                 "template": {"spec": {**NO_RESTART, "replicatedJobs": [{
                     "name": RJOB, "replicas": 1,
                     "template": {"metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step": "trainer"}},
                                  "spec": {**gang_job(job, RJOB),
                                           "template": {"spec": pod_spec(job, container(job, RJOB, {}))}}}}]}}}}
    spec = {"runtimeRef": {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime", "name": job.name}, **spec}
    return [runtime, {"apiVersion": TRAINER, "kind": "TrainJob", "metadata": _meta(job), "spec": spec}]


def pytorchjob(job: Job) -> list[dict]:
    ports = [{"name": "pytorchjob-port", "containerPort": PORT}]  # the operator's MASTER_PORT
    replicas = {"Master": 1, **({"Worker": job.nodes - 1} if job.nodes > 1 else {})}
    specs = {role: {"replicas": n, "restartPolicy": "Never",
                    "template": {"spec": pod_spec(job, container(job, "pytorch", job.nccl_env(), ports=ports), restart=False)}}
             for role, n in replicas.items()}
    # restartPolicy Never already fails the job on one failed pod (v1.8/v1.9's UpdateJobStatus). cleanPodPolicy
    # Running: once it has ended, the pods still running (or pending) go and free their GPUs; the operator's
    # default, None, would leave them waiting on the lost rank. No backoffLimit: past it the operator deletes
    # every pod before it marks the job failed, the failed pod and its logs included (common/job.go).
    run_policy = {"cleanPodPolicy": "Running", **({"activeDeadlineSeconds": job.deadline_s} if job.deadline_s else {})}
    return [{"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": _meta(job),
             "spec": {"nprocPerNode": str(_nproc(job)), "runPolicy": run_policy, "pytorchReplicaSpecs": specs}}]


def _indexed(job: Job, master: str, subdomain: str | None = None) -> dict:
    """An Indexed Job's spec: N pods at once, none retried (a static rendezvous cannot take a
    replacement), the contract's own node count and master address."""
    env = {"PYTORCH_CUDA_NNODES": str(job.nodes), "PYTORCH_CUDA_MASTER_ADDR": master,
           "PYTORCH_CUDA_MASTER_PORT": str(PORT), **job.launch_env(), **job.nccl_env()}
    extra: dict = {"subdomain": subdomain} if subdomain else {}
    return {"completionMode": "Indexed", "completions": job.nodes, "parallelism": job.nodes, **gang_job(job, RJOB),
            "template": {"metadata": {"labels": _meta(job)["labels"]},
                         "spec": pod_spec(job, container(job, RJOB, env), **extra)}}


def jobset(job: Job) -> list[dict]:
    master = f"{job.name}-{RJOB}-0-0.{job.name}"
    return [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "metadata": _meta(job),
             "spec": {"network": {"enableDNSHostnames": True}, **NO_RESTART,
                      "replicatedJobs": [{"name": RJOB, "replicas": 1, "template": {"spec": _indexed(job, master)}}]}}]


def indexed_job(job: Job) -> list[dict]:
    service = {"apiVersion": "v1", "kind": "Service", "metadata": _meta(job),
               "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": {"job-name": job.name},
                        "ports": [{"name": "c10d", "port": PORT, "targetPort": PORT}]}}
    return [service, {"apiVersion": "batch/v1", "kind": "Job", "metadata": _meta(job),
                      "spec": _indexed(job, f"{job.name}-0.{job.name}", subdomain=job.name)}]
