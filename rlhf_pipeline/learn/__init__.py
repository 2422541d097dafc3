"""Learning: the learner recipe and what it is made of, one module per reason to change.

``learner`` (the recipe, its prefetch thread and charts), ``step`` (one optimizer step and the
optimizer), ``batch`` (a draw's rows as padded or packed micro-batches), ``trajectories`` (multi-turn
rows joined into one sequence each), ``loss`` (the GRPO loss and its forwards), ``packed_attention``,
``samplers`` (contract and registry), ``distributed`` (data-parallel ranks, FSDP), ``shard_rows``
(rows named across refreshes), ``checkpoint``, ``keep_best``, ``lora``, ``metrics``, ``rescore``
(replay's re-scoring), ``settings`` and ``errors`` (importable without torch). Import from the
submodules; this package keeps its import light. Design: docs/learner.md.
"""
