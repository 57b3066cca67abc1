"""The lock stage's helpers: what the package index and Debian's mirrors hold."""
