"""``learner.turn_advantage=mixed``: a turn's tokens get ``(1 - w) * trajectory + w * turn``.

The trajectory's part is its group-relative return (``advantage``, the same on every row of it),
the turn's part the turn's own reward normalised in its group (``step_advantage``, written beside
it by ``GroupAdvantage(step_advantage=True)``). Checked against a hand computation, token by
token; against the other two modes at w = 0 and w = 1, bit for bit, through the learner; and the
settings and the missing field are refused with messages that name them.
"""

from __future__ import annotations

import pytest
import torch
from test_trajectories import TURNS, _learn, _model, multi_turn_rows

from rlhf_pipeline.coordination.weights import load_weights, publish_weights
from rlhf_pipeline.files.run_paths import RunPaths
from rlhf_pipeline.learn.settings import LearnerSettings
from rlhf_pipeline.learn.trajectories import (
    TOKEN_ADVANTAGE_KEY,
    join_turns,
    pad_trajectories,
)
from rlhf_pipeline.schema import StoreSchema
from rlhf_pipeline.storage import create_store
from rlhf_pipeline.transforms import GroupAdvantage

pytestmark = pytest.mark.usefixtures("one_torch_thread")
OPTIONAL = ("advantage", "step_advantage", "ref_log_probs", "termination_reason")


def rows_with_both_advantages(seed: int = 0, first_id: int = 0):
    """multi_turn_rows with ``advantage`` one value per trajectory (as the write path stores it) and
    a ``step_advantage`` of its own on every row."""
    rows = multi_turn_rows(TURNS, seed=seed, first_id=first_id)
    g = torch.Generator().manual_seed(seed + 50)
    trajectory = rows["trajectory_id"] - first_id
    whole = torch.randn(len(TURNS), generator=g)[trajectory]
    return rows.with_columns(advantage=whole.to(torch.float32),
                             step_advantage=torch.randn(len(rows), generator=g).to(torch.float32))


def joined_batch(rows, mode: str, weight: float = 0.5):
    turns = torch.tensor(TURNS)
    return pad_trajectories(join_turns(rows, turns, turn_advantage=mode, turn_advantage_weight=weight))


def test_mixed_advantage_on_each_token_equals_the_hand_computation():
    rows = rows_with_both_advantages()
    w = 0.25
    batch = joined_batch(rows, "mixed", w)
    prompt_width = batch["tokens", "prompt"].shape[1]
    response_width = batch["tokens", "response"].shape[1]
    start = 0
    for j, n in enumerate(TURNS):
        turn_rows = range(start, start + n)
        last = start + n - 1
        expected = []  # the learner row's response: r0, then p_s r_s for each later turn s
        for r in turn_rows:
            if int(rows["step"][r]) > 0:
                expected += [0.0] * int(rows["prompt_tokens"].lengths()[r])
            mixed = (1 - w) * float(rows["advantage"][last]) + w * float(rows["step_advantage"][r])
            expected += [mixed] * int(rows["response_tokens"].lengths()[r])
        expected += [0.0] * (response_width - len(expected))
        got = batch["advantage"][j, prompt_width:, 0]
        torch.testing.assert_close(got, torch.tensor(expected), rtol=0, atol=1e-6)
        torch.testing.assert_close(batch[TOKEN_ADVANTAGE_KEY][j, prompt_width:], torch.tensor(expected),
                                   rtol=0, atol=1e-6)
        assert not batch["advantage"][j, :prompt_width].any()  # nothing on the opening prompt
        start += n
    # the premise: the three modes put different numbers on the tokens
    assert not torch.equal(batch["advantage"], joined_batch(rows, "trajectory")["advantage"])
    assert not torch.equal(batch["advantage"], joined_batch(rows, "turn")["advantage"])


def test_the_ends_of_the_weight_are_the_other_two_modes_and_turn_mode_reads_step_advantage():
    rows = rows_with_both_advantages()
    assert torch.equal(joined_batch(rows, "mixed", 0.0)["advantage"], joined_batch(rows, "trajectory")["advantage"])
    assert torch.equal(joined_batch(rows, "mixed", 1.0)["advantage"], joined_batch(rows, "turn")["advantage"])
    # turn mode on a buffer without step_advantage reads each row's advantage, as it always did
    single_field = rows.with_columns(advantage=rows["step_advantage"]).without("step_advantage")
    assert torch.equal(joined_batch(single_field, "turn")["advantage"], joined_batch(rows, "turn")["advantage"])


def test_mixed_needs_step_advantage_and_a_weight_in_zero_to_one():
    rows = multi_turn_rows(TURNS)  # one advantage field only
    with pytest.raises(ValueError, match=r"turn_advantage=mixed .*\(no step_advantage field\).*step_advantage=True"):
        joined_batch(rows, "mixed")
    for weight in (-0.1, 1.5, float("nan"), True):
        with pytest.raises(ValueError, match="turn_advantage_weight must be a number in \\[0, 1\\]"):
            joined_batch(rows_with_both_advantages(), "mixed", weight)
        # nan: refused as every setting that is not a finite number is
        with pytest.raises(ValueError, match="'learner.turn_advantage_weight' must be (a number in \\[0, 1\\]|a finite)"):
            LearnerSettings(turn_advantage="mixed", turn_advantage_weight=weight)
    with pytest.raises(ValueError, match="'learner.turn_advantage' must be one of .*, got 'both'"):
        LearnerSettings(turn_advantage="both")
    LearnerSettings(turn_advantage="mixed", turn_advantage_weight=0.3)


def test_group_advantage_writes_the_step_advantage_beside_the_trajectory_advantage():
    rows = multi_turn_rows(TURNS + TURNS[:1])  # 6 trajectories in 3 groups of 2 (group_id = id // 2)
    rewards = torch.tensor([0.0, 1.0, 0.5, 2.0, -1.0, 0.0, 0.25, 3.0, 1.0, 0.0, 0.5, 1.5, 0.0, 2.0, 1.0])
    rows = rows.with_columns(reward=rewards[:len(rows)])
    both = GroupAdvantage(2, trajectory_return="sum", step_advantage=True).write(rows)
    by_sum = GroupAdvantage(2, trajectory_return="sum").write(rows)
    by_step = GroupAdvantage(2, trajectory_return="step").write(rows)
    assert torch.equal(both["advantage"], by_sum["advantage"])
    assert torch.equal(both["step_advantage"], by_step["advantage"])
    # by hand, the first group (trajectories 0 and 1: 3 + 1 turns): returns 1.5 and 2.0; its turns'
    # rewards 0, 1, 0.5, 2 against their mean 0.875 and unbiased std
    std = torch.tensor([0.0, 1.0, 0.5, 2.0]).std()
    torch.testing.assert_close(both["step_advantage"][:4], (torch.tensor([0.0, 1.0, 0.5, 2.0]) - 0.875) / std)
    torch.testing.assert_close(both["advantage"][:4], torch.tensor([-1, -1, -1, 1]) * 0.5 / (0.5 * 2 ** 0.5))


def _run(path) -> RunPaths:
    paths = RunPaths(path / "run")
    store = create_store(paths.buffer, "memmap", schema=StoreSchema(optional=OPTIONAL), segment_rows=16)
    for s in range(4):
        store.append(rows_with_both_advantages(seed=s, first_id=10 * s))
    store.close()
    publish_weights(paths.root, _model().state_dict(), 0)
    return paths


def test_the_learner_trains_mixed_at_the_weights_ends_exactly_as_the_other_modes(tmp_path):
    runs = {name: (_run(tmp_path / name), changes) for name, changes in (
        ("trajectory", {"turn_advantage": "trajectory"}),
        ("mixed0", {"turn_advantage": "mixed", "turn_advantage_weight": 0.0}),
        ("turn", {"turn_advantage": "turn"}),
        ("mixed1", {"turn_advantage": "mixed", "turn_advantage_weight": 1.0}),
        ("mixed", {"turn_advantage": "mixed", "turn_advantage_weight": 0.5}))}
    losses = {name: [r["losses/loss"] for r in _learn(paths, 2, **changes)] for name, (paths, changes) in runs.items()}
    weights = {name: load_weights(paths.root, 2)[0] for name, (paths, _) in runs.items()}
    for mixed, plain in (("mixed0", "trajectory"), ("mixed1", "turn")):
        assert losses[mixed] == losses[plain]
        assert all(torch.equal(weights[mixed][k], weights[plain][k]) for k in weights[plain])
    assert losses["mixed"] != losses["trajectory"] and losses["mixed"] != losses["turn"]


def test_the_learner_on_a_buffer_without_step_advantage_stops_naming_the_field(tmp_path):
    paths = RunPaths(tmp_path / "run")
    store = create_store(paths.buffer, "memmap", schema=StoreSchema(optional=("advantage", "ref_log_probs",
                                                                              "termination_reason")))
    store.append(multi_turn_rows(TURNS))
    store.close()
    publish_weights(paths.root, _model().state_dict(), 0)
    with pytest.raises(ValueError, match=r"turn_advantage=mixed .*\(no step_advantage field\)"):
        _learn(paths, 1, turn_advantage="mixed")
