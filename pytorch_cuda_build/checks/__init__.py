"""The structure checks every candidate image must pass before a tag points at it.

Product code, not the repository's tests: `test.structure` runs pytest on this package's
own directory (found from its __file__, so an installed tool runs the same checks as a
checkout) with pytest-testinfra's docker backend. Options: `--image` (ID or reference),
`--image-name` (its matrix row), `--matrix` (the matrix file) and `--root` (the project
whose committed `images/<image>/` the image is checked against).
"""
