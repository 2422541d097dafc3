"""How separate processes coordinate through files, never by calling each other: published
policy weights (learner -> collectors), pacing (how far collectors may run ahead) and polling
(waiting on a file the other side rewrites).

Design: docs/architecture.md#published-weights, docs/architecture.md#pacing, docs/architecture.md#polling.
"""
