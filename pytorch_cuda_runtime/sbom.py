"""CycloneDX SBOM of the environment it runs in: Python distributions and Debian packages.

Standard library only, so the host can run this file inside any image that has a
python3 (`build.py sbom IMAGE`), not only ours. Deterministic: components are sorted,
the serial number derives from the content, and no wall-clock time is written.
"""
import argparse
import hashlib
import json
import subprocess
import sys
import uuid
from importlib import metadata
from typing import Any


def python_components() -> list[dict[str, Any]]:
    seen: dict[str, dict[str, Any]] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name:
            continue
        key = name.lower().replace("_", "-")
        seen[key] = {
            "type": "library", "name": key, "version": dist.version,
            "purl": f"pkg:pypi/{key}@{dist.version}",
            "properties": [{"name": "python:location", "value": str(dist.locate_file(""))}],
        }
    return [seen[k] for k in sorted(seen)]


def debian_components() -> list[dict[str, str]]:
    try:
        out = subprocess.run(["dpkg-query", "-W", "-f", "${Package}\t${Version}\t${Architecture}\n"],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    comps = []
    for line in sorted(out.splitlines()):
        name, version, arch = line.split("\t")
        comps.append({"type": "library", "name": name, "version": version,
                      "purl": f"pkg:deb/debian/{name}@{version}?arch={arch}"})
    return comps


def sbom(subject: str) -> dict[str, Any]:
    components = python_components() + debian_components()
    digest = hashlib.sha256(json.dumps([subject, components], sort_keys=True).encode()).hexdigest()
    return {
        "bomFormat": "CycloneDX", "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{uuid.UUID(digest[:32])}", "version": 1,
        "metadata": {"component": {"type": "container", "name": subject},
                     "tools": [{"name": "pytorch-cuda sbom"}]},
        "components": components,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--subject", default="container", help="what the SBOM describes (image name)")
    p.add_argument("--output", help="file to write (default: stdout)")
    p.add_argument("--strict", action="store_true",
                   help="fail unless both Python distributions and Debian packages are found (our images have both)")
    args = p.parse_args(argv)
    doc = sbom(args.subject)
    kinds = {c["purl"].split("/", 1)[0] for c in doc["components"]}
    missing = [k for k in ("pkg:pypi", "pkg:deb") if k not in kinds]
    if args.strict and missing:
        sys.exit(f"sbom: error: no {' and no '.join(missing)} components found; the SBOM would be incomplete")
    text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
