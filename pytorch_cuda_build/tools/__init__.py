"""Commands beside the pipeline: the second engine, verify, bench, propose, the GPU bundle, selftest."""
