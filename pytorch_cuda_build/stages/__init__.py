"""The stages of the diagram, one module each: resolve (PyPI, Debian), lock, render, base,
build, gate, sbom, security, tag, publish. pipeline.py orders them for one row."""
