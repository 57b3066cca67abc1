"""gpucheck's catalogue of steps: the bundle's files, the machine's Python and torch, the install
of the bundle's wheels beside the machine's own, the preflight's GPU checks and the smoke suite's
GPU families, in the order `plan` lists them. Each step is a function (check, step) that records
what it found and raises Stop where the steps after it cannot run. The runner is gpurunner.py."""

import hashlib
import json
import os
import platform
import shutil
import sys
from types import SimpleNamespace
from typing import Any

from . import manifest as mf
from .gpurunner import Check, Step, Stop, skip_reason, tail
from .preflight import compute, health
from .smoke import cli as smoke
from .smoke import nocompile, versions
from .smoke.results import FAIL, INFO, PASS, SKIP, Record, record

TORCH_FACTS = ("import json, torch; c = torch.cuda.is_available(); n = torch.cuda.device_count() if c else 0; "
               "print(json.dumps({'torch': torch.__version__, 'torch_cuda': torch.version.cuda, 'gpus': n, "
               "'arch_flags': torch._C._cuda_getArchFlags().split() if torch.version.cuda else [], "
               "'devices': [{'name': torch.cuda.get_device_name(i), 'capability': '%d.%d' % "
               "torch.cuda.get_device_capability(i)} for i in range(n)]}))")


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ---- the machine and the install

def verify_files(c: Check, step: Step) -> None:
    bad = [rel for rel, f in c.desc["files"].items()
           if not os.path.isfile(os.path.join(c.bundle, rel)) or sha256(os.path.join(c.bundle, rel)) != f["sha256"]]
    c.add("bundle.files", FAIL if bad else PASS, expected=f"{len(c.desc['files'])} files as bundle.json lists them",
          actual=f"{len(bad)} missing or changed: {', '.join(bad[:5])}" if bad else f"{len(c.desc['files'])} files verified")
    if bad:
        raise Stop("the bundle's files do not match bundle.json")


def check_python(c: Check, step: Step) -> None:
    want, have = c.desc["python"], ".".join(platform.python_version_tuple()[:2])
    c.add("machine.python", PASS if want == have else FAIL, expected=want, actual=have,
          detail="" if want == have else f"the wheels are for Python {want}: `bash run.sh --python PATH` names another "
                                         f"interpreter, or `build.py gpu-bundle --python {have}` makes a bundle for this one")
    if want != have:
        raise Stop(f"Python {have} cannot install wheels made for {want}")


def release(version: str) -> str:
    return version.split("+")[0]


def probe_torch(c: Check, step: Step) -> None:
    rc, log = c.run("torch", [sys.executable, "-c", TORCH_FACTS], step.bound)
    with open(log, errors="replace") as f:
        lines = [ln for ln in f if ln.startswith("{")]
    if rc != 0 or not lines:
        c.add("machine.torch", FAIL, expected="torch imports", actual=tail(log))
        raise Stop("torch does not import")
    facts = json.loads(lines[-1])
    c.facts.update(facts)
    c.gpus = int(facts["gpus"])
    built_for = c.desc["ops_wheel"]["torch"]  # the row's torch, or its MAJOR.MINOR as a given wheel records it
    have = release(facts["torch"])
    if have != built_for and not have.startswith(built_for + "."):
        c.add("machine.torch", FAIL, expected=f"torch {built_for}, the one the ops were built against",
              actual=f"torch {facts['torch']}", detail="the prebuilt ops would not load: make the bundle for this torch")
        raise Stop("the machine's torch is not the one the wheel was built against")
    if facts["torch_cuda"] is None and not c.rehearse:
        c.add("machine.torch", FAIL, expected="a CUDA build of torch", actual=f"torch {facts['torch']}, a CPU build")
        raise Stop("this torch is no CUDA build")
    c.add("machine.torch", PASS, expected=f"torch {built_for}", actual=f"torch {facts['torch']}, CUDA {facts['torch_cuda']}, "
          f"{c.gpus} GPU(s) visible", detail="a CPU build: the rehearsal loads no CUDA op" if facts["torch_cuda"] is None else "")
    if not c.gpus and not c.rehearse:
        c.add("machine.gpu", FAIL, expected="a CUDA device", actual="none visible to torch",
              detail="`bash run.sh --rehearse` runs the steps that need no GPU")


def pip(c: Check, name: str, args: list[str], timeout: float) -> tuple[int | None, str]:
    """pip with nothing from the machine's configuration (--isolated) and no index."""
    return c.run(name, [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args], timeout)


def missing(c: Check, name: str, requirements: list[str], timeout: float) -> tuple[list[tuple[str, str, str]] | None, str]:
    """What pip would install for requirements, given what this machine (and site) already has."""
    report = os.path.join(c.work, f"{name}.json")
    rc, log = pip(c, name, ["install", "--dry-run", "--quiet", "--no-index", "--find-links",
                            os.path.join(c.bundle, "wheels"), "--report", report, *requirements], timeout)
    if rc != 0:
        return None, log
    with open(report) as f:
        return [(i["metadata"]["name"], i["metadata"]["version"], i["download_info"]["url"].removeprefix("file://"))
                for i in json.load(f)["install"]], log


def install(c: Check, name: str, files: list[str], timeout: float) -> tuple[bool, str]:
    rc, log = pip(c, name, ["install", "--quiet", "--no-deps", "--no-index", "--no-compile", "--target", c.site, *files],
                  timeout)
    return rc == 0, log


def install_dependencies(c: Check, step: Step) -> None:
    """Only what the machine lacks: its own numpy, pydantic... stay, the bundle fills the gaps."""
    todo, log = missing(c, "install.dependencies", sorted(c.desc["wheels"]), step.bound)
    ok, log = install(c, "install.dependencies", [f for _, _, f in todo], step.bound) if todo else (todo is not None, log)
    c.add("install.dependencies", PASS if ok else FAIL, expected=f"{len(c.desc['wheels'])} requirements met, --no-index",
          actual=(f"installed {len(todo)} ({', '.join(f'{n} {v}' for n, v, _ in todo)}); the machine had the rest" if todo
                  else "the machine had every one") if ok else tail(log), detail="" if ok else f"log {log}")
    if not ok:
        raise Stop("the bundle's wheels did not install")


def install_deepspeed(c: Check, step: Step) -> None:
    """The prebuilt wheel, nothing compiled: its requirements are met already (the step before)."""
    wheel = os.path.join(c.bundle, c.desc["ops_wheel"]["file"])
    todo, log = missing(c, "install.deepspeed-plan", [wheel], step.bound)
    extra = [f"{n} {v}" for n, v, _ in todo or [] if n.lower() != "deepspeed"]
    ok, log = install(c, "install.deepspeed", [wheel], step.bound) if todo is not None and not extra else (False, log)
    c.add("install.deepspeed", PASS if ok else FAIL, expected="the prebuilt wheel installs beside the machine's torch",
          actual=f"{os.path.basename(wheel)} ({', '.join(c.desc['ops_wheel']['ops'])} prebuilt for "
                 f"{c.desc['ops_wheel']['arch_list']})" if ok else (f"also needs {', '.join(extra)}" if extra else tail(log)))
    if not ok:
        raise Stop("DeepSpeed did not install")
    os.environ.update({k: c.env()[k] for k in ("PATH", "PYTHONPATH", "LD_LIBRARY_PATH")})  # the smoke suite's children
    start_suite(c)


# ---- the smoke suite's GPU-only mode, one family a step

def effective_manifest(c: Check) -> tuple[dict[str, Any], str]:
    """The row's manifest as this check reads it: the bundle's Python, the wheel's ops and arch list."""
    with open(os.path.join(c.bundle, "manifest.json")) as f:
        manifest = json.load(f)
    wheel = c.desc["ops_wheel"]
    manifest.update(python=c.desc["python"], prebuilt_ops=wheel["ops"], ops_accelerator="cuda")
    path = os.path.join(c.work, "manifest", "manifest.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(manifest, f, indent=2)
    # Beside it, as an image keeps them: torch's arch list (measured from this machine's torch, which
    # machine.torch found to be the row's) and the ops' build facts, when the bundle has them.
    with open(os.path.join(os.path.dirname(path), "torch-facts.json"), "w") as f:
        json.dump({"cuda_arch_list": c.facts.get("arch_flags", [])}, f)
    facts = os.path.join(c.bundle, os.path.dirname(wheel["file"]), "ops-facts.json")
    if os.path.isfile(facts):
        shutil.copy(facts, os.path.join(os.path.dirname(path), "ops-facts.json"))
    return mf.load(path), path


def start_suite(c: Check) -> None:
    c.manifest, path = effective_manifest(c)
    args = SimpleNamespace(report=os.path.join(c.report_dir, "smoke", "report.json"), manifest=path, timeout=60,
                           ranks=1, require_gpu=not c.rehearse, cpu=False, gpu_only=True, only=list(smoke.FAMILIES))
    c.suite = smoke.Suite(args)


def smoke_versions(c: Check, step: Step) -> list[Record]:
    facts = c.suite.probe("host")
    c.facts.update({k: facts.get(k) for k in ("cudnn", "nccl", "deepspeed", "ds_build_accelerator")})
    recs = versions.check(c.manifest, facts)
    if c.rehearse:  # the manifest is the row's; a rehearsal's torch build may be a CPU one
        recs = [dict(r, status=INFO, detail="rehearsal: recorded, not compared") if r["check"] in
                ("versions.torch_cuda", "versions.cudnn", "versions.nccl", "versions.cuda_arch_list") else r for r in recs]
    families = [(s.family, "cuda", c.gpus) for s in c.steps if s.family and not skip_reason(c, s)]
    return recs + smoke.world_of_one(c.gpus, families)


def smoke_gpu(c: Check, step: Step) -> list[Record]:
    return smoke.run_gpu_basics(c.suite, c.gpus, "no CUDA device visible")


def smoke_ops(c: Check, step: Step) -> list[Record]:
    if c.facts.get("torch_cuda") is None:
        return [record("nocompile.ops", SKIP, detail="the wheel's ops are built for cuda and link torch's CUDA "
                                                     "libraries; this torch is a CPU build")]
    return nocompile.run_ops(c.suite, c.manifest)


def smoke_family(c: Check, step: Step) -> list[Record]:
    return smoke.run_family(c.suite, step.family, "cuda", 1 if step.family in smoke.GPU_ONLY else c.gpus)


def smoke_extras(c: Check, step: Step) -> list[Record]:
    return smoke.run_extras(c.suite, c.manifest, c.gpus)


def smoke_nocompile(c: Check, step: Step) -> list[Record]:
    return [nocompile.empty_check("nocompile.torch_extensions_training", f"cuda x{c.gpus}", c.suite.ext["cuda"],
                                  "GPU families")]


# ---- the preflight's GPU checks (preflight/health.py, preflight/compute.py), the machine as a job of one node

def preflight_health(c: Check, step: Step) -> None:
    """NVML's faults of each GPU, each a FAIL naming the GPU by index and serial."""
    out = os.path.join(c.report_dir, "preflight-health.json")
    rc, log = c.run("preflight.health", [sys.executable, "-m", "pytorch_cuda_runtime.preflight.health", "--out", out],
                    step.bound)
    if rc is None or not os.path.isfile(out):
        c.add("preflight.health", FAIL, expected="every GPU's health read", actual=tail(log),
              detail="did not end within its bound" if rc is None else f"exit {rc}")
        return
    with open(out) as f:
        record = json.load(f)
    for g in record["gpus"]:
        lines = [health.Finding(**f).line() for f in g["findings"]]
        c.add(f"preflight.health.gpu{g['index']}", FAIL if lines else PASS, expected="no fault NVML reports",
              actual="; ".join(lines) or f"{g['name']}, serial {g.get('serial')}: no fault",
              detail="; ".join([f"read through {record['source']}", *g["notes"],
                                *(f"{k} not read: {v}" for k, v in g["unread"].items())]))


def preflight_compute(c: Check, step: Step) -> None:
    """The bf16 matmul on each GPU: TFLOP/s against the product's peak and the others, the checksum, PCIe."""
    out, node = os.path.join(c.report_dir, "preflight-compute.json"), platform.node().split(".")[0]
    bound = min(step.bound, compute.GPU_TIMEOUT_S)
    rc, log = c.run("preflight.compute", [sys.executable, "-m", "pytorch_cuda_runtime.preflight.compute", "--node", node,
                                          "--out", out], bound)
    if rc is None or not os.path.isfile(out):
        c.add("preflight.compute", FAIL, expected=f"the bf16 matmul on every GPU within {bound:g} s", actual=tail(log),
              detail="did not end within its bound" if rc is None else f"exit {rc}")
        return
    with open(out) as f:
        figures = json.load(f)
    found, rows = compute.judge({node: figures})
    for r in rows:
        peak = (f"{r['x_peak']:.2f} x the dense bf16 peak {r['peak']}" if r.get("x_peak") is not None
                else f"peak: {r['peak']}")
        c.add(f"preflight.compute.gpu{r['gpu']}", INFO, actual=f"{r['tflops']:.1f} TFLOP/s",
              detail=f"{r['name']}, serial {r.get('serial')}: {figures['size']}x{figures['size']} bf16, seed "
                     f"{figures['seed']}; {peak}; checksum {r['checksum']}")
    for finding in [*compute.local(figures), *(f for _, f in found)]:
        c.add(f"preflight.{finding.check}", FAIL, expected=health.CHECKS[finding.check], actual=finding.line())
    if not found and not compute.local(figures) and figures.get("gpus"):
        c.add("preflight.compute", PASS, expected="each GPU within its thresholds, one checksum",
              actual=f"{len(figures['gpus'])} GPU(s)")


def plan(gpus: int) -> list[Step]:
    """Every step in order; a world of one still runs the sharding families (one rank)."""
    steps = [Step("bundle.files", verify_files), Step("machine.python", check_python), Step("machine.torch", probe_torch),
             Step("install.dependencies", install_dependencies), Step("install.deepspeed", install_deepspeed),
             Step("smoke.versions", smoke_versions), Step("smoke.gpu", smoke_gpu, needs_gpu=True),
             Step("smoke.ops", smoke_ops), Step("preflight.health", preflight_health, needs_gpu=True),
             Step("preflight.compute", preflight_compute, needs_gpu=True)]
    for family, _, _ in smoke.plan(smoke.MULTI + smoke.SINGLE, max(gpus, 1), 1, gpu_only=True):
        steps.append(Step(f"smoke.{family}", smoke_family, needs_gpu=True, family=family))
    steps += [Step("smoke.extras", smoke_extras), Step("smoke.measure", smoke_family, needs_gpu=True, family="measure"),
              Step("smoke.nocompile", smoke_nocompile, needs_gpu=True)]
    return steps


