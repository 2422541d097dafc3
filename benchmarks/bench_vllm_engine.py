"""Generation engines script: ``python benchmarks/bench_vllm_engine.py [--models 2m 20m] [--engines ...] [--json [PATH]]``.

A thin wrapper around :mod:`rlhf_pipeline.bench.generation_bench`; the same run as ``rlhf-pipeline
bench generation`` (our loop, HF ``generate``, a vLLM engine and a vLLM server side by side). See
docs/benchmarks.md for what it measures.
"""

from __future__ import annotations

import argparse
import sys

from rlhf_pipeline.bench import generation_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    generation_bench.add_arguments(parser)
    return generation_bench.main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
