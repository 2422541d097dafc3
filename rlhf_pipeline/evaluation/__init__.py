"""Evaluation during training: a pipeline's held-out sets scored against pinned policy versions.

``settings.py`` (``eval.*``), ``sets.py`` (what a pipeline declares: :class:`~.sets.EvalSet`),
``scores.py`` (pass@k, the summary of one evaluation), ``sampling.py`` (the one call into the
generation engine, with a seed per prompt and sample) and ``evaluator.py`` (one (version, set)
evaluation into the set's eval store, its progress published with its rows). Design and use:
docs/evaluation.md.
"""
