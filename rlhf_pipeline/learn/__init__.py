"""Learning: the learner recipe and what it is made of, one module per reason to change.

``learner`` (the recipe: setup -> train -> save_checkpoint -> cleanup, with its prefetch thread
and charts), ``step`` (one optimizer step, the optimizer and its schedule), ``batch`` (a draw's
rows as the step's padded or packed micro-batches), ``trajectories`` (multi-turn rows joined into
one sequence each), ``loss`` (the GRPO loss and its padded and packed forwards),
``packed_attention`` (the attention a packed forward runs), ``samplers`` (the sampler contract and
registry), ``distributed`` (data-parallel ranks, FSDP), ``shard_rows`` (rows named across store
refreshes), ``checkpoint`` (``Progress`` + ``CheckpointManager``: the checkpoint files),
``metrics`` (the metrics log and progress display), ``rescore`` (replay's re-scoring),
``settings`` and ``errors`` (a refused step, importable without torch). Import from the
submodules; this package keeps its import light.
"""
