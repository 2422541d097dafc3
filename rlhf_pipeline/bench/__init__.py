"""Benchmarks behind ``rlhf-pipeline bench``: storage backends (``storage_bench``) and more.

Modules here import torch lazily (inside functions) so ``rlhf-pipeline bench --help``
stays instant; see :mod:`rlhf_pipeline.cli.bench_cmd` for the registry.
Design: docs/architecture.md#benchmarks; what each measures: docs/benchmarks.md.
"""
