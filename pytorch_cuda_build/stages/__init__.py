"""The stages of the diagram, one module each, numbered in the order a row goes through them:

    matrix.yaml --lock--> images/<image>/ --render--> Dockerfile --build--> candidate
                --smoke + structure tests--> tags --> publish

pipeline.py runs them for one row. The helpers they use live beside this folder: resolve/ (the
package index and Debian's mirrors, for lock), buildkit/ (the layer layout, the ops seed and
provenance, for render and build) and registry/ (the registry client, indexes, zstd, attached
artifacts and signatures, for publish). docs/architecture.md numbers them the same way, and
tests/unit/test_package_layout.py holds this folder to this list.
"""

# (number, module, what it does): the order of the diagram. publish_index is stage 10 for a row
# built on several platforms.
STAGES = (
    (1, "matrix", "load matrix.yaml, every problem at once, into the rows"),
    (2, "lock", "resolve each row once and write its committed lock files"),
    (3, "render", "render each Dockerfile and manifest from templates/ and the locks, offline"),
    (4, "base", "the base rootfs image the Dockerfile starts from"),
    (5, "build", "the candidate image, with BuildKit"),
    (6, "gate", "the smoke suite, then the structure checks"),
    (7, "sbom", "the tested image's CycloneDX SBOM"),
    (8, "security", "its known vulnerabilities"),
    (9, "tag", "the row's tags moved to the tested image"),
    (10, "publish", "a row of one platform pushed under its tags, immutable ones first"),
    (10, "publish_index", "a row of several platforms pushed as its parts and one index"),
)
