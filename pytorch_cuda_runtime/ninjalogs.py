"""Make ninja's logs in a torch extensions directory the same on every build.

    python ninjalogs.py DIR...

torch builds each JIT extension with ninja, and torch runs ninja again on every first load
in a process: the logs decide whether the baked ops are up to date or compiled again. They
record when each step ran, so two builds of one image differ in them and nothing else
(`.ninja_log`: start and end in ms and the output's mtime in ns; `.ninja_deps`: the
output's mtime). Dropping them is no answer: without a log entry ninja rebuilds.

This rewrites both logs under each DIR in a canonical form: entries ordered by output,
times zero, and each recorded mtime set to FUTURE_NS (2100-01-01). ninja calls an output
dirty when its logged mtime is older than an input, and drops stored deps when the output
on disk is newer than the deps' mtime; a far-future mtime satisfies both whatever the file
times on disk are (the build's own, or all clamped to SOURCE_DATE_EPOCH by BuildKit's
rewrite-timestamp). Standard library only: it runs in the image's build before the
runtime package is installed.
"""
import struct
import sys
from pathlib import Path

FUTURE_NS = 4102444800 * 10**9  # 2100-01-01T00:00:00Z
LOG_HEADER = "# ninja log v"
DEPS_HEADER = b"# ninjadeps\n"
DEPS_VERSION = 4  # ninja 1.10 on: (int32 id, uint32 mtime_lo, uint32 mtime_hi, int32 input ids)


class NinjaLogError(Exception):
    """A log this module does not know how to rewrite: left alone would break reproducibility."""


def normalize_build_log(text: str) -> str:
    """`.ninja_log` v5 to v7: tab-separated start_ms, end_ms, mtime, output, command hash.
    ninja appends, so a rebuilt output appears twice and the last entry counts."""
    lines = text.splitlines()
    if not lines or not lines[0].startswith(LOG_HEADER):
        raise NinjaLogError(f"not a ninja build log: {lines[:1]}")
    version = int(lines[0][len(LOG_HEADER):])
    if version not in (5, 6, 7):
        raise NinjaLogError(f"ninja build log v{version}: only v5 to v7 are known")
    entries = {}
    for line in lines[1:]:
        fields = line.split("\t")
        if len(fields) != 5:
            raise NinjaLogError(f"ninja build log line with {len(fields)} fields: {line!r}")
        entries[fields[3]] = fields[4]
    body = "".join(f"0\t0\t{FUTURE_NS}\t{out}\t{h}\n" for out, h in sorted(entries.items()))
    return f"{lines[0]}\n{body}"


def _read_deps(data: bytes):
    """Yield ("path", id, path) and ("deps", out_id, mtime, input_ids) records in file order."""
    if not data.startswith(DEPS_HEADER) or len(data) < len(DEPS_HEADER) + 4:
        raise NinjaLogError("not a ninja deps log")
    (version,) = struct.unpack_from("<i", data, len(DEPS_HEADER))
    if version != DEPS_VERSION:
        raise NinjaLogError(f"ninja deps log v{version}: only v{DEPS_VERSION} is known")
    pos, next_id = len(DEPS_HEADER) + 4, 0
    while pos < len(data):
        (head,) = struct.unpack_from("<I", data, pos)
        size, is_deps = head & 0x7FFFFFFF, bool(head >> 31)
        record = data[pos + 4: pos + 4 + size]
        if len(record) != size or size % 4:
            raise NinjaLogError(f"truncated ninja deps log at byte {pos}")
        pos += 4 + size
        if is_deps:
            out_id, lo, hi, *inputs = struct.unpack(f"<iII{size // 4 - 3}i", record)
            yield "deps", out_id, lo | hi << 32, inputs
        else:
            path, (checksum,) = record[:-4].rstrip(b"\0"), struct.unpack("<I", record[-4:])
            if checksum != ~next_id & 0xFFFFFFFF:
                raise NinjaLogError(f"ninja deps log path record {path!r} has a bad checksum")
            yield "path", next_id, path.decode()
            next_id += 1


def _deps_by_output(data: bytes) -> dict:
    """{output: the files its compile read}, from the last deps record of each output, as ninja reads it."""
    paths, deps = {}, {}
    for kind, *rest in _read_deps(data):
        if kind == "path":
            paths[rest[0]] = rest[1]
        else:
            out_id, _mtime, inputs = rest
            deps[paths[out_id]] = [paths[i] for i in inputs]
    return deps


def deps_inputs(data: bytes) -> set:
    """Every file a `.ninja_deps` records as read by some output's compile (headers included)."""
    return {path for inputs in _deps_by_output(data).values() for path in inputs}


def normalize_deps_log(data: bytes) -> bytes:
    """`.ninja_deps`: path records give ids in the order first seen, which follows the order
    in which parallel jobs finished. Rewritten with one deps record per output (the last, as
    ninja reads it), outputs sorted, ids renumbered in the order ninja itself would assign."""
    deps = _deps_by_output(data)
    ids: dict[str, int] = {}
    out = bytearray(DEPS_HEADER + struct.pack("<i", DEPS_VERSION))

    def node(path: str) -> int:
        if path not in ids:
            ids[path] = len(ids)
            raw = path.encode()
            raw += b"\0" * (-len(raw) % 4)
            out.extend(struct.pack("<I", len(raw) + 4) + raw + struct.pack("<I", ~ids[path] & 0xFFFFFFFF))
        return ids[path]

    for output in sorted(deps):
        record = [node(output)] + [node(i) for i in deps[output]]
        out.extend(struct.pack("<I", (4 * (len(record) + 2)) | 0x80000000))
        out.extend(struct.pack(f"<iII{len(record) - 1}i", record[0], FUTURE_NS & 0xFFFFFFFF, FUTURE_NS >> 32, *record[1:]))
    return bytes(out)


def normalize_tree(root: Path) -> list:
    """Rewrite every ninja log under root in place, keeping each file's mode; return their paths."""
    done = []
    for log in sorted(root.rglob(".ninja_log")) + sorted(root.rglob(".ninja_deps")):
        if log.name == ".ninja_log":
            log.write_text(normalize_build_log(log.read_text()))
        else:
            log.write_bytes(normalize_deps_log(log.read_bytes()))
        done.append(log)
    return done


def main(argv=None) -> int:
    roots = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not roots or not all(r.is_dir() for r in roots):
        print("usage: ninjalogs.py DIR... (each an existing directory)", file=sys.stderr)
        return 2
    try:
        done = [p for r in roots for p in normalize_tree(r)]
    except (NinjaLogError, OSError, UnicodeDecodeError) as e:
        print(f"ninjalogs: error: {e}", file=sys.stderr)
        return 1
    if not done:
        print(f"ninjalogs: error: no ninja log under {', '.join(map(str, roots))}", file=sys.stderr)
        return 1
    print(f"ninjalogs: {len(done)} ninja logs made reproducible under {', '.join(map(str, roots))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
