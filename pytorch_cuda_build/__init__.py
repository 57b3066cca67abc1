"""Host-side pipeline: matrix.yaml -> lock -> render -> base -> build -> gate -> sbom -> security -> tag -> publish.

matrix/ is the model every layer reads, stages/ holds one module per stage, pipeline.py runs
them for one row, scheduler.py for many, commands/ the commands users run beside the pipeline,
tooling/ the project's own tooling (its test suite, its measures, the second engine), engine/
the Docker daemon. `cli` is the only place that catches `errors.PipelineError`. Nothing here
imports torch: torch lives inside the images only.
"""
