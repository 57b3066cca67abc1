"""Image records: what one build made, for a machine without that image to compare with.

A record is one JSON document, xz-compressed (`*.json.xz`): the image digest (the manifest's,
which is Docker 26's image ID on the containerd store; empty on a classic store), the config
digest and the config itself, and for each layer in order its blob digest, its diff_id and
every entry of its tar as a list: path, tar type, mode, uid:gid, size, mtime, and a regular
file's sha256 or a link's `-> target`. `what` says which build it is, `machine` on what.

    build.py record --torch 2.7 --cuda 12.1 [--image LOCAL] [--output FILE]
    build.py verify --torch 2.7 --cuda 12.1 --record FILE [--against LOCAL]

compare() names what differs between two records: the config's fields, the layers whose
diff_ids differ and, where both records list a layer's entries, every entry that differs and
how. `verify` (two builds), `verify --image` (a published image) and `verify --record` print
its lines alike.
"""
from __future__ import annotations

import hashlib
import io
import json
import lzma
import os
import platform
import re
import socket
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator, TypeVar

import docker.errors

from ..engine import docker_env
from ..errors import ArchiveLayoutError, BadFile, CommandFailed, NotReady

SCHEMA = 1
T = TypeVar("T")
# One entry of a layer: (tar type, mode, "uid:gid", size, mtime, sha256 of a file or "-> " link target)
Entry = tuple[str, str, str, int, int, str]
NAMES = ("type", "mode", "owner", "size", "mtime", "content")


@dataclass
class Layer:
    diff_id: str
    blob: str = ""
    entries: dict[str, Entry] | None = None  # None: not read (a published layer equal to ours)


@dataclass
class Record:
    image: str  # the manifest digest; "" where the store has none (classic)
    config_digest: str
    config: dict[str, Any]
    layers: list[Layer]
    what: str = ""
    machine: dict[str, str] = field(default_factory=dict)

    @property
    def diff_ids(self) -> list[str]:
        return [layer.diff_id for layer in self.layers]

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "manifest": self.image, "config": self.config_digest, "what": self.what,
                "machine": self.machine, "config_json": redact(self.config),
                "layers": [{"index": i, "blob": layer.blob, "diff_id": layer.diff_id,
                            "entries": [[path, *entry[:5], entry[5]] if entry[5] else [path, *entry[:5]]
                                        for path, entry in sorted((layer.entries or {}).items())]}
                           for i, layer in enumerate(self.layers)]}


def entry_of(member: tarfile.TarInfo, sha256: str) -> Entry:
    content = sha256 if member.isfile() else (f"-> {member.linkname}" if member.issym() or member.islnk() else "")
    return (member.type.decode(), oct(member.mode), f"{member.uid}:{member.gid}", member.size, int(member.mtime), content)


def index_layer(layer: tarfile.TarFile) -> dict[str, Entry]:
    """path -> entry for every member of one layer tar, read as a stream."""
    return {member.name: entry_of(member, content_sha256(layer, member)) for member in layer}


def content_sha256(layer: tarfile.TarFile, member: tarfile.TarInfo) -> str:
    """A regular file's sha256, read from the stream in blocks; "" for anything else."""
    if not member.isfile():
        return ""
    h, fh = hashlib.sha256(), layer.extractfile(member)
    assert fh is not None  # a regular file has contents
    while block := fh.read(8 * 1024 * 1024):
        h.update(block)
    return h.hexdigest()


# ---- reading: a record file, or a local image through `docker save`

def load(path: Path) -> Record:
    """A record from FILE (.json.xz or .json); BadFile naming the file when it is not one."""
    try:
        raw = path.read_bytes()
        doc = json.loads(lzma.decompress(raw) if path.suffix == ".xz" else raw)
        layers = [Layer(str(layer["diff_id"]), str(layer.get("blob", "")),
                        {str(e[0]): _entry(e) for e in layer["entries"]}) for layer in doc["layers"]]
        return Record(str(doc.get("manifest") or ""), str(doc["config"]), dict(doc["config_json"]), layers,
                      str(doc.get("what", "")), dict(doc.get("machine") or {}))
    except FileNotFoundError:
        raise BadFile(f"{path}: no such record file", path=path) from None
    except (OSError, lzma.LZMAError, ValueError, KeyError, TypeError, IndexError) as e:
        raise BadFile(f"{path}: not an image record ({type(e).__name__}: {e})", path=path) from None


def _entry(e: list[Any]) -> Entry:
    return (str(e[1]), str(e[2]), str(e[3]), int(e[4]), int(e[5]), str(e[6]) if len(e) > 6 else "")


def write(record: Record, path: Path) -> None:
    """The record as xz-compressed JSON, written to a temp file and renamed: never half there."""
    data = lzma.compress(json.dumps(record.to_json(), separators=(",", ":")).encode(), preset=9)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def from_image(ref: str, image_id: str, docker_cli: str, what: str) -> Record:
    """The record of a local image: its `docker save` stream read once."""
    rec = read_saved(ref, docker_cli, lambda stream: read_save(stream, ref, image_id))
    rec.what, rec.machine = what, machine()
    return rec


def read_saved(ref: str, docker_cli: str, reader: Callable[[IO[bytes]], T]) -> T:
    """reader over the stream of `docker_cli save ref`; the save's own error where it failed
    (a failed save writes nothing: its exit code says more than an empty stream)."""
    save = subprocess.Popen([docker_cli, "save", ref], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert save.stdout is not None and save.stderr is not None  # both PIPE
    try:
        parsed: T | ArchiveLayoutError = reader(save.stdout)
    except ArchiveLayoutError as e:
        parsed = e
        while save.stdout.read(1 << 20):  # a good stream must end on its own, not on a broken pipe
            pass
    except (tarfile.TarError, EOFError) as e:  # a stream cut short (the daemon gone mid-save): the save's exit says why
        parsed = ArchiveLayoutError(ref, f"the stream ended inside a tar ({e})")
    finally:
        save.stdout.close()
        err = save.stderr.read().decode(errors="replace").strip()
        save.stderr.close()
        save.wait()
    if save.returncode != 0:
        raise CommandFailed(f"{docker_cli} save {ref}", save.returncode, (err.splitlines() or [""])[-1][:300])
    if isinstance(parsed, ArchiveLayoutError):
        raise parsed
    return parsed


def read_save(stream: IO[bytes], ref: str, image_id: str) -> Record:
    """A Record from a `docker save` stream: Docker < 25 names layers <id>/layer.tar (uncompressed,
    blob = diff_id); from 25 on it is an OCI layout whose layers are blobs/sha256/<hex>. The stream
    is read once and manifest.json may come last, so every tar is indexed and JSON kept by name."""
    indexes: dict[str, dict[str, Entry]] = {}
    small: dict[str, bytes] = {}
    try:
        outer = tarfile.open(fileobj=stream, mode="r|")
        for member in outer:
            if not member.isfile():
                continue
            fh = outer.extractfile(member)
            assert fh is not None
            if member.size < 4 * 1024**2 and not member.name.endswith("layer.tar"):
                data = fh.read()
                try:
                    json.loads(data)
                    small[member.name] = data
                    continue
                except ValueError:
                    fh = io.BytesIO(data)
            try:
                indexes[member.name] = index_layer(tarfile.open(fileobj=fh, mode="r|*"))
            except tarfile.TarError:
                pass  # neither JSON nor a layer
    except (tarfile.TarError, ValueError, UnicodeDecodeError) as e:
        raise ArchiveLayoutError(ref, f"not a readable archive ({type(e).__name__}: {e})") from None
    if "manifest.json" not in small:
        raise ArchiveLayoutError(ref, "no manifest.json in it")
    manifest = json.loads(small["manifest.json"])
    if not isinstance(manifest, list) or len(manifest) != 1 or not isinstance(manifest[0].get("Layers"), list):
        raise ArchiveLayoutError(ref, "manifest.json is not one image with a Layers list")
    config_raw = small.get(str(manifest[0].get("Config")))
    if config_raw is None:
        raise ArchiveLayoutError(ref, f"its config {manifest[0].get('Config')} is not in it")
    config = json.loads(config_raw)
    diff_ids = list(config.get("rootfs", {}).get("diff_ids") or [])
    names = [str(n) for n in manifest[0]["Layers"]]
    if len(names) != len(diff_ids) or any(n not in indexes for n in names):
        raise ArchiveLayoutError(ref, "its layers do not match its config's diff_ids")
    layers = [Layer(d, "sha256:" + n.rsplit("/", 1)[-1] if n.startswith("blobs/") else d, indexes[n])
              for n, d in zip(names, diff_ids)]
    return Record(image_id if image_id != "sha256:" + hashlib.sha256(config_raw).hexdigest() else "",
                  "sha256:" + hashlib.sha256(config_raw).hexdigest(), config, layers)


def machine() -> dict[str, str]:
    """The facts of this build machine that a second machine compares its own with."""
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        model = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "")
        flags = next((ln.split(":", 1)[1] for ln in info.splitlines() if ln.startswith("flags")), "")
    except OSError:
        model = platform.processor()
    simd = sorted({f for f in flags.split() if f.startswith(("avx", "sha_ni", "vaes", "gfni", "amx"))})
    return {"cpu": f"{model}, {os.cpu_count()} cores, {' '.join(simd)}".strip(), "kernel": platform.release(),
            "hostname": socket.gethostname(), "umask": _umask(), "TZ": os.environ.get("TZ", "unset"),
            "LANG": os.environ.get("LANG", "unset"), "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _umask() -> str:
    mask = os.umask(0)
    os.umask(mask)
    return f"{mask:04o}"


# ---- comparing two records

@dataclass
class Differences:
    a: str  # what each side is called in the lines, e.g. "the record", "the image here"
    b: str
    same_image: bool
    config: list[str] = field(default_factory=list)
    layers: list[int] = field(default_factory=list)  # indices whose diff_ids differ
    files: list[str] = field(default_factory=list)  # "layer N: path: what", mtime aside
    mtime_only: int = 0  # entries equal but for their mtime (engines that keep build-time file times)
    unread: list[int] = field(default_factory=list)  # differing layers one side has no entries for
    counts: tuple[int, int] = (0, 0)

    @property
    def differing_paths(self) -> list[str]:
        """The paths whose bytes differ: regular files in both images."""
        return sorted({path for _, path, what in (line.split(": ", 2) for line in self.files) if "content" in what.split(", ")})


def compare(a: Record, b: Record, names: tuple[str, str] = ("build 1", "build 2")) -> Differences:
    """What differs between a and b, named with names: one config digest is one image."""
    same = a.config_digest == b.config_digest and a.diff_ids == b.diff_ids
    d = Differences(*names, same_image=same, counts=(len(a.layers), len(b.layers)))
    if same:
        return d
    d.config = config_differences(redact(a.config), redact(b.config))
    for i in range(max(len(a.layers), len(b.layers))):
        la = a.layers[i] if i < len(a.layers) else None
        lb = b.layers[i] if i < len(b.layers) else None
        if la is not None and lb is not None and la.diff_id == lb.diff_id:
            continue
        d.layers.append(i)
        if la is None or lb is None:
            continue  # the layer count differs; the config line says so
        if la.entries is None or lb.entries is None:
            d.unread.append(i)
            continue
        for path, what in entry_differences(la.entries, lb.entries, names):
            if what:
                d.files.append(f"layer {i}: {path}: {what}")
            else:
                d.mtime_only += 1
    return d


def entry_differences(a: dict[str, Entry], b: dict[str, Entry], names: tuple[str, str]) -> Iterator[tuple[str, str]]:
    """(path, what differs) for each entry not the same on both sides; what is "" where only the mtime differs."""
    for path in sorted(set(a) | set(b)):
        if path not in b:
            yield path, f"only in {names[0]}"
        elif path not in a:
            yield path, f"only in {names[1]}"
        elif a[path] != b[path]:
            yield path, ", ".join(_field(n, u) for n, u, v in zip(NAMES, a[path], b[path]) if u != v and n != "mtime")


def _field(name: str, value: object) -> str:
    return "link" if name == "content" and str(value).startswith("-> ") else name


def config_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The config fields that differ, labels one by one: `field: a -> b` (rootfs: by layer, elsewhere)."""
    out = []
    for key in sorted(set(a) | set(b)):
        if key == "config":
            inner_a, inner_b = a.get(key) or {}, b.get(key) or {}
            for k in sorted(set(inner_a) | set(inner_b)):
                if k == "Labels":
                    la, lb = inner_a.get(k) or {}, inner_b.get(k) or {}
                    out += [f"label {n}: {la.get(n)!r} -> {lb.get(n)!r}" for n in sorted(set(la) | set(lb)) if la.get(n) != lb.get(n)]
                elif inner_a.get(k) != inner_b.get(k):
                    out.append(f"config.{k}: {inner_a.get(k)!r} -> {inner_b.get(k)!r}")
        elif key == "history":
            # An entry's time differs wherever file times are not rewritten (the created field says
            # so once); what a step ran (created_by: its command and build arguments) is what matters.
            ha, hb = a.get(key) or [], b.get(key) or []
            out += [f"history[{i}]: {_step(x)!r} -> {_step(y)!r}" for i, (x, y) in enumerate(zip(ha, hb))
                    if {k: v for k, v in x.items() if k != "created"} != {k: v for k, v in y.items() if k != "created"}]
            if len(ha) != len(hb):
                out.append(f"history: {len(ha)} -> {len(hb)} entries")
        elif key == "rootfs":
            na, nb = len((a.get(key) or {}).get("diff_ids") or []), len((b.get(key) or {}).get("diff_ids") or [])
            if na != nb:
                out.append(f"layers: {na} -> {nb}")
        elif a.get(key) != b.get(key):
            out.append(f"{key}: {str(a.get(key))[:120]!r} -> {str(b.get(key))[:120]!r}")
    return out


def content_lines(mtime_only: int, files: list[str], show: int, more: str = "") -> list[str]:
    """The file lines of a verdict: entries that differ in their mtime alone, counted, and the others
    (`layer N: path: what`), the first `show` of them."""
    out = [f"time stamps only: {mtime_only} file(s) differ in mtime alone"]
    if files:
        out.append(f"CONTENT DIFFERS in {len(files)} file(s):")
        out += [f"  {line}" for line in files[:show]]
        if len(files) > show:
            out.append(f"  ... {len(files) - show} more{more}")
    return out


def _step(entry: dict[str, Any]) -> str:
    return str({k: v for k, v in entry.items() if k != "created"})[:160]


def lines(d: Differences, show: int = 200) -> list[str]:
    """The lines every verify prints for two images: the same kinds of line for two builds
    (`verify`), a published image (`verify --image`) and a record (`verify --record`)."""
    if d.same_image:
        return [f"layers: {d.counts[0]} vs {d.counts[1]}", "config digest and layer diff_ids: identical"]
    out = [f"layers: {d.counts[0]} vs {d.counts[1]}", f"differing layers: {', '.join(map(str, d.layers)) or 'none'} (by diff_id)"]
    if d.config:
        out.append(f"CONFIG DIFFERS in {len(d.config)} field(s) ({d.a} -> {d.b}):")
        out += [f"  {line}" for line in d.config]
    out += content_lines(d.mtime_only, d.files, show)
    if d.unread:
        out.append(f"layers whose files were not read (no entries on one side): {', '.join(map(str, d.unread))}")
    return out


MIRROR = re.compile(r"(https?://)[^/\s]+(/debian)")


def redact(config: dict[str, Any]) -> dict[str, Any]:
    """The config with the Debian mirror's host in its history replaced by DEBIAN_MIRROR: records
    name no host, and two machines that use different mirrors of one state compare equal. The
    config digest stays the one of the bytes the engine stored."""
    history = [{**h, "created_by": MIRROR.sub(r"\1DEBIAN_MIRROR\2", h["created_by"])} if "created_by" in h else h
               for h in config.get("history") or []]
    return {**config, "history": history} if "history" in config else config


# ---- the commands: `record`, and `verify --record` -------------------------------------------

def local_image_id(c: Any, ref: str) -> str:
    """The local image's ID, or NotReady naming it."""
    try:
        return str(c.images.get(ref).id)
    except docker.errors.ImageNotFound:
        raise NotReady(f"no local image {ref}: build the row first, or name one with --against/--image", ref=ref) from None


def record_local(ref: str, what: str, out: Path, docker: str | None, log: Callable[[str], None]) -> Record:
    """`build.py record`: the local image ref's record, written to out."""
    c, bc = docker_env.ensure_engine(log), docker_env.build_client(docker)
    with docker_env.calls("the record", c=c):  # nothing written until the record is whole
        image_id = local_image_id(c, ref)
        log(f"record: reading {ref}'s layers (every file's sha256)")
        rec = from_image(ref, image_id, bc.argv[0], f"{what} as {ref}, built on Docker {c.version().get('Version', '?')}, "
                                                    f"{docker_env.image_store(c)} store")
    out.parent.mkdir(parents=True, exist_ok=True)
    write(rec, out)
    return rec


def against_record(ref: str, name: str, recorded: Path, docker: str | None, log: Callable[[str], None]) -> tuple[list[str], bool]:
    """`verify --record`: the local image ref against a record, with no build and no access to the
    recorded image; the lines to print and whether they are the same image."""
    theirs = load(recorded)
    c, bc = docker_env.ensure_engine(log), docker_env.build_client(docker)
    log(f"verify: reading {ref}'s layers (every file's sha256)")
    with docker_env.calls("`verify --record`", c=c):
        ours = from_image(ref, local_image_id(c, ref), bc.argv[0], f"{name} here")
    d = compare(theirs, ours, ("the record", "the image here"))
    return [f"image digests: {theirs.image or '(none recorded)'} vs {ours.image or '(none: classic store)'}",
            f"config digests: {theirs.config_digest} vs {ours.config_digest}", *lines(d),
            "verdict: THE SAME IMAGE" if d.same_image else "verdict: DIFFERENT"], d.same_image
