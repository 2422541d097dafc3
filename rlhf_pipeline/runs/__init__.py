"""Process orchestration on one machine: ``run``/``collect``/``learn`` (the launcher and its
children), the run directory's preparation and lock, early start-up of child processes,
clean stops, and ``replay``'s driver. Above the collector and the learner; nothing below imports it.
Design: docs/architecture.md#the-layers.
"""
