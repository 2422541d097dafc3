"""rlhf_pipeline: durable ragged replay buffers and the GRPO pipeline built around them."""

__version__ = "0.1.0"
