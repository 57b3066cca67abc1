"""The stages of the diagram, one module each, numbered in the order a row goes through them:

    matrix.yaml --1 lock--> images/<image>/ --2 render--> Dockerfile --3 fetch--> the store
                --4 base, 5 build (no network)--> candidate --6 gate (smoke + structure tests),
                7 sbom, 8 security--> 9 tag --> 10 publish

matrix.yaml itself is read by the model below this folder (pytorch_cuda_build/matrix/), which
every stage imports. pipeline.py runs the stages for one row. The helpers they use live beside
this folder: resolve/ (the package index and Debian's mirrors, for lock), buildkit/ (the layer
layout, the ops seed and provenance, for render and build) and registry/ (the registry client,
indexes, zstd, attached artifacts and signatures, for publish). Each stage module's docstring
opens with its number, docs/architecture.md and pipeline.py's diagram number them the same way,
and tests/unit/test_package_layout.py holds them all to this list.
"""

# (number, module, what it does): the order of the diagram. publish_index is stage 10 for a row
# built on several platforms.
STAGES = (
    (1, "lock", "resolve each row once and write its committed lock files"),
    (2, "render", "render each Dockerfile and manifest from templates/ and the locks, offline"),
    (3, "fetch", "every file the lock names into the host's store, once, checked by its sha256"),
    (4, "base", "the base rootfs image the Dockerfile starts from, from the store"),
    (5, "build", "the candidate image, with BuildKit, from the store and with no network"),
    (6, "gate", "the smoke suite, then the structure checks"),
    (7, "sbom", "the tested image's CycloneDX SBOM"),
    (8, "security", "its known vulnerabilities"),
    (9, "tag", "the row's tags moved to the tested image"),
    (10, "publish", "a row of one platform pushed under its tags, immutable ones first"),
    (10, "publish_index", "a row of several platforms pushed as its parts and one index"),
)
