"""The ``rlhf-pipeline`` command. Command modules import torch only inside ``run``.
Design: docs/architecture.md#the-command-line; every command: docs/commands.md.
"""


class CommandRefused(Exception):
    """A command's refusal of its input: ``main`` says it in one line, ``rlhf-pipeline COMMAND: error:
    MESSAGE``, and exits with ``code`` (2: bad input, as argparse's own refusals). Defined here, not in
    ``main``, which also runs as ``__main__`` (``python -m rlhf_pipeline.cli.main``): a class of that
    module would be a second class there."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code
