"""rlhf_pipeline: durable ragged replay buffers and the GRPO pipeline built around them.

Design: docs/architecture.md#the-package-one-folder-per-idea.
"""

__version__ = "0.1.0"
