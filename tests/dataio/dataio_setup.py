"""The dataio tests' shared names: the repository, the default pipeline sized down, the write path's fields.

A module of its own name, not ``conftest``: ``from conftest import ...`` gets whichever ``conftest.py``
was imported last when several test folders run together."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PIPELINE = REPO / "pipelines" / "default.py"
# the default pipeline sized down; its tiny model (seed 0, no warm start) is the collector's here
SMALL = ("warm_start_steps=0", "prompts_per_round=4", "group_size=4", "max_new_tokens=5",
         "max_lag=none", "learner.batch_size=16", "learner.sample_window=32",
         "learner.new_rows_per_step=0", "learner.checkpoint_every=2", "learner.publish_every=1")
GROUP_SIZE = 4
# the optional fields the single-turn collector and write path fill (termination_reason is the
# multi-turn agents' field: a single-turn collector does not write it)
WRITE_PATH_FIELDS = ("ref_log_probs", "kl", "token_rewards", "advantage")

