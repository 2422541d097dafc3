"""``rlhf-pipeline run pipelines/tool_use.py`` end to end: a collector of multi-turn calculator episodes
and a learner as real processes, a real buffer, a tiny model, nothing downloaded.

What a run guarantees is one test over the engines (the ``engine`` fixture: our loop, a vLLM engine
the collector starts, a vLLM server at ``generation.url``, each turn sent as the conversation's
token ids so far), each reading one module run per engine; a collector killed mid-run resumes with
every trajectory once and whole, with our loop and at a URL. What only the vLLM engine has is a test of
its own."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from agent_run_checks import check_every_turn_holds_its_versions_log_probs
from helpers import kill_when, run_child_pids
import preloaded
from process_tree import tree, wait_gone

from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import char_tool_tokenizer, tiny_causal_lm
from rlhf_pipeline.schema import TerminationReason
from rlhf_pipeline.storage import open_buffer

REPO = Path(__file__).resolve().parents[2]
TOOL_USE = str(REPO / "pipelines" / "tool_use.py")
SMALL = ["--set", "warm_start_steps=20", "--set", "warm_start_check_tasks=0", "--set", "learner.batch_size=16", "--set", "learner.new_rows_per_step=16",
         "--set", "learner.sample_window=32", "--set", "log_rounds_every=1"]


@pytest.mark.parametrize(("setting", "message"), [
    ("group_size=1", "'group_size' must be >= 2"),
    ("context_length=100", "'context_length' (100) leaves no room"),
    ("warm_start_tool_fraction=1.5", "'warm_start_tool_fraction' must be in [0, 1]"),
    ("warm_start_target=2", "'warm_start_target' must be in [0, 1], got 2.0"),
    ("warm_start_more_stages=-1", "'warm_start_more_stages' must be >= 0, got -1"),
    ("init_weights=/no/such/weights.pt", "'init_weights': '/no/such/weights.pt' is not a file"),
])
def test_bad_settings_fail_before_any_process_starts(tmp_path, setting, message):
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", TOOL_USE, "--home", str(tmp_path),
                             "--set", setting], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr[-2000:]
    assert not any(tmp_path.iterdir())  # nothing created


@pytest.mark.parametrize("given", ["not-torch", "another-model"])
def test_init_weights_that_are_not_this_models_state_dict_are_one_line_of_run(tmp_path, given):
    """Read in the learner's preparation, after the run directory is made: a file torch.save did not
    write, or another model's weights, were torch's traceback and a second line of `run`'s."""
    import torch

    init = tmp_path / "init.pt"
    if given == "not-torch":
        init.write_text("not a state dict")
    else:
        torch.save({"other.weight": torch.zeros(2)}, init)
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", TOOL_USE, "--home", str(tmp_path),
                            "--steps", "2", "--set", f"init_weights={init}"], cwd=REPO, capture_output=True, text=True,
                           timeout=180)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"rlhf-pipeline run: error: setting 'init_weights': {init} "), last
    assert re.search("is not a file torch.save wrote" if given == "not-torch" else
                     r"holds the weights of another model \([1-9]\d* missing weights .*\), 1 unexpected weights "
                     r"\(e\.g\. \['other\.weight'\]\)\)", last), last
    assert not list((tmp_path / "tool_use" / "weights").glob("policy_*"))  # no version 0 published


def test_a_batch_of_several_rounds_does_not_stall(tmp_path):
    """Issue 32: one-turn episodes (16 rows a round) and a batch of 48 rows, three rounds, with the
    then default two rounds per policy version: the collector waited for new weights after two
    rounds, the learner for the third round's rows, until the learner gave up (data_timeout_s)."""
    command = [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", TOOL_USE, "--steps", "1", "--home", str(tmp_path),
               "--run-name", "wide", "--set", "warm_start_steps=0", "--set", "max_turns=1",
               "--set", "max_new_tokens=12", "--set", "learner.batch_size=48", "--set", "learner.new_rows_per_step=48",
               "--set", "learner.sample_window=96", "--set", "learner.data_timeout_s=120", "--set", "log_rounds_every=0"]
    result = preloaded.run(command, cwd=REPO, capture_output=True, text=True, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "wide" / "metrics.jsonl")] == [1]
    rounds = read_metrics(tmp_path / "wide" / "collector" / "metrics-0000.jsonl")
    assert all(r["rows_written"] == 16 for r in rounds)
    # three rounds with version 0 for the first batch: all that the learner's first draw needed
    assert [r["policy_version"] for r in rounds][:3] == [0, 0, 0]


@pytest.mark.parametrize(("tokenizer_change", "message"), [
    ("tokenizer.chat_template = None", "the tokenizer has no chat template"),
    ("tokenizer.chat_template = CHAT_TEMPLATE", "cannot render a conversation of the roles user, assistant, tool: "
                                                "TemplateError: unknown chat role: tool"),
])
def test_a_tokenizer_whose_template_cannot_render_episodes_is_refused_before_anything_is_made(
        tmp_path, tokenizer_change, message):
    """It failed inside the warm start, with transformers' or Jinja's traceback, after the run
    directory was made (issue 33)."""
    from rlhf_pipeline.pipeline import PipelineError
    from rlhf_pipeline.runs.run import run_command

    pipeline = tmp_path / "own_tokenizer.py"
    pipeline.write_text(Path(TOOL_USE).read_text().replace(
        "    tokenizer = char_tool_tokenizer()\n",
        "    from rlhf_pipeline.models.tiny import CHAT_TEMPLATE\n\n"
        f"    tokenizer = char_tool_tokenizer()\n    {tokenizer_change}\n"))
    with pytest.raises(PipelineError, match=message):
        run_command("learn", pipeline_path=str(pipeline), home=str(tmp_path / "home"), steps=1,
                    overrides=["warm_start_steps=1"])
    assert not (tmp_path / "home" / "own_tokenizer").exists()  # no run directory, no warm start



def test_a_head_size_vllms_cpu_attention_does_not_take_is_refused_before_anything_is_made(tmp_path):
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", TOOL_USE, "--home", str(tmp_path),
                             "--set", "generation.engine=vllm", "--set", "num_heads=4"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "this model's is 16 (hidden_size 64 / num_heads 4): add --set num_heads=2" in result.stderr
    assert not any(tmp_path.iterdir())  # nothing created


# ============================================================ over engines: loop | vllm | url
NUM_HEADS = ["--set", "num_heads=2"]  # head size 32, which vLLM's CPU attention takes; every engine the same model
STEPS = 4  # with no round past the last step's batch, 3 steps may sample every turn with version 0


def tool_use_model():
    """The tool-use pipeline's model shape (``--set num_heads=2``); the weights are the run's to send."""
    tok = char_tool_tokenizer()
    return tiny_causal_lm(len(tok), hidden_size=64, num_layers=2, num_heads=2, max_position_embeddings=384,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, seed=123), tok


def engine_command(engine, home: Path, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", TOOL_USE, "--home", str(home), "--run-name", name,
            *SMALL, *NUM_HEADS, *engine.settings(*tool_use_model()), *extra]


# the warm start's greedy check after each stage and one more stage below the target: the learner's, before
# any engine samples, so the loop's run alone has them (test_run_trains_on_whole_multi_turn_trajectories)
WARM_START_CHECKED = ["--set", "warm_start_check_tasks=8", "--set", "warm_start_more_stages=1"]


@pytest.fixture(scope="module")
def engine_run(engine, tmp_path_factory):
    """A finished 4-step run of the tool-use pipeline generating with ``engine``: (run dir, the finished
    ``run`` with its stdout and stderr)."""
    home = tmp_path_factory.mktemp(f"tools-{engine.name}")
    checked = WARM_START_CHECKED if engine.name == "loop" else []
    result = preloaded.run(engine_command(engine, home, "tools", "--steps", str(STEPS), *checked), cwd=REPO,
                           capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"[run] done: {STEPS} learner steps" in result.stderr
    return home / "tools", result


@pytest.mark.parametrize("engine", ["loop"], indirect=True)
def test_run_trains_on_whole_multi_turn_trajectories(engine_run):
    """Also: the warm start's greedy check is printed after each stage, before RL starts; below the
    target another stage runs, and below the usable bar the run warns (20 + 10 steps teach at most
    the call's format)."""
    run, result = engine_run
    stdout, stderr = result.stdout, result.stderr
    stages = [line for line in stdout.splitlines() if line.startswith("[run] warm start: ")]
    assert len(stages) == 2, stdout[-2000:]  # the first stage, then one more below the target
    assert stages[0].startswith("[run] warm start: 20 steps, loss ") and "; greedy on 8 tasks: tool calls " in stages[0]
    assert stages[0].endswith("right factors 0/8, exact answers 0/8; below the target 90% right factors: 10 steps more")
    assert stages[1].startswith("[run] warm start: 10 steps, loss ") and stages[1].endswith("exact answers 0/8")
    warning = stderr.index("[run] warning: the warm start called with the question's factors in 0% of the tasks")
    assert warning < stderr.index("[collector] writing to")
    assert "raise warm_start_steps or warm_start_more_stages" in stderr
    assert "tool-call rate" in stderr  # the collector's per-round line
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, STEPS + 1))

    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)))
    by_trajectory: dict[int, list[int]] = {}
    for i, t in enumerate(rows["trajectory_id"].tolist()):
        by_trajectory.setdefault(t, []).append(i)
    for idx in by_trajectory.values():  # whole trajectories only, each contiguous and in step order
        assert idx == list(range(idx[0], idx[0] + len(idx)))
        assert rows["step"][idx].tolist() == list(range(len(idx)))
        assert rows["done"][idx].tolist() == [False] * (len(idx) - 1) + [True]
        assert TerminationReason(int(rows["termination_reason"][idx[-1]])) is not TerminationReason.NOT_ENDED
        assert len(set(rows["advantage"][idx].tolist())) == 1  # the trajectory's advantage on every turn
    assert max(len(idx) for idx in by_trajectory.values()) >= 2  # tool calls made episodes of several turns
    groups = torch.tensor([int(rows["group_id"][idx[0]]) for idx in by_trajectory.values()])
    assert set(torch.unique(groups, return_counts=True)[1].tolist()) == {4}  # whole groups of group_size

    rounds = read_metrics(run / "collector" / "metrics-0000.jsonl")
    assert rounds and all(r["rows_written"] == r["rows"] for r in rounds)
    assert all(0 <= r["tool_call_rate"] <= 1 and r["template_mismatch"] == 0 for r in rounds)
    assert sum(r["tools/calls"] for r in rounds) > 0


@pytest.mark.parametrize("engine", ["vllm", "url"], indirect=True)
def test_every_turn_holds_the_log_probs_of_the_version_it_names_in_its_whole_trajectory(engine, engine_run):
    """Each trajectory rebuilt from its rows (as the learner does) and scored as one sequence by the
    version its rows name: the stored log-probs of every turn, later turns in the context of the
    earlier ones, to 1e-5. A prompt re-tokenized on the way to the engine (token in, token out through
    a server too), a turn sampled on a stale prefix cache or head, or a row naming the wrong version
    fails this. Not with our loop: its 4-step run samples every row with versions 0 and 1 before the
    learner is done, and version 1's weights are pruned by then (the newest 3 are kept), so one version
    is left to score; the loop's turns are checked where it samples them
    (``tests/agents/test_rollout.py``, a real model's rollout stores exactly what it sampled)."""
    run, _ = engine_run
    check_every_turn_holds_its_versions_log_probs(run)


def test_whole_trajectories_and_whole_groups_reach_the_buffer(engine_run):
    run, _ = engine_run
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("trajectory_id", "group_id", "step", "done",
                                                            "termination_reason", "terminated", "truncated"))
    trajectory = rows["trajectory_id"].tolist()
    starts = [i for i in range(len(trajectory)) if i == 0 or trajectory[i] != trajectory[i - 1]]
    for a, b in zip(starts, [*starts[1:], len(trajectory)], strict=True):
        assert rows["step"][a:b].tolist() == list(range(b - a))
        assert rows["done"][a:b].tolist() == [False] * (b - a - 1) + [True]
        assert TerminationReason(int(rows["termination_reason"][b - 1])) is not TerminationReason.NOT_ENDED
    groups = torch.tensor([int(rows["group_id"][i]) for i in starts])
    assert set(torch.unique(groups, return_counts=True)[1].tolist()) == {4}  # group_size episodes each


def test_the_learner_recomputes_the_samplers_log_probs_at_version_0(engine_run):
    run, result = engine_run
    assert "tool-call rate" in result.stderr  # the collector's per-round line, with every engine
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # step 1 learns from rows of version 0 with the weights of version 0: float noise apart
    assert records[0]["losses/sampler_logprob_diff_max"] < 1e-4


@pytest.mark.parametrize("engine", ["vllm"], indirect=True)
def test_the_engine_starts_once_and_counts_the_prompt_tokens_it_was_sent(engine, engine_run):
    run, result = engine_run
    stderr = result.stderr
    rounds = read_metrics(run / "collector" / "metrics-0000.jsonl")
    assert all(r["engine_starts"] == 1 for r in rounds)  # weights change in place, no restart
    assert rounds[-1]["weight_updates"] >= 2 and any(r["weight_update_s"] > 0 for r in rounds)
    assert [r["policy_version"] for r in rounds] == sorted(r["policy_version"] for r in rounds)
    assert stderr.count("the vllm generation engine started in") == 1
    # each turn is sent as the whole episode so far and counted; these episodes (~130 tokens) seldom fill a
    # 128-token KV block before their last turn, so few come from the prefix cache (test_vllm_rollout.py
    # shows the hits, on longer conversations)
    assert all(r["prompt_tokens"] > 0 and 0 <= r["prefix_cached_tokens"] <= r["prompt_tokens"] for r in rounds)


def _engine_children(parent: int) -> list[int]:
    """The vLLM servers ``parent`` started (their command line runs vLLM's API server)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"vllm.entrypoints.openai.api_server" in command:
            found.append(int(entry.name))
    return found


@pytest.mark.parametrize("engine", ["loop", "url"], indirect=True)
def test_a_collector_killed_mid_run_resumes_with_every_trajectory_once_and_whole(engine, tmp_path):
    """kill -9 of the collector process stops the run; the same command resumes it: the buffer holds every
    trajectory the collector handed out exactly once, whole, in the order of its ids.

    Not with the collector's own vLLM engine (two vLLM starts and two runs for no check of its own): its
    rows take the path of the server at a URL (the engine is that client of a server it started); that
    its server's whole group ends with the process that owns it is test_vllm_engine.py's
    test_an_engine_whose_collector_is_killed_leaves_no_process_of_its_server, and that a run killed with
    its collector resumes with one new engine to the same rows is test_default_pipeline.py's
    test_a_run_killed_whole_resumes_to_the_rows_of_the_uninterrupted_run."""
    command = engine_command(engine, tmp_path, "crash", "--set", "log_rounds_every=0")
    run = tmp_path / "crash"
    rounds_file = run / "collector" / "metrics-0000.jsonl"
    engines: list[int] = []
    started: dict = {}  # the collector's process tree

    def collector_with_rounds() -> bool:
        if not (rounds_file.exists() and len(read_metrics(rounds_file)) >= 3):
            return False
        for pid in run_child_pids("collect", str(tmp_path), "crash"):
            engines.extend(_engine_children(pid))
            started.update(tree(pid))
        return True

    first = preloaded.Popen([*command, "--steps", "40"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    out = kill_when(first, collector_with_rounds, victims=lambda: run_child_pids("collect", str(tmp_path), "crash"),
                    wait_s=300)
    assert first.returncode != 0 and "ended early (was killed by SIGKILL" in out, out[-3000:]
    assert not engines, engines  # a server at a URL is the user's: the collector started none
    assert not wait_gone(started), "a process of the collector outlived it"
    stopped_at = read_metrics(run / "metrics.jsonl")[-1]["step"] if (run / "metrics.jsonl").exists() else 0

    resumed = preloaded.run([*command, "--steps", str(stopped_at + 2)], cwd=REPO, capture_output=True, text=True,
                            timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("trajectory_id", "group_id", "step", "done"))
    trajectory, step, done = rows["trajectory_id"].tolist(), rows["step"].tolist(), rows["done"].tolist()
    starts = [i for i in range(len(trajectory)) if i == 0 or trajectory[i] != trajectory[i - 1]]
    # each trajectory one contiguous run of rows, the ids 0, 1, 2, ... without a gap or a repeat
    assert [trajectory[i] for i in starts] == list(range(len(starts)))
    for a, b in zip(starts, [*starts[1:], len(trajectory)], strict=True):
        assert step[a:b] == list(range(b - a)) and done[a:b] == [False] * (b - a - 1) + [True]
    assert [int(rows["group_id"][i]) for i in starts] == [k // 4 for k in range(len(starts))]
