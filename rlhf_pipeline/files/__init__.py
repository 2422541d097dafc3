"""A run's small state files: where they live (:class:`RunPaths`, the data home), the store they
go through (:class:`~rlhf_pipeline.files.run_store.RunStore`: a directory, or an ``s3://`` or ``az://``
URL), how they are written (atomically, whole or not at all; fenced at a URL) and how they are loaded
(never running code).

The lowest layer beside :mod:`rlhf_pipeline.schema`: everything that keeps run state uses it.
Design: docs/pipelines.md#the-run-directory; at a URL: docs/object-storage.md#a-whole-run-at-a-url.
"""
