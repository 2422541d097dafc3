"""The run directory's small state files: where they live (:class:`RunPaths`, the data home),
how they are written (atomically, whole or not at all) and how they are loaded (never running code).

The lowest layer beside :mod:`rlhf_pipeline.schema`: everything that keeps state on disk uses it.
"""
