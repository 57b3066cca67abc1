"""Host-side pipeline: matrix -> resolve/lock -> render -> build -> gate -> tag -> publish.

stages/ holds one module per stage, pipeline.py runs them for one row, scheduler.py for many,
tools/ the commands beside the pipeline, engine/ the Docker daemon. `cli` is the only place
that catches `errors.PipelineError`. Nothing here imports torch: torch lives inside the images only.
"""
