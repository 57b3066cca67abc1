"""The project's own tooling, not a user's: its test suite (selftest), its measures (bench, its report, the pull measure) and the second Docker engine its tests run on (engine)."""
