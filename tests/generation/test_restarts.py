"""When a dead engine is started again (``vllm_http.Retries``): what needs no engine. The kill -9
of a real vLLM engine mid-round: ``test_vllm_engine.py``; of a whole run's engine:
``tests/integration/test_default_pipeline.py``."""

from __future__ import annotations

import pytest

from rlhf_pipeline.generation import EngineDied, EngineFailed
from rlhf_pipeline.generation.settings import GenerationSettings, check_generation
from rlhf_pipeline.generation.vllm_http import MAX_RESTART_DELAY_S, Retries
from rlhf_pipeline.processes import exit_status

DIED = EngineDied("the vLLM engine died: its process exited (killed by SIGKILL) while sample; its log ends:\nOOM",
                  cause="its process exited (killed by SIGKILL) while sample")


def test_restarts_back_off_doubling_up_to_a_bound_and_give_up_naming_the_setting():
    restarts = Retries(retries=9, backoff_s=2.0)
    delays = [restarts.next_restart_delay_s(DIED) for _ in range(9)]
    assert delays == [2.0, 4.0, 8.0, 16.0, 32.0, MAX_RESTART_DELAY_S, MAX_RESTART_DELAY_S, MAX_RESTART_DELAY_S, MAX_RESTART_DELAY_S]
    with pytest.raises(EngineFailed, match=r"(?s)after 9 restarts in a row \(generation.retries=9; raise it.*"
                                           r"killed by SIGKILL.*OOM"):
        restarts.next_restart_delay_s(DIED, engine="vllm")


def test_an_answered_call_starts_a_new_run_of_restarts():
    restarts = Retries(retries=2, backoff_s=1.0)
    assert [restarts.next_restart_delay_s(DIED), restarts.next_restart_delay_s(DIED)] == [1.0, 2.0]
    restarts.answered()  # a round went through: a death a day later is not the third in a row
    assert restarts.in_a_row == 0 and restarts.next_restart_delay_s(DIED) == 1.0


def test_no_restarts_means_the_first_death_stops_the_collector():
    with pytest.raises(EngineFailed, match=r"died and is not restarted \(generation.retries=0"):
        Retries(retries=0).next_restart_delay_s(DIED)


@pytest.mark.parametrize(("setting", "value"), [("retries", -1), ("backoff_s", -0.5),
                                                ("backoff_s", float("nan")), ("timeout_s", 0.0)])
def test_bad_restart_settings_are_refused_by_name(setting, value):
    with pytest.raises(ValueError, match=f"setting 'generation.{setting}' must be (>|a finite number)"):
        check_generation(GenerationSettings(engine="vllm", **{setting: value}))


def test_exit_status_names_the_signal():
    assert exit_status(-9) == "killed by SIGKILL" and exit_status(1) == "exit code 1"
