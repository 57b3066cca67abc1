"""The build stage's helpers: the wheels' layer layout, the ops seed, BuildKit's provenance."""
