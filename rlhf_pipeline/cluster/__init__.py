"""The same run placed on a Ray cluster: the driver and the collector and learner actors, asking for
what the run's ``ray`` settings say (``run_settings.RaySettings``). Ray is an optional extra; only
this package imports it.

Design: docs/ray.md#how-a-run-maps-onto-ray; the invariants: docs/architecture.md#ray.
"""
