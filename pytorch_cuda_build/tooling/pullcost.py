"""`bench --full --only pull`: what a node pulls and a registry stores, with the wheels in one
layer (the layout before layers.py) and laid out by the matrix's rule, measured in one run.

Both layouts are built here from copies of the project (files.copy_project), each rendered with
its layout, the CUDA 13 rows and a one-package refresh of the first of them, then pushed to a
registry of their own on 127.0.0.1 (Debian's docker-registry). The figures come from the
registry's manifests, the way containerd fetches: a node pulls the blobs of the new image that
it does not hold. Then each layout's image is pulled, gzip and zstd (recompressed by skopeo),
into an empty current engine (engine_current's probe store), and timed. Measures, never asserts.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

import docker
from packaging.utils import parse_wheel_filename
from packaging.version import Version

from .. import files, progress
from ..engine import docker_env
from ..errors import BadFile, BadValue, EnvironmentProblem, NoSuchRow
from ..matrix import Image, Matrix
from ..resolve import wheel_files
from ..stages import build, lock
from . import engine_current

REFRESHED = "certifi"  # the one package a refresh moves: no dependencies, and every TLS client's
ACCEPT = ", ".join(["application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json"])
LAYOUTS = ("one layer", "layered")  # before layers.py, and the matrix's rule


def rows(m: Matrix, first: int | None = None) -> list[Image]:
    """The CUDA 13 rows (runtime flavor, linux/amd64), oldest torch first: neighbours follow each
    other. first (--pull-rows): only the first that many, for a run that must fit a few hours."""
    found = sorted((i for i in m.images if i.cuda_major == "13" and i.flavor == "runtime"), key=lambda i: Version(i.torch))
    if first is not None and not 2 <= first <= len(found):
        raise BadValue(f"--pull-rows takes 2 to {len(found)} (the matrix's CUDA 13 rows), not {first}", name="--pull-rows")
    return found[:first]


def pulled(held: dict, new: dict) -> int:
    """Bytes a node that holds `held` fetches for `new`: the blobs of new it lacks (manifests as
    read from the registry: {"config": (digest, size), "layers": [(digest, size), ...]})."""
    have = {d for d, _ in held["layers"]} | {held["config"][0]}
    return sum(s for d, s in new["layers"] if d not in have) + (new["config"][1] if new["config"][0] not in have else 0)


def total(m: dict) -> int:
    return sum(s for _, s in m["layers"]) + m["config"][1]


def stored(manifests: list[dict]) -> int:
    """What a registry keeps for these images: each distinct blob once."""
    blobs = {d: s for m in manifests for d, s in [*m["layers"], m["config"]]}
    return sum(blobs.values())


def figures(by_layout: dict[str, dict[str, dict]], row_names: list[str], refreshed: str) -> dict:
    """The four figures per layout from the manifests: by_layout[layout][tag]."""
    out = {}
    for layout, ms in by_layout.items():
        first = row_names[0]
        pairs = [{"held": a, "next": b, "pulled": pulled(ms[a], ms[b]), "image": total(ms[b])} for a, b in zip(row_names, row_names[1:])]
        out[layout] = {
            "refresh": {"row": first, "package": refreshed, "pulled": pulled(ms[first], ms[f"{first}-refresh"]),
                        "image": total(ms[f"{first}-refresh"])},
            "neighbours": pairs,
            "registry": {"stored": stored([ms[n] for n in row_names]), "sum_of_images": sum(total(ms[n]) for n in row_names),
                         "rows": row_names},
            "layers": {n: len(ms[n]["layers"]) for n in row_names},
        }
    return out


# ---- a registry of the benchmark's own on 127.0.0.1 -------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Registry:
    """Debian's docker-registry on 127.0.0.1, storage in a directory of the benchmark's."""

    def __init__(self, workdir: Path):
        binary = shutil.which("docker-registry")
        if not binary:
            raise EnvironmentProblem("the pull measure needs a registry on 127.0.0.1: apt-get install docker-registry")
        self.dir, self.binary, self.host = workdir, binary, f"127.0.0.1:{_free_port()}"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "Registry":
        (self.dir / "storage").mkdir(parents=True, exist_ok=True)
        config = self.dir / "config.yml"
        config.write_text(f"version: 0.1\nlog: {{level: warn}}\nstorage:\n  filesystem: {{rootdirectory: {self.dir / 'storage'}}}\n"
                          f"http: {{addr: '{self.host}'}}\n")
        with open(self.dir / "registry.log", "ab") as log:
            self.proc = subprocess.Popen([self.binary, "serve", str(config)], stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        for _ in range(60):
            try:
                urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2)
                return self
            except (urllib.error.URLError, OSError):
                time.sleep(0.5)
        self.__exit__()
        raise EnvironmentProblem(f"docker-registry did not answer on {self.host}; see {self.dir / 'registry.log'}")

    def __exit__(self, *exc: object) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)

    def clear(self) -> None:
        """Stopped, emptied and started again on the same address. The figures come from the
        manifests, read before: a benchmark host cannot keep a dozen 3 GB images."""
        self.__exit__()
        shutil.rmtree(self.dir / "storage", ignore_errors=True)
        self.__enter__()

    def manifest(self, repo: str, tag: str) -> dict:
        req = urllib.request.Request(f"http://{self.host}/v2/{repo}/manifests/{tag}", headers={"Accept": ACCEPT})
        with urllib.request.urlopen(req, timeout=60) as r:
            doc = json.load(r)
        return {"config": (doc["config"]["digest"], doc["config"]["size"]),
                "layers": [(layer["digest"], layer["size"]) for layer in doc["layers"]],
                "media_types": sorted({layer["mediaType"] for layer in doc["layers"]})}


# ---- building both layouts ----------------------------------------------------------------


def layout_copy(root: Path, dest: Path, layout: str, docker: dict, log: Callable[[str], None]) -> Path:
    """The project copied to dest with matrix.yaml's `layers:` set to the layout, re-rendered."""
    copy = files.copy_project(root, dest)
    if layout == "one layer":
        m = copy / "matrix.yaml"
        text = m.read_text()
        text, n = re.subn(r"^  layers: \{[^}\n]*\}$", "  layers: {own_layer_min_mb: null}", text, flags=re.M)
        if n != 1:
            raise BadFile("matrix.yaml's defaults have no one-line `layers: {...}` for the pull measure to replace", path="matrix.yaml")
        m.write_text(text)
    _buildpy(copy, ["render"], docker, log)
    return copy


def _buildpy(copy: Path, args: list[str], docker: dict, log: Callable[[str], None]) -> float:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(copy / "build.py"), *args], cwd=copy, env={**os.environ, **docker},
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise EnvironmentProblem(f"build.py {' '.join(args)} in {copy} failed (exit {proc.returncode}): "
                                 f"{(proc.stderr.strip().splitlines() or [''])[-1][:300]}")
    return time.monotonic() - t0


def refresh_lock(copy: Path, image: Image, index: wheel_files.Index) -> str:
    """Re-lock the copy's row with one package moved: REFRESHED to its release before the locked
    one (its wheel and hash from the index), lock.json kept consistent; the version it moved to."""
    d = lock.image_dir(copy, image)
    req = (d / "requirements.lock").read_text()
    meta = json.loads((d / "lock.json").read_text())
    locked = Version(meta["pins"][REFRESHED])
    wheels = {}
    for name, sha, size, url in index.files(REFRESHED):
        if name.endswith("-py3-none-any.whl"):
            version = parse_wheel_filename(name)[1]
            if version < locked:
                wheels[version] = (name, sha, size if size is not None else index.size(url), url)
    if not wheels:
        raise EnvironmentProblem(f"{index.url} has no {REFRESHED} wheel older than {locked} for the refresh")
    version = max(wheels)
    name, sha, size, url = wheels[version]
    block = re.search(rf"^{REFRESHED}==\S+ \\\n(?:    --hash=sha256:[0-9a-f]{{64}}(?: \\)?\n)+", req, re.M)
    assert block is not None, f"the lock has no hash-pinned {REFRESHED}"
    req = req.replace(block.group(0), f"{REFRESHED}=={version} \\\n    --hash=sha256:{sha}\n")
    (d / "requirements.lock").write_text(req)
    meta["pins"][REFRESHED] = str(version)
    meta["wheels"][REFRESHED] = {"file": name, "sha256": sha, "size": size, "url": url}
    meta["files_sha256"] = files.sha256_text(*(req if n == "requirements.lock" else (d / n).read_text() for n in lock.LOCK_FILES))
    (d / "lock.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return str(version)


def build_and_push(c: docker.DockerClient, copy: Path, image: Image, reg: Registry, repo: str, tag_: str, docker: dict, docker_cli: str, log: Callable[[str], None]) -> float:
    """The row built in the copy (no tests: only its layers are measured), pushed; the build's seconds."""
    log(f"bench pull: building {image.name} ({repo}:{tag_})")
    seconds = _buildpy(copy, ["--torch", image.torch, "--cuda", image.cuda, "--no-test", "--quiet"], docker, log)
    target = f"{reg.host}/{repo}:{tag_}"
    c.images.get(build.candidate_ref(image)).tag(target)
    c.images.remove(build.candidate_ref(image), noprune=True)
    log(f"bench pull: pushing {target}")
    proc = subprocess.run([docker_cli, "push", "--quiet", target], capture_output=True, text=True, env={**os.environ, **docker})
    if proc.returncode != 0:
        raise EnvironmentProblem(f"docker push {target} failed: {(proc.stderr.strip().splitlines() or [''])[-1]}")
    c.images.remove(target, noprune=True)
    return seconds


def rebuilt(log_path: Path, dockerfile: Path) -> dict:
    """What the refresh's build ran again: the python-env steps its log shows run (BuildKit does
    not always list a step it took from the cache), out of the stage's steps in the Dockerfile."""
    # steps() reads both progress formats; Docker 26's buildx writes rawjson, whose readable()
    # form it does not parse (that read 0 steps for every refresh).
    st = [x for x in progress.steps(log_path.read_text(errors="replace")) if x["stage"] == "python-env" and not x["cached"]]
    text = dockerfile.read_text()
    stage = text[text.index(" AS python-env"):].split("\nFROM ", 1)[0]
    return {"python_env_steps": len(re.findall(r"^(?:RUN|COPY) ", stage, re.M)), "ran": [x["cmd"][:100] for x in st]}


# Twelve builds of about 6 GB each do not fit a build host's disk together: between builds the
# build cache keeps its newest layers up to this size, and every cache mount (the compiled ops,
# which the second layout's builds take instead of compiling again).
KEEP_CACHE = "8GB"


def _bound_cache(bc: docker_env.BuildClient) -> None:
    proc = subprocess.run([bc.argv[0], "builder", "prune", "--force", "--filter", "type=regular", "--keep-storage", KEEP_CACHE],
                          capture_output=True, text=True, env={**os.environ, **bc.env})
    if proc.returncode != 0:
        raise EnvironmentProblem(f"docker builder prune failed: {(proc.stderr.strip().splitlines() or [''])[-1]}")


# ---- pull times into an empty engine -------------------------------------------------------


def zstd_copy(reg: Registry, zreg: Registry, repo: str, tag_: str) -> str:
    """The image recompressed with zstd into another registry (skopeo, registry to registry); its
    reference there. Another registry: skopeo keeps a blob the destination holds already, gzip
    or not, so a copy within one registry can stay gzip (the report lists the media types)."""
    if not shutil.which("skopeo"):
        raise EnvironmentProblem("the zstd pull needs skopeo: apt-get install skopeo")
    dest = f"{zreg.host}/{repo}:{tag_}"
    proc = subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false",
                           "--dest-compress-format", "zstd", f"docker://{reg.host}/{repo}:{tag_}", f"docker://{dest}"],
                          capture_output=True, text=True, env={**os.environ, "HOME": str(reg.dir)})
    if proc.returncode != 0:
        raise EnvironmentProblem(f"skopeo copy to zstd failed: {(proc.stderr.strip().splitlines() or [''])[-1][:300]}")
    return dest


def _wipe(store: engine_current.Store) -> None:
    """The probe engine stopped and emptied: Docker's data root and containerd's, where the
    containerd store keeps the blobs and the unpacked layers."""
    engine_current.down(store)
    for d in (store.state / "docker", store.state / "containerd", store.run):
        shutil.rmtree(d, ignore_errors=True)


def timed_pull(ref: str, ca: str | None, log: Callable[[str], None]) -> float:
    """Seconds for `docker pull ref` into an empty current engine (containerd store, started for
    this pull and emptied after it)."""
    store = engine_current.PROBE
    _wipe(store)
    env = engine_current.up(store, ca, log)
    try:
        t0 = time.monotonic()
        proc = subprocess.run([env["PYTORCH_CUDA_DOCKER"], "pull", "--quiet", ref], capture_output=True, text=True, env={**os.environ, **env})
        seconds = time.monotonic() - t0
        if proc.returncode != 0:
            raise EnvironmentProblem(f"docker pull {ref} into the probe engine failed: {(proc.stderr.strip().splitlines() or [''])[-1]}")
        return seconds
    finally:
        _wipe(store)


# ---- the measure ------------------------------------------------------------------------------


def at_commit(r: dict) -> str:
    """Where a report's date says what it measured: "at commit X" (build.source's revision), or,
    for a report written before the tools recorded it, that it was not recorded."""
    return f"at commit {r['commit']}" if r.get("commit") else "(commit not recorded)"


def measure(c: docker.DockerClient, m: Matrix, root: Path, bc: docker_env.BuildClient, ca: str | None, log: Callable[[str], None], work: Path | None = None, first: int | None = None) -> dict:
    """Both layouts built, pushed and read back; the figures and the pull times. first: --pull-rows."""
    if getattr(bc, "export", "load") != "oci":
        # Without rewrite-timestamp a layer's tar keeps the build's time on the directories of its
        # mount points (/etc, /run/secrets, /tmp): every build is another blob, and nothing is shared.
        raise EnvironmentProblem(f"the pull measure needs an engine that rewrites file times ({bc.description} does not): "
                         "a containerd image store with buildx >= 0.13, e.g. eval \"$(python3 build.py engine)\"")
    chosen = rows(m, first)
    if len(chosen) < 2:
        raise NoSuchRow("the pull measure needs at least two CUDA 13 rows in the matrix", name="--pull-rows")
    docker = {docker_env.DOCKER_ENV: bc.argv[0]}
    index = wheel_files.Index(chosen[0].index, ca)
    names = [i.name for i in chosen]
    manifests: dict[str, dict[str, dict]] = {}
    r: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "commit": build.source(root).revision,
               "cpus": os.cpu_count(), "engine": bc.description,
               "rows": names, "of_rows": len(rows(m)), "build_s": {}, "pull_s": {}}
    with tempfile.TemporaryDirectory(prefix="pytorch-cuda-pull-", dir=work) as tmp:
        for layout in LAYOUTS:
            slug = layout.replace(" ", "-")
            copy = layout_copy(root, Path(tmp) / slug, layout, docker, log)
            with Registry(Path(tmp) / f"registry-{slug}") as reg, Registry(Path(tmp) / f"registry-{slug}-zstd") as zreg:
                repo, found = f"pull/{slug}", {}
                built = r["build_s"][layout] = {}
                built[names[0]] = build_and_push(c, copy, chosen[0], reg, repo, names[0], docker, bc.argv[0], log)
                found[names[0]] = reg.manifest(repo, names[0])
                zstd = zstd_copy(reg, zreg, repo, names[0])
                r.setdefault("media_types", {})[layout] = {"gzip": found[names[0]]["media_types"],
                                                           "zstd": zreg.manifest(repo, names[0])["media_types"]}
                r["pull_s"][layout] = {"gzip": timed_pull(f"{reg.host}/{repo}:{names[0]}", ca, log), "zstd": timed_pull(zstd, ca, log)}
                zreg.clear()
                # The refresh right after its row, whose layers are then still in the build cache.
                r["refreshed_to"] = refresh_lock(copy, chosen[0], index)
                _buildpy(copy, ["render"], docker, log)
                built["refresh"] = build_and_push(c, copy, chosen[0], reg, repo, f"{names[0]}-refresh", docker, bc.argv[0], log)
                found[f"{names[0]}-refresh"] = reg.manifest(repo, f"{names[0]}-refresh")
                r.setdefault("refresh_rebuilt", {})[layout] = rebuilt(copy / "build-results" / names[0] / "build.log",
                                                                      build.dockerfile(copy, chosen[0]))
                for image in chosen[1:]:
                    reg.clear()
                    _bound_cache(bc)
                    built[image.name] = build_and_push(c, copy, image, reg, repo, image.name, docker, bc.argv[0], log)
                    found[image.name] = reg.manifest(repo, image.name)
                _bound_cache(bc)
                manifests[layout] = found
            shutil.rmtree(copy, ignore_errors=True)
    r["refreshed"] = REFRESHED
    r["figures"] = figures(manifests, names, REFRESHED)
    return r


def _pct(a: int, b: int) -> str:
    return f"{a / 1e6:,.0f} MB of {b / 1e6:,.0f} MB ({100 * a / b:.1f}%)"


def markdown(r: dict) -> str:
    """The four figures, the two layouts side by side."""
    f = r["figures"]
    a, b = LAYOUTS
    first = r["rows"][0]
    n, of = len(r["rows"]), r.get("of_rows", len(r["rows"]))
    command = "python3 build.py bench --full --only pull" + (f" --pull-rows {n}" if n < of else "")
    which = "the CUDA 13 rows" if n == of else f"the first {n} of the matrix's {of} CUDA 13 rows"
    lines = [f"Measured {r['date']} {at_commit(r)} on this machine ({r['cpus']} CPUs, {r['engine']}), by `{command}` "
             f"(any --torch: it measures these rows): {which} ({', '.join(r['rows'])}) and a refresh of {first} that moves "
             f"{r['refreshed']} to {r['refreshed_to']}, built with every wheel in one layer and with the matrix's layout, each "
             "pushed to a registry of its own on 127.0.0.1 (gzip). Bytes are compressed blob sizes from the registry's manifests; "
             "a node pulls the blobs it does not hold.", "",
             f"| figure | {a} | {b} | goal |", "|---|---|---|---|"]
    ra, rb = f[a]["refresh"], f[b]["refresh"]
    lines.append(f"| a node holding {first} pulls after the one-package refresh | {_pct(ra['pulled'], ra['image'])} | "
                 f"{_pct(rb['pulled'], rb['image'])} | <= 3% |")
    for pa, pb in zip(f[a]["neighbours"], f[b]["neighbours"]):
        lines.append(f"| a node holding {pa['held']} pulls for {pa['next']} | {_pct(pa['pulled'], pa['image'])} | "
                     f"{_pct(pb['pulled'], pb['image'])} | <= 35% |")
    ga, gb = f[a]["registry"], f[b]["registry"]
    lines.append(f"| registry bytes for these {n} CUDA 13 rows together (sum of their images) | {ga['stored'] / 1e9:.2f} GB "
                 f"({ga['sum_of_images'] / 1e9:.2f} GB) | {gb['stored'] / 1e9:.2f} GB ({gb['sum_of_images'] / 1e9:.2f} GB) | reported |")
    pa, pb = r["pull_s"][a], r["pull_s"][b]
    lines.append(f"| pull of {first} from 127.0.0.1 into an empty Docker 26 engine (containerd store), gzip / zstd | "
                 f"{pa['gzip']:.0f} s / {pa['zstd']:.0f} s | {pb['gzip']:.0f} s / {pb['zstd']:.0f} s | reported |")
    lines.append(f"| layers of {first}'s image | {f[a]['layers'][first]} | {f[b]['layers'][first]} | far below 127 |")
    types = r.get("media_types", {})
    lines.append(f"| layer media types of {first} (gzip push / after skopeo's zstd copy) | "
                 + " | ".join(f"{', '.join(t.rsplit('.', 1)[-1] for t in types.get(lay, {}).get('gzip', []))} / "
                              f"{', '.join(t.rsplit('.', 1)[-1] for t in types.get(lay, {}).get('zstd', []))}" for lay in LAYOUTS) + " | - |")
    rb = r.get("refresh_rebuilt", {})
    if rb:
        cells = [f"{len(rb[lay]['ran'])} of {rb[lay]['python_env_steps']}" if lay in rb else "not measured" for lay in LAYOUTS]
        lines.append(f"| the refresh's build: python-env steps run again (the rest from the cache) | {cells[0]} | {cells[1]} | "
                     "the last layer only |")
    builds = r["build_s"]
    lines += ["", "Build times of this run (build.py, no tests; the op compile only in the first layout that built a row): " +
              "; ".join(f"{lay}: " + ", ".join(f"{k} {v:.0f} s" for k, v in builds[lay].items()) for lay in LAYOUTS), ""]
    return "\n".join(lines) + "\n"


def write(r: dict, out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "pull.json").write_text(json.dumps(r, indent=2) + "\n")
    text = "# Pull cost: one layer of wheels against the layered layout\n\n" + markdown(r)
    (out_dir / "pull.md").write_text(text)
    return text
