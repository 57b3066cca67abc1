"""Check one matrix row on this machine from a gpu-bundle, with no Docker and no network.

    bash DIR/run.sh [--report DIR] [--arch X.Y] [--timeout S]
    (= python -m pytorch_cuda_runtime.gpucheck --bundle DIR ...)

The machine brings torch and a CUDA compiler; the bundle (`build.py gpu-bundle`) brings the
row's DeepSpeed sdist, the small wheels it needs, this package and the row's manifest. In
order, each step a check in the report:

  bundle.files       every file's sha256 equals bundle.json's (what travelled is what was locked)
  machine.*          Python is the bundle's, torch imports and is a CUDA build, nvcc is found
  ops.arch           the one arch the ops are compiled for: the visible GPU's, else one of
                     torch's (or $PYTORCH_CUDA_GPUCHECK_ARCH / --arch): a check pays one arch
  ops.prerequisites  DeepSpeed's own is_compatible() per op: a machine without, say, libaio's
                     headers cannot build async_io; that op is skipped with the reason
  install.*          the missing wheels (pip decides, --no-index) and then the DeepSpeed wheel
                     go into a directory of their own on PYTHONPATH: the machine's torch and
                     packages are never replaced
  ops.build          opsbuild.py builds the wheel with the ops, as an image's builder stage does
  smoke.*            the smoke suite, its GPU half when a GPU is visible
Then report.json and report.md: the GPU, driver, torch, CUDA and every check with its outcome.
A step that cannot run says why and is never reported as passed. Exit 1 if a check failed,
2 if the bundle or the arguments are unusable. Stopped (SIGTERM, SIGINT, SIGHUP: `timeout`, Ctrl-C),
it stops the running step (SIGTERM first, so the smoke suite writes its own report), records
`interrupted` with that step, writes the report of what finished and exits 128 + the signal.
Standard library only (torch in children).
"""
import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time

from . import banner, gpureport
from .interrupt import Interrupted, catching
from .smoke.results import FAIL, INFO, PASS, SKIP, record

ARCH_ENV = "PYTORCH_CUDA_GPUCHECK_ARCH"
BUNDLE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORCH_FACTS = ("import json, torch; c = torch.cuda.is_available(); n = torch.cuda.device_count() if c else 0; "
               "print(json.dumps({'torch': torch.__version__, 'torch_cuda': torch.version.cuda, 'gpus': n, "
               "'arch_flags': torch._C._cuda_getArchFlags().split() if torch.version.cuda else [], "
               "'devices': [{'name': torch.cuda.get_device_name(i), 'capability': '%d.%d' % "
               "torch.cuda.get_device_capability(i)} for i in range(n)]}))")
# Run inside the extracted sdist, as opsbuild.build_vars does: DeepSpeed's own verdict per op.
COMPATIBLE = ("import contextlib, io, json, sys; sys.path.insert(0, '.'); from op_builder.all_ops import ALL_OPS\n"
              "out = {}\n"
              "for op in sys.argv[1].split(','):\n"
              "    buf = io.StringIO()\n"
              "    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):\n"
              "        ok = op in ALL_OPS and bool(ALL_OPS[op].is_compatible(verbose=True))\n"
              "    out[op] = [ok, buf.getvalue() if op in ALL_OPS else 'DeepSpeed has no such op']\n"
              "print('COMPATIBLE ' + json.dumps(out))")


class Stop(Exception):
    """A step failed so that the ones after it cannot run; the reason goes into their records."""


class Check:
    """One run: the records, the facts for the report's header, and where things go."""

    def __init__(self, bundle, desc, report_dir, work, timeout):
        self.bundle, self.desc, self.report_dir, self.work, self.timeout = bundle, desc, report_dir, work, timeout
        self.site = os.path.join(work, "site")  # the bundle's packages: first on PYTHONPATH, nothing replaced
        self.logs = os.path.join(report_dir, "logs")
        self.records, self.facts = [], {"python": platform.python_version(), "platform": platform.platform()}
        self.current = None  # the step a child runs, for an interruption's record
        os.makedirs(self.logs, exist_ok=True)

    def add(self, check, status, expected=None, actual=None, detail=""):
        self.records.append(record(check, status, expected=expected, actual=actual, detail=detail))
        print(f"gpucheck: {check}: {status}{' - ' + str(actual) if actual is not None else ''}"
              f"{' (' + detail + ')' if detail else ''}", file=sys.stderr, flush=True)

    def env(self, **extra):
        path = os.pathsep.join([os.path.join(self.site, "bin"), os.environ.get("PATH", "")])
        e = dict(os.environ, PATH=path, PYTHONPATH=os.pathsep.join(filter(None, [self.site, BUNDLE, os.environ.get("PYTHONPATH")])))
        e.update({k: str(v) for k, v in extra.items()})
        return e

    def run(self, name, cmd, timeout=None, **extra):
        """A child with its output in logs/<name>.log; (returncode, log path, seconds)."""
        log = os.path.join(self.logs, name + ".log")
        self.current = name
        t0 = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env(**extra), cwd=self.work)
            try:
                rc = proc.wait(timeout=timeout or self.timeout)
            except subprocess.TimeoutExpired:
                stop(proc)
                rc = None
            except BaseException:  # interrupted: the child (the smoke suite) writes its own report first
                stop(proc)
                raise
        return rc, log, round(time.monotonic() - t0, 1)


def stop(proc, grace=60):
    """SIGTERM, then SIGKILL after grace seconds: a smoke suite stops its step and writes its report."""
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def tail(path, n=3):
    with open(path, errors="replace") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    return " | ".join(lines[-n:])


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_files(c):
    bad = [rel for rel, f in c.desc["files"].items()
           if not os.path.isfile(os.path.join(c.bundle, rel)) or sha256(os.path.join(c.bundle, rel)) != f["sha256"]]
    c.add("bundle.files", FAIL if bad else PASS, expected=f"{len(c.desc['files'])} files as bundle.json lists them",
          actual=f"{len(bad)} missing or changed: {', '.join(bad[:5])}" if bad else f"{len(c.desc['files'])} files verified")
    if bad:
        raise Stop("the bundle's files do not match bundle.json")


def check_python(c):
    want, have = c.desc["python"], ".".join(platform.python_version_tuple()[:2])
    c.add("machine.python", PASS if want == have else FAIL, expected=want, actual=have,
          detail="" if want == have else f"the wheels are for Python {want}: `bash run.sh --python PATH` names another "
                                         f"interpreter, or `build.py gpu-bundle --python {have}` makes a bundle for this one")
    if want != have:
        raise Stop(f"Python {have} cannot install wheels made for {want}")


def probe_torch(c):
    rc, log, _ = c.run("torch", [sys.executable, "-c", TORCH_FACTS], timeout=300)
    lines = [ln for ln in open(log, errors="replace") if ln.startswith("{")]
    if rc != 0 or not lines:
        c.add("machine.torch", FAIL, expected="torch imports", actual=tail(log))
        raise Stop("torch does not import")
    facts = json.loads(lines[-1])
    c.facts.update(facts)
    ok = facts["torch_cuda"] is not None
    c.add("machine.torch", PASS if ok else FAIL, expected=f"a CUDA build of torch {c.desc['torch']}",
          actual=f"torch {facts['torch']}, CUDA {facts['torch_cuda']}", detail="" if ok else "DeepSpeed's cuda ops need a CUDA torch")
    if not ok:
        raise Stop("this torch is no CUDA build")


def find_cuda_home():
    """CUDA_HOME, else the toolkit of the nvcc on PATH, else /usr/local/cuda: torch's own order."""
    nvcc = shutil.which("nvcc")
    for home in (os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None,
                 "/usr/local/cuda"):
        if home and os.access(os.path.join(home, "bin", "nvcc"), os.X_OK):
            return home
    return None


def check_nvcc(c):
    home = find_cuda_home()
    out = subprocess.run([os.path.join(home, "bin", "nvcc"), "--version"], capture_output=True, text=True).stdout if home else ""
    version = (re.findall(r"V(\d+\.\d+\.\d+)", out) or [None])[-1]
    c.facts.update(cuda_home=home, nvcc=version)
    c.add("machine.nvcc", PASS if version else FAIL, expected=f"a CUDA compiler (the row's: {c.desc['cuda_toolkit']})",
          actual=f"nvcc {version} in {home}" if version else "no nvcc in $CUDA_HOME, on PATH or in /usr/local/cuda")
    if not version:
        raise Stop("no CUDA compiler")
    return home, version


def choose_arch(facts, nvcc_home, override):
    """(arch, why): the GPU's own capability is what is checked; without a GPU one arch of torch's
    list that nvcc compiles (the newest), so a CI machine pays one arch, not all."""
    if override:
        return override, f"given ({'--arch' if override != os.environ.get(ARCH_ENV) else ARCH_ENV})"
    if facts.get("devices"):
        d = facts["devices"][0]
        return d["capability"], f"GPU 0's compute capability ({d['name']})"
    out = subprocess.run([os.path.join(nvcc_home, "bin", "nvcc"), "--list-gpu-code"], capture_output=True, text=True).stdout
    nvcc = {int(m) for m in re.findall(r"sm_(\d+)\b", out)}
    both = sorted({int(a[3:]) for a in facts.get("arch_flags", []) if re.fullmatch(r"sm_\d+", a)} & nvcc)
    if not both:
        raise Stop(f"nvcc compiles none of torch's archs {facts.get('arch_flags')}")
    return f"{both[-1] // 10}.{both[-1] % 10}", f"no GPU visible: the newest of torch's archs that nvcc compiles; {ARCH_ENV} picks another"


def extract(sdist, dest):
    with tarfile.open(sdist) as t:
        t.extractall(dest, filter="data") if hasattr(tarfile, "data_filter") else t.extractall(dest)
    return os.path.join(dest, os.listdir(dest)[0])


def compatible_ops(c, sdist, cuda_home):
    """The row's ops that DeepSpeed says this machine can build; the others as SKIPPED, with why."""
    src = extract(sdist, os.path.join(c.work, "src"))
    log = os.path.join(c.logs, "ops-prerequisites.log")
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-c", COMPATIBLE, ",".join(c.desc["prebuilt_ops"])], cwd=src, stdout=subprocess.PIPE,
                              stderr=f, text=True, env=c.env(DS_ACCELERATOR="cuda", CUDA_HOME=cuda_home), timeout=600)
        f.write(proc.stdout)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("COMPATIBLE ")]
    if proc.returncode != 0 or not found:
        c.add("ops.prerequisites", FAIL, actual=tail(log), detail=f"log {log}")
        raise Stop("DeepSpeed's op builders did not run")
    ops = []
    for op, (ok, said) in json.loads(found[-1][len("COMPATIBLE "):]).items():
        said = re.sub(r"\x1b\[[0-9;]*m", "", said)  # DeepSpeed colours its warnings
        why = " ".join(ln.strip() for ln in said.splitlines() if "WARNING" in ln or "not" in ln.lower())[:300]
        c.add(f"ops.prerequisites.{op}", PASS if ok else SKIP, actual="buildable here" if ok else None,
              detail="" if ok else f"not built: this machine lacks what DeepSpeed needs for it: {why or said.strip()[:300]}")
        ops += [op] if ok else []
    return ops


def pip(c, name, *args, timeout=900):
    """pip with nothing from the machine's configuration (--isolated) and no index."""
    return c.run(name, [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args], timeout=timeout)


def missing(c, name, requirements):
    """What pip would install for requirements, given what this machine (and site) already has."""
    report = os.path.join(c.work, f"{name}.json")
    rc, log, _ = pip(c, name, "install", "--dry-run", "--quiet", "--no-index", "--find-links", os.path.join(c.bundle, "wheels"),
                     "--report", report, *requirements)
    if rc != 0:
        return None, log
    with open(report) as f:
        return [(i["metadata"]["name"], i["metadata"]["version"], i["download_info"]["url"].removeprefix("file://"))
                for i in json.load(f)["install"]], log


def install(c, check, files):
    rc, log, _ = pip(c, check, "install", "--quiet", "--no-deps", "--no-index", "--no-compile", "--target", c.site, *files)
    return rc == 0, log


def install_dependencies(c):
    """Only what the machine lacks: its own numpy, pydantic... stay, the bundle fills the gaps."""
    todo, log = missing(c, "install.dependencies", sorted(c.desc["wheels"]))
    ok, log = install(c, "install.dependencies", [f for _, _, f in todo]) if todo else (todo is not None, log)
    c.add("install.dependencies", PASS if ok else FAIL, expected=f"{len(c.desc['wheels'])} requirements met, --no-index",
          actual=(f"installed {len(todo)} ({', '.join(f'{n} {v}' for n, v, _ in todo)}); the machine had the rest" if todo
                  else "the machine had every one") if ok else tail(log), detail="" if ok else f"log {log}")
    if not ok:
        raise Stop("the bundle's wheels did not install")


def build_ops(c, sdist, ops, arch, cuda_home, nvcc_version):
    dist = os.path.join(c.work, "dist")
    rc, log, seconds = c.run("ops-build", [sys.executable, "-m", "pytorch_cuda_runtime.opsbuild", sdist, "--ops", ",".join(ops),
                                           "--cpu-arch", c.desc["cpu_arch"], "--dist", dist, "--toolkit", nvcc_version,
                                           "--arch-list", arch], timeout=max(c.timeout, 3600), CUDA_HOME=cuda_home)
    wheels = [w for w in os.listdir(dist) if w.endswith(".whl")] if os.path.isdir(dist) else []
    ok = rc == 0 and len(wheels) == 1
    c.add("ops.build", PASS if ok else FAIL, expected=f"DeepSpeed {c.desc['deepspeed']} wheel with {', '.join(ops)} for {arch}",
          actual=f"{wheels[0]} in {seconds:g} s" if ok else ("timed out" if rc is None else tail(log)), detail=f"log {log}")
    if not ok:
        raise Stop("the DeepSpeed wheel was not built")
    return os.path.join(dist, wheels[0]), os.path.join(dist, "ops-facts.json")


def install_deepspeed(c, wheel):
    """Its requirements must all be met already (the step before): anything else pip wants is a gap."""
    todo, log = missing(c, "install.deepspeed-plan", [wheel])
    extra = [f"{n} {v}" for n, v, _ in todo or [] if n.lower() != "deepspeed"]
    ok, log = install(c, "install.deepspeed", [wheel]) if todo is not None and not extra else (False, log)
    c.add("install.deepspeed", PASS if ok else FAIL, expected="the built wheel installs beside the machine's torch",
          actual=f"{os.path.basename(wheel)} into {c.site}" if ok else (f"also needs {', '.join(extra)}" if extra else tail(log)))
    if not ok:
        raise Stop("DeepSpeed did not install")


def effective_manifest(c, built_ops, ops_facts):
    """The row's manifest as this check must read it: the Python the bundle was made for, the ops
    built here; beside it the ops' facts and torch's arch list, as an image keeps them."""
    folder = os.path.join(c.work, "manifest")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(c.bundle, "manifest.json")) as f:
        manifest = json.load(f)
    manifest.update(python=c.desc["python"], prebuilt_ops=built_ops)
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2)
    with open(os.path.join(folder, "torch-facts.json"), "w") as f:  # measured from this machine's torch
        json.dump({"cuda_arch_list": c.facts.get("arch_flags", [])}, f)
    if ops_facts:
        shutil.copy(ops_facts, os.path.join(folder, "ops-facts.json"))
    return os.path.join(folder, "manifest.json")


def loopback_env(c):
    """torchrun hands its ranks the machine's hostname to meet at; on a machine without network
    that name may not resolve (seen: `docker run --network none`), and the ranks then wait out
    their timeout. One machine's ranks can always meet on 127.0.0.1: --local-addr (PET_LOCAL_ADDR)
    for torchrun, the loopback interface for gloo."""
    try:
        socket.gethostbyname(socket.gethostname())
        return {}
    except OSError:
        c.add("machine.hostname", INFO, actual=f"{socket.gethostname()} does not resolve",
              detail="the smoke suite's ranks meet on 127.0.0.1 (PET_LOCAL_ADDR, GLOO_SOCKET_IFNAME=lo)")
        return {"PET_LOCAL_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}


def run_smoke(c, manifest, with_deepspeed, reason):
    """The smoke suite as the image gate runs it; its records join ours as smoke.<check>."""
    report = os.path.join(c.report_dir, "smoke", "report.json")
    cmd = [sys.executable, "-m", "pytorch_cuda_runtime.smoke", "--report", report, "--manifest", manifest, "--timeout", "600"]
    if not with_deepspeed:  # torch's own families still say something about this machine
        cmd += ["--only", "gpu,collectives,ddp,fsdp2,bf16,compile"]
        c.add("smoke.deepspeed", SKIP, detail=f"not run: versions, ZeRO and the ops' load test need DeepSpeed ({reason})")
    with contextlib.suppress(FileNotFoundError):
        os.remove(report)  # a previous run's report in the same directory must not pass for this one's
    try:
        rc, log, seconds = c.run("smoke", cmd, timeout=4 * 3600, PYTORCH_CUDA_MANIFEST=manifest, **loopback_env(c))
    except Interrupted:
        merge_smoke(c, report)  # the suite wrote what it finished before it stopped
        raise
    smoke = merge_smoke(c, report)
    if smoke is None:
        c.add("smoke.report", FAIL, expected="the smoke suite's report", actual=f"none (exit {rc})", detail=tail(log))
        return 0
    print(f"gpucheck: smoke suite: {smoke['summary']} in {seconds:g} s", file=sys.stderr, flush=True)
    return int(smoke.get("gpus") or 0)


def merge_smoke(c, report):
    """The smoke suite's records join ours as smoke.<check>; None when it wrote no report."""
    if not os.path.exists(report):
        return None
    with open(report) as f:
        smoke = json.load(f)
    for r in smoke["results"]:
        c.records.append(dict(r, check=f"smoke.{r['check']}"))
    return smoke


def gpu_half(c, gpus):
    smi = c.facts.get("nvidia_smi") or []
    if gpus:
        c.add("gpu", INFO, actual=f"the GPU half ran on {gpus} GPU(s): {', '.join(d['name'] for d in c.facts['devices'])}")
    else:
        c.add("gpu", SKIP, detail="GPU half not run: no CUDA device visible"
              + (f" to torch (nvidia-smi lists {len(smi)})" if smi else " (torch sees none; nvidia-smi lists none)"))


def steps(c, arch_override):
    """Every step in order; a Stop leaves the reason for what could not run."""
    ops, reason = [], None
    try:
        verify_files(c)
        check_python(c)
        probe_torch(c)
        cuda_home, nvcc_version = check_nvcc(c)
        arch, why = choose_arch(c.facts, cuda_home, arch_override)
        c.facts["ops_arch"] = arch
        c.add("ops.arch", INFO, actual=arch, detail=why)
        install_dependencies(c)
        sdist = os.path.join(c.bundle, c.desc["sdist"])
        ops = compatible_ops(c, sdist, cuda_home)
        if not ops:
            raise Stop("this machine can build none of the row's ops")
        wheel, ops_facts = build_ops(c, sdist, ops, arch, cuda_home, nvcc_version)
        install_deepspeed(c, wheel)
    except Stop as e:
        reason, ops_facts = str(e), None
        c.add("not_run", SKIP, detail=f"the steps after this point did not run: {reason}")
        if not any(r["check"] == "machine.torch" and r["status"] == PASS for r in c.records):
            return  # without torch there is nothing the smoke suite could show
    gpu_half(c, run_smoke(c, effective_manifest(c, ops if reason is None else [], ops_facts), reason is None, reason))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="gpucheck", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=BUNDLE, help="the bundle (default: the one this package came in)")
    p.add_argument("--report", help="directory for report.json, report.md and logs/ (default: BUNDLE/report)")
    p.add_argument("--arch", default=os.environ.get(ARCH_ENV), help=f"compile the ops for this arch, e.g. 9.0 (default: "
                   f"the GPU's; without one the newest of torch's; also ${ARCH_ENV})")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for one step (default 3600)")
    a = p.parse_args(argv)
    if a.arch and not re.fullmatch(r"\d+\.\d+a?", a.arch):
        p.exit(2, f"gpucheck: error: --arch {a.arch!r}: expected e.g. 9.0\n")
    return a


def main(argv=None):
    a = parse_args(argv)
    try:
        with open(os.path.join(a.bundle, "bundle.json")) as f:
            desc = json.load(f)
        report_dir = os.path.abspath(a.report or os.path.join(a.bundle, "report"))
        os.makedirs(report_dir, exist_ok=True)
        if not os.access(report_dir, os.W_OK):
            raise OSError(f"{report_dir} is not writable (name another with --report)")
    except (OSError, ValueError) as e:
        print(f"gpucheck: error: {e}", file=sys.stderr)
        return 2
    work = tempfile.mkdtemp(prefix="pytorch-cuda-gpucheck-")
    c = Check(os.path.abspath(a.bundle), desc, report_dir, work, a.timeout)
    c.facts["nvidia_smi"] = [{"name": n, "driver": d, "capability": cap} for n, d, cap in banner.query_gpus() or []]
    t0 = time.monotonic()
    stopped = None
    try:
        with catching():
            try:
                steps(c, a.arch)
            except Interrupted as e:  # what finished still makes a report
                stopped = e
                c.add("interrupted", FAIL, expected="every step run", actual=f"{e} during {c.current}",
                      detail="the steps after it did not run")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    paths = gpureport.write(report_dir, desc, c.facts, c.records, round(time.monotonic() - t0, 1))
    failed = sum(r["status"] == FAIL for r in c.records)
    print(f"gpucheck: {len(c.records)} checks, {failed} failed; {paths[0]} and {paths[1]}", file=sys.stderr)
    return stopped.exit_code if stopped else (1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
