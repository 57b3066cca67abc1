"""The publish stage's helpers: the registry client, image indexes, zstd, attached artifacts, signatures."""
