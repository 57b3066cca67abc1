"""The commands users run beside the pipeline: verify (a row built twice, or a published image rebuilt), record, the GPU bundle (with its ops wheel), and matrix --propose."""
