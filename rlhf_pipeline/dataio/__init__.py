"""The buffer as a dataset: rows in (``import``), rows out (``export``), the trained policy out
(``export-model``) and charts of runs (``plot``).

These sit on top of the layers (they use pipelines, stores, transforms and the collector's
prompt rendering) and are what the CLI commands of the same names call. Heavy readers and
writers are optional extras: ``pip install -e '.[data]'`` (pyarrow, datasets) and
``'.[plot]'`` (matplotlib); JSONL import/export and ``export-model`` need neither.
Design: docs/architecture.md#rows-in-and-out; use: docs/datasets.md.
"""
