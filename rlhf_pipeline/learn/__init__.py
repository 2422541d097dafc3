"""Learning: sampling padded batches from a run's buffer, the GRPO step, checkpoints, metrics.

Modules: ``learner`` (the recipe: setup -> train -> save_checkpoint -> cleanup), ``resume``
(what a checkpoint saves; resuming from one), ``draw_reading`` (a draw read into the step's batch),
``sampling`` (the sampler contract and registry; ``window_sampler`` is the default),
``prefetch`` (a background thread that prepares batches), ``microbatch`` (token-budget
micro-batches for gradient accumulation), ``checkpoint`` (``Progress`` +
``CheckpointManager``), ``metrics`` (JSONL + TensorBoard + progress display), ``loss``
(the GRPO loss) and ``errors`` (a refused step, importable without torch). Import from the
submodules; this package keeps its import light.
"""
