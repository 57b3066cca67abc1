"""Host-side pipeline: matrix -> resolve/lock -> render -> build -> test -> tag.

One module per stage; `cli` is the only place that catches `errors.PipelineError`.
Nothing here imports torch: torch lives inside the images only.
"""
