"""Cost of the door: ``validate_batch`` (and ``TrajectoryBatch.from_rows``) per completion.

    python benchmarks/bench_validation.py                          # this checkout only
    python benchmarks/bench_validation.py --baseline-rev 403534f   # and an older schema.py, side by side

(Since the package layout moved, e12744b8, no revision's ``schema.py`` runs beside this checkout's
package: ``--baseline-rev`` is refused in one line, and the comparison is two runs, one per checkout.)

With ``--baseline-rev`` the ``schema.py`` of that git revision is loaded as a second module and
both versions validate the same batches in alternation (A B A B ...), so the two are timed at
the same moments of a shared machine. Each case is timed ``--repeat`` times; the table shows the
fastest run (``timeit``'s convention: the noise of a shared machine only ever adds time) and the
median, in microseconds per completion, and the ratio of the fastest runs (this checkout over
the baseline).

Cases: ``default`` is a round of the default pipeline (4 prompts x 8 completions, short
prompts and answers, ASCII text); ``synthetic`` is the storage benchmark's data (512 rows,
prompts of 32-256 tokens, responses of 16-1024, an ``advantage`` column); ``unicode`` is the
default case with non-ASCII text (the text check's slow path).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_schema_at(rev: str):
    """``rlhf_pipeline/schema.py`` as of git revision ``rev``, imported as its own module beside this
    checkout's package. Since the package layout moved (e12744b8) no revision's file can: later ones
    have none (the schema is the package ``rlhf_pipeline/schema/``), earlier ones import modules that
    moved. Either is refused in one line that says how to compare instead."""
    refused = (f"--baseline-rev {rev}: the script times one rlhf_pipeline/schema.py beside this checkout's "
               f"package, and since the package layout moved (e12744b8) no revision's schema.py runs beside it; "
               f"run the script in a checkout of {rev} and in this one, one after the other")
    shown = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:rlhf_pipeline/schema.py"],
                           capture_output=True, text=True, check=False)
    if shown.returncode != 0:
        raise SystemExit(refused)
    path = Path(tempfile.mkdtemp()) / f"schema_{rev}.py"
    path.write_text(shown.stdout)
    spec = importlib.util.spec_from_file_location(f"schema_{rev}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except ImportError:
        raise SystemExit(refused) from None
    return module


def cases():
    import torch

    from rlhf_pipeline.schema.synthetic import synthetic_batch

    default = synthetic_batch(32, group_size=8, prompt_len=(8, 12), response_len=(1, 6), vocab_size=100)
    synthetic = synthetic_batch(512, optional_fields=("advantage",))
    unicode_text = default.with_columns(
        prompt_text=[f"Grüße {i}: 日本語 λόγος" for i in range(32)],
        response_text=[f"정답 {i} 🙂" for i in range(32)],
    )
    return {"default": (default, ()), "synthetic": (synthetic, ("advantage",)),
            "unicode": (unicode_text, ())}, torch


def time_validate(schema_module, batch, optional, loops: int) -> float:
    """Seconds per completion of ``schema_module.validate_batch`` on ``batch``."""
    rebuilt = schema_module.TrajectoryBatch(batch.columns)
    store_schema = schema_module.StoreSchema(optional)
    start = time.perf_counter()
    for _ in range(loops):
        schema_module.validate_batch(rebuilt, store_schema)
    return (time.perf_counter() - start) / loops / len(batch)


def time_from_rows(schema_module, rows, loops: int) -> float:
    start = time.perf_counter()
    for _ in range(loops):
        schema_module.TrajectoryBatch.from_rows(rows)
    return (time.perf_counter() - start) / loops / len(rows)


def as_rows(batch) -> list[dict]:
    """Plain Python rows (lists, numbers, strings), as a user's code would build them."""
    from rlhf_pipeline.schema.ragged import RaggedTensor

    rows: list[dict] = [{} for _ in range(len(batch))]
    for name in batch.field_names:
        column = batch[name]
        for i, row in enumerate(rows):
            if isinstance(column, RaggedTensor):
                row[name] = column.row(i).tolist()
            elif isinstance(column, list):
                row[name] = column[i]
            else:
                row[name] = column[i].item()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-rev", default=None, help="git revision whose schema.py is the baseline")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per case and version (default 7)")
    args = parser.parse_args(argv)

    import rlhf_pipeline.schema as current

    torch_cases, torch = cases()
    torch.set_num_threads(1)
    versions = {"this checkout": current}
    if args.baseline_rev:
        versions[f"baseline {args.baseline_rev}"] = load_schema_at(args.baseline_rev)
    results: dict[tuple[str, str], list[float]] = {}
    for case, (batch, optional) in torch_cases.items():
        loops = max(3, 20_000 // len(batch))
        rows = as_rows(batch)
        for _ in range(args.repeat):
            for label, module in versions.items():  # alternate, so both see the same load
                results.setdefault((case, "validate_batch", label), []).append(
                    time_validate(module, batch, optional, loops))
                results.setdefault((case, "from_rows", label), []).append(
                    time_from_rows(module, rows, max(1, loops // 20)))
        print(f"[bench] {case} done", file=sys.stderr, flush=True)

    header = f"{'case':<10} {'what':<15} {'version':<22} {'best us/compl':>13} {'median':>9} {'vs baseline':>12}"
    print(header)
    print("-" * len(header))
    labels = list(versions)
    for case in torch_cases:
        for what in ("validate_batch", "from_rows"):
            best_of = {label: min(results[(case, what, label)]) for label in labels}
            for label in labels:
                runs = results[(case, what, label)]
                ratio = f"{best_of[label] / best_of[labels[-1]]:.2f}x" if len(labels) > 1 else ""
                print(f"{case:<10} {what:<15} {label:<22} {min(runs) * 1e6:>13.3f} "
                      f"{statistics.median(runs) * 1e6:>9.3f} {ratio:>12}")
    return 0


if __name__ == "__main__":
    from rlhf_pipeline.bench.page import script_main

    sys.exit(script_main(__file__, main, sys.argv[1:]))
