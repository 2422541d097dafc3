"""Storage benchmark script: ``python benchmarks/bench_storage.py [--json] [--completions N] [--backends ...]``.

A thin wrapper around :mod:`rlhf_pipeline.bench.storage_bench`; the same run as
``rlhf-pipeline bench storage``. See docs/benchmarks.md for what it measures.
"""

from __future__ import annotations

import argparse
import sys

from rlhf_pipeline.bench import storage_bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    storage_bench.add_arguments(parser)
    return storage_bench.main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
