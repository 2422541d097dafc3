"""``rlhf-pipeline run pipelines/default.py`` end to end: real processes, real buffer, tiny model.

What a run guarantees is one test over the engines (the ``engine`` fixture: our loop, a vLLM engine
the collector starts, a vLLM server at ``generation.url``), each reading one module run per
engine: rows in whole groups, each holding the log-probs of the version it names, the learner
recomputing them, the weights reaching the engine, rounds going ahead only with the weights the
round before used, a run killed whole resuming to the same rows (with the collector's vLLM engine,
after that engine was killed and restarted: a vLLM start fewer than a run of its own). What only one
engine has is a test of its own: the loop's progress bar on a terminal, a server of another shape
refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import needs_peft, run_child_pids, run_on_terminal, screen_lines
import preloaded
from process_tree import tree, wait_gone

from rlhf_pipeline.coordination.weights import load_weights, published_versions
from rlhf_pipeline.generation import SamplingConfig, teacher_forced_log_probs
from rlhf_pipeline.learn.metrics import read_metrics
from rlhf_pipeline.models import char_tokenizer, tiny_causal_lm
from rlhf_pipeline.pipeline import PipelineError
from rlhf_pipeline.runs.run import run_command
from rlhf_pipeline.storage import open_buffer
from rlhf_pipeline.coordination.weights import latest_version

REPO = Path(__file__).resolve().parents[2]
DEFAULT = str(REPO / "pipelines" / "default.py")
# a short run's settings, which tests/integration/test_s3_buffers.py's runs take
SMALL = ["--set", "warm_start_steps=5", "--set", "prompts_per_round=4", "--set", "group_size=4",
         "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
         "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=2"]


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=timeout)


def assert_whole_groups_with_normalized_advantages(run: Path) -> None:
    """Rows were written, whole groups of 4, advantages normalized within each group."""
    with open_buffer(run / "buffer", mode="r") as store:
        assert len(store) >= 16 and len(store) % 4 == 0
        rows = store.read(torch.arange(len(store)))
    for group in rows["group_id"].unique():
        in_group = rows["group_id"] == group
        assert int(in_group.sum()) == 4
        adv, reward = rows["advantage"][in_group], rows["reward"][in_group]
        assert abs(float(adv.mean())) < 1e-4
        if float(reward.std()) > 1e-6:
            assert float(adv.std()) == pytest.approx(1.0, abs=1e-3)
        else:
            assert torch.all(adv == 0)


def test_bad_settings_fail_before_any_work(tmp_path):
    with pytest.raises(PipelineError, match=r"'learner.sample_window' \(8\) must be >= batch_size \(64\)"):
        run_command("run", pipeline_path=DEFAULT, home=str(tmp_path), overrides=["learner.sample_window=8"])
    assert not (tmp_path / "default").exists()

    bad_reward = tmp_path / "bad_reward.py"
    bad_reward.write_text(Path(DEFAULT).read_text().replace(
        'rewards = {"toy": toy_reward}', 'rewards = {"toy": lambda prompts, completions, **_: [0.0]}'))
    with pytest.raises(PipelineError, match="reward 'toy' returned 1 values for 8 completions"):
        run_command("run", pipeline_path=str(bad_reward), home=str(tmp_path / "new" / "home"))
    assert not (tmp_path / "new").exists()  # nor the --home it made for the run


def test_a_kl_penalty_on_rows_without_reference_log_probs_is_refused_before_anything_is_written(tmp_path):
    """The default pipeline stores no reference log-probs: the learner's loss refused
    ``learner.loss.kl_coef=0.05`` with a traceback at its first step, once the run had started."""
    result = cli("run", DEFAULT, "--home", str(tmp_path), "--run-name", "kl", "--set", "learner.loss.kl_coef=0.05",
                 timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.startswith("rlhf-pipeline run: error: setting 'learner.loss.kl_coef' is 0.05: a KL penalty "
                                    "needs reference log-probs in every row"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "row_fields: advantage)" in result.stderr
    assert not (tmp_path / "kl").exists()
    with pytest.raises(PipelineError, match="'learner.loss.kl_coef' is 0.1: a KL penalty needs reference log-probs"):
        run_command("learn", pipeline_path=DEFAULT, home=str(tmp_path), overrides=["learner.loss.kl_coef=0.1"])
    assert not (tmp_path / "default").exists()


def test_a_run_with_the_epoch_sampler_is_refused_before_anything_is_written(tmp_path):
    """Its learner snapshot the new, empty buffer and died with a traceback ("holds no rows: there is
    nothing to replay"); an epoch walks recorded rows, which ``replay`` and ``learn`` over a run are for."""
    with pytest.raises(PipelineError, match=r"^setting 'learner.sampler' is 'epoch'.*use `rlhf-pipeline replay`"):
        run_command("run", pipeline_path=DEFAULT, home=str(tmp_path), overrides=["learner.sampler=epoch"])
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(("setting", "says"), [
    ("learner.data_timeout_s=1", "waited 1s for 64 rows not yet trained on in"),
    ("learner.sampler=epoch", "holds no rows: there is nothing to replay"),
], ids=["data-timeout", "epoch-of-nothing"])
def test_a_learner_without_rows_stops_in_one_line(tmp_path, setting, says):
    """``learn`` with no collector: the learner's own, clear words came at the end of a traceback."""
    result = cli("learn", DEFAULT, "--home", str(tmp_path), "--steps", "1", "--set", "warm_start_steps=5",
                 "--set", setting, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("rlhf-pipeline learn: error: ") and says in error, result.stderr[-3000:]


def test_an_initial_policy_that_is_not_finite_is_never_published(tmp_path):
    """A warm start that diverged: version 0 was published with NaN weights, the collector stopped at
    its first decoding step advising a smaller ``learner.lr``, and ``run`` said the learner's checkpoint
    would resume the run: none of it applied."""
    result = cli("run", DEFAULT, "--home", str(tmp_path), "--run-name", "nan", "--steps", "2",
                 "--set", "warm_start_steps=20", "--set", "warm_start_lr=1e20", timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("rlhf-pipeline run: error: the initial policy the pipeline's make_policy() built is "
                            "not finite ("), result.stderr[-3000:]
    assert "holds nan or inf): nothing was published or trained" in error and "warm_start_lr" in error
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "nan" / "weights").exists() and not (tmp_path / "nan" / "checkpoints").exists()
    # the corrected command under the same name starts the run: it was refused, the refused start's settings
    # recorded as the run's ("other settings ... Resume with the same settings (--set warm_start_lr=1e+20)")
    corrected = cli("run", DEFAULT, "--home", str(tmp_path), "--run-name", "nan", "--steps", "2",
                    "--set", "warm_start_steps=20", timeout=300)
    assert corrected.returncode == 0, corrected.stderr[-3000:]
    assert json.loads((tmp_path / "nan" / "settings.json").read_text())["warm_start_lr"] == 3e-3


@needs_peft
def test_lora_targets_the_model_lacks_are_refused_before_anything_is_published(tmp_path):
    """They were found by the learner's setup after version 0 was published and the collectors had
    started: a traceback from peft, and a round of rows written for nothing."""
    result = cli("run", DEFAULT, "--home", str(tmp_path), "--run-name", "lora", "--steps", "2",
                 "--set", "warm_start_steps=5", "--set", "learner.lora.rank=4",
                 "--set", "learner.lora.target_modules=q_proj,qproj", timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("rlhf-pipeline run: error: setting 'learner.lora.target_modules' names ['qproj'], which "
                            "no linear layer of the model is called; its linear layers: ["), result.stderr[-3000:]
    assert error.endswith("nothing was published or trained") and "'v_proj'" in error
    run = tmp_path / "lora"
    # nothing built with those settings is kept, so the corrected command under the same name starts the run
    assert not (run / "weights").exists() and not (run / "settings.json").exists()
    with open_buffer(run / "buffer", mode="r") as buffer:
        assert len(buffer) == 0


@pytest.mark.parametrize("steps", [["--steps", "0"], ["--steps", "-5"], ["--set", "steps=0"]])
def test_steps_below_one_are_refused_before_anything_is_written(tmp_path, steps):
    result = cli("run", DEFAULT, "--home", str(tmp_path), "--run-name", "none", *steps, timeout=120)
    assert result.returncode != 0
    assert "must be >= 1, got" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_mean_reward_rises(tmp_path):
    """GRPO raises the toy task's mean reward over the default run's 300 learner steps (~1 min).

    Collector and learner are separate processes, so which policy version writes which rows
    depends on timing and no two runs are alike. Over 60 steps the rise (first vs last 15)
    was +0.005 to +0.07, too close to its noise to assert; over 300 steps the first 30 vs
    the last 30 rose by +0.071, +0.096 and +0.089 in three runs.
    """
    result = cli("run", DEFAULT, "--home", str(tmp_path), "--run-name", "learn", timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [r["charts/reward_mean"] for r in read_metrics(tmp_path / "learn" / "metrics.jsonl")]
    assert len(rewards) == 300
    first, last = sum(rewards[:30]) / 30, sum(rewards[-30:]) / 30
    assert last > first + 0.03, (first, last)



# ============================================================ over engines: loop | vllm | url
# head size 32 (num_heads=2), which vLLM's CPU attention takes; every engine runs the same model
# rounds of 8 rows, 16 taken per step: two rounds share a version, so the second may go ahead
ENGINE_RUN = ["--set", "warm_start_steps=20", "--set", "prompts_per_round=2", "--set", "group_size=4",
              "--set", "learner.batch_size=16", "--set", "learner.sample_window=32",
              "--set", "learner.new_rows_per_step=16", "--set", "learner.checkpoint_every=4"]
NUM_HEADS = ["--set", "num_heads=2"]
EVALUATING = ["--set", "eval.every_steps=1", "--set", "eval.max_prompts=2"]
STEPS = 4


def pipeline_model(num_heads: int = 2):
    """The default pipeline's model shape (``--set num_heads=2``); its weights are the run's to send."""
    tok = char_tokenizer()
    return tiny_causal_lm(len(tok), hidden_size=64, num_layers=2, num_heads=num_heads, pad_token_id=tok.pad_token_id,
                          eos_token_id=tok.eos_token_id, seed=123), tok


def engine_command(engine, home: Path, name: str = "run", heads: list[str] = NUM_HEADS) -> list[str]:
    return [sys.executable, "-m", "rlhf_pipeline.cli.main", "run", DEFAULT, "--steps", str(STEPS), "--home", str(home),
            "--run-name", name, *ENGINE_RUN, *heads, *engine.settings(*pipeline_model())]


@pytest.fixture(scope="module")
def engine_run(engine, tmp_path_factory):
    """A finished 4-step run of the default pipeline generating with ``engine``: (run dir, its stderr).
    With the loop, on a terminal as a user starts it (its stderr then: all the terminal received), which
    test_run_writes_rows_trains_and_logs reads."""
    home = tmp_path_factory.mktemp(f"run-{engine.name}")
    if engine.name == "loop":
        code, shown = run_on_terminal(engine_command(engine, home), cwd=REPO, timeout=900)
        assert code == 0, shown.decode(errors="replace")[-4000:]
        return home / "run", shown.decode(errors="replace")
    result = preloaded.run(engine_command(engine, home), cwd=REPO, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    return home / "run", result.stderr


@pytest.mark.parametrize("engine", ["loop"], indirect=True)
def test_run_writes_rows_trains_and_logs(engine_run):
    run, output = engine_run
    lines = screen_lines(output.encode())
    assert f"[run] done: {STEPS} learner steps" in output
    # the learner draws its bar on the terminal, beside the collector's lines
    assert any(line.startswith("learner: 100%") for line in lines), lines
    # nothing said that is not ours to say (issue 33): transformers' deprecation of the cache's old
    # name at the collector's start, a leaked semaphore at the end; no line glued to the bar
    assert "deprecated" not in output and "leaked semaphore" not in output, output
    assert all(line.startswith("[collector]") for line in lines if "[collector]" in line), lines

    # the learner took its steps, published weights and checkpointed, with its rewind record
    # (learn/checkpoint.py): where the buffer stood, readable without torch (a checkpoint at a stop
    # between learner.checkpoint_every steps: test_launcher_signals.py)
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert all(r["charts/rows"] == 16 and r["losses/grad_norm"] >= 0 for r in records)
    assert latest_version(run) == STEPS
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004.json", "step_00000004.pt"]
    assert any((run / "tensorboard").iterdir())
    assert (run / "STOP").exists()  # the collector was told to stop, and did (run returned)


def test_rows_are_whole_groups_with_advantages_normalized_within_each(engine_run):
    run, _ = engine_run
    assert_whole_groups_with_normalized_advantages(run)
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("terminated", "truncated"))
    assert bool((rows["terminated"] ^ rows["truncated"]).all())


def test_the_learner_recomputes_the_samplers_log_probs_at_version_0(engine_run):
    run, _ = engine_run
    records = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    # step 1 learns from rows of version 0 with the weights of version 0: only float noise apart
    assert records[0]["losses/sampler_logprob_diff_max"] < 1e-4
    # later steps see stale rows (the importance ratio's job): apart, but by a policy step's worth
    assert all(0 <= r["losses/sampler_logprob_diff_max"] < 0.5 for r in records)


def test_every_row_holds_the_log_probs_of_the_version_it_names(engine_run):
    """Each row's log-probs are its version's sampling distribution, where that version is still
    published: a row naming the wrong version, or sampled on a stale head or prefix cache, fails this."""
    run, _ = engine_run
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)))
    versions = rows["policy_version"]
    assert int(versions.min()) == 0 and int(versions.max()) >= 1  # rows sampled after weights were swapped
    model, _ = pipeline_model()
    checked = set()
    for version in published_versions(run):
        picked = torch.nonzero(versions == version).flatten()
        if not len(picked):
            continue
        model.load_state_dict(load_weights(run, version)[0])
        prompts, responses = rows["prompt_tokens"].index(picked), rows["response_tokens"].index(picked)
        with torch.no_grad():
            again = teacher_forced_log_probs(model, prompts, responses, SamplingConfig(temperature=1.0))
        stored = rows["response_log_probs"].index(picked)
        assert float((again.values - stored.values).abs().max()) < 1e-5, f"version {version}"
        checked.add(version)
    assert len(checked) >= 2  # version 0 and at least one swapped in


@pytest.mark.parametrize("engine", ["vllm", "url"], indirect=True)
def test_each_version_reaches_the_engine_in_place_and_is_timed(engine, engine_run):
    """A vLLM engine (ours or a server at a URL) takes each version in place: never restarted for it;
    the server at a URL is the user's, so nothing of ours started there."""
    run, stderr = engine_run
    rounds = read_metrics(run / "collector" / "metrics-0000.jsonl")
    assert rounds[-1]["weight_updates"] >= 2 and any(r["weight_update_s"] > 0 for r in rounds)
    assert [r["policy_version"] for r in rounds] == sorted(r["policy_version"] for r in rounds)
    assert rounds[-1]["policy_version"] >= 1
    if engine.name == "url":
        assert "engine_starts" not in rounds[-1]
        return
    assert all(r["engine_starts"] == 1 for r in rounds)  # no restart to change weights
    assert stderr.count("the vllm generation engine started in") == 1
    assert "Writing model shards" not in stderr and "leaked semaphore" not in stderr


def test_rounds_go_ahead_only_with_the_weights_the_round_before_them_used(engine_run):
    """The next round goes to the engine while this round's tail decodes when pacing gives it the same
    weights (``coordination/pacing.py``). With rounds of 8 rows and 16 taken per step, two rounds share
    a version: the second goes ahead, the one after a version is due waits and loads it."""
    run, _ = engine_run
    rounds = read_metrics(run / "collector" / "metrics-0000.jsonl")
    ahead = [r for r in rounds if r["submitted_ahead"]]
    assert ahead and rounds[0]["submitted_ahead"] == 0.0  # some rounds went ahead, not the first
    # a round went ahead only with the version the round before it used
    assert all(rounds[k]["policy_version"] == rounds[k - 1]["policy_version"]
               for k in range(1, len(rounds)) if rounds[k]["submitted_ahead"])
    assert len({r["policy_version"] for r in rounds}) > 1  # and versions changed between rounds


def _rows(run: Path) -> dict[str, list]:
    with open_buffer(run / "buffer", mode="r") as store:
        rows = store.read(torch.arange(len(store)), fields=("trajectory_id", "policy_version", "response_tokens",
                                                             "response_log_probs"))
    return {"trajectory_id": rows["trajectory_id"].tolist(), "policy_version": rows["policy_version"].tolist(),
            "tokens": [t.tolist() for t in rows["response_tokens"].to_list()],
            "log_probs": [t.tolist() for t in rows["response_log_probs"].to_list()]}


def _engines_of(pid: int) -> list[int]:
    """The vLLM servers ``pid`` started (its children running vLLM's API server)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and b"vllm.entrypoints.openai.api_server" in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _same_rows(run: Path, reference: Path) -> None:
    """``run``'s buffer holds ``reference``'s rows (as far as both go; at least what the learner took
    in): the same tokens, log-probs to 1e-5 and policy versions, every trajectory once."""
    got, plain = _rows(run), _rows(reference)
    starts = [t for i, t in enumerate(got["trajectory_id"]) if i == 0 or t != got["trajectory_id"][i - 1]]
    assert starts == list(range(len(starts)))  # every trajectory once, in order: none lost, none twice
    shared = min(len(got["tokens"]), len(plain["tokens"]))
    assert shared >= STEPS * 16  # at least the rows the learner took in (learner.new_rows_per_step=16)
    for key in ("trajectory_id", "policy_version", "tokens"):
        assert got[key][:shared] == plain[key][:shared], key
    assert max(abs(a - b) for x, y in zip(got["log_probs"][:shared], plain["log_probs"][:shared])
               for a, b in zip(x, y, strict=True)) < 1e-5


def _kill_the_engine_as_the_collector_starts_writing(run: subprocess.Popen, log: Path, home: Path,
                                                    deadline: float) -> dict:
    """kill -9 of the collector's vLLM engine (not of the run) once it holds version 0, as the collector
    starts writing. The engine's process group as it was then.

    The learner is held (SIGSTOP) from the run's start until the kill: a round takes tens of milliseconds and
    the whole run about a second, so at a high load the kill could land rounds later, or after the run
    ended (CI saw it land during the restart's pause). Held so, the collector has written at most its
    first round when its engine dies (it waits for the learner to take that round in), and the run is
    still to finish."""
    # once the run directory is said, weights version 0 is published (the learner prepares the run:
    # held before, it would hold the whole run) and the engine is still starting (tens of seconds)
    while run.poll() is None and time.monotonic() < deadline and "[run] run directory" not in log.read_text():
        time.sleep(0.005)
    learner = run_child_pids("learn", str(home), "run")
    assert len(learner) == 1, log.read_text()[-3000:]
    os.kill(learner[0], signal.SIGSTOP)
    try:
        while run.poll() is None and time.monotonic() < deadline and "[collector] writing to" not in log.read_text():
            time.sleep(0.005)
        engines = [e for c in run_child_pids("collect", str(home), "run") for e in _engines_of(c)]
        assert len(engines) == 1, log.read_text()[-3000:]
        group = tree(engines[0])  # the server's group: its engine core, the watcher
        os.kill(engines[0], signal.SIGKILL)
    finally:
        os.kill(learner[0], signal.SIGCONT)
    return group


def _rounds_recorded(rounds: Path) -> list[dict]:
    """The collector's round records so far (a line still being written has no newline yet)."""
    if not rounds.exists():
        return []
    return [json.loads(line) for line in rounds.read_text().split("\n")[:-1] if line.strip()]


def test_a_run_killed_whole_resumes_to_the_rows_of_the_uninterrupted_run(engine, engine_run, tmp_path):
    """kill -9 of the whole run (its process group: launcher, collector, learner and, with the loop,
    the evaluator) after the collector's second round leaves nothing of the run: no process of it nor
    of a process group it made (a vLLM engine of the collector's runs in a session of its own). The
    same command again resumes it: the buffer holds the uninterrupted run's rows, the same tokens,
    log-probs to 1e-5 and policy versions, every round once, and starts one engine.

    With the collector's own vLLM engine, that engine is killed first (kill -9 of its process, not the
    run's) as the collector starts writing: the collector says so once with the cause and starts a new
    engine with the weights the dead one held, and nothing of the dead engine's group outlives it; the
    rows the run goes on to write are the uninterrupted run's too (the kill mid-round with a collector
    in the test's process is test_vllm_engine.py's)."""
    reference, _ = engine_run
    run = tmp_path / "run"
    rounds = run / "collector" / "metrics-0000.jsonl"
    # with the loop, an evaluator child too (`eval RUN --follow`): it must not outlive the run either
    command = engine_command(engine, tmp_path) + (EVALUATING if engine.name == "loop" else [])
    with open(tmp_path / "first.log", "w") as log:
        first = preloaded.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group, to kill it whole
    started, killed_engine = {}, {}
    try:
        deadline = time.monotonic() + 600  # a bound on a hang: a vLLM engine starts in tens of seconds
        if engine.name == "vllm":
            killed_engine = _kill_the_engine_as_the_collector_starts_writing(first, tmp_path / "first.log",
                                                                            tmp_path, deadline)
        # two rounds, with vLLM the last of them sampled by the restarted engine (the first may have been
        # written before the kill, while the learner was held)
        while first.poll() is None and time.monotonic() < deadline and not (
                len(recorded := _rounds_recorded(rounds)) >= 2
                and (engine.name != "vllm" or recorded[-1].get("engine_restarts") == 1)):
            time.sleep(0.05)
        # stopped at once, so that the run cannot train on to its last step while its processes are
        # listed (at a low load its learner could, and the kill then missed the run it must interrupt)
        os.killpg(first.pid, signal.SIGSTOP)
        started = tree(first.pid)
        engines = [e for c in run_child_pids("collect", str(tmp_path), "run") for e in _engines_of(c)]
        evaluators = run_child_pids("eval", str(tmp_path), "run")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    out = (tmp_path / "first.log").read_text()
    assert first.returncode == -signal.SIGKILL, out[-3000:]  # killed, not finished or failed
    assert len(engines) == (1 if engine.name == "vllm" else 0), out[-3000:]
    assert len(evaluators) == (1 if engine.name == "loop" else 0), out[-3000:]
    assert {*engines, *evaluators} <= {pid for pid, _ in started}
    assert all(group == pid for (pid, _), group in started.items() if pid in engines)  # each a group of its own
    assert not wait_gone(started), "a process of the killed run outlived it"
    steps = len(read_metrics(run / "metrics.jsonl")) if (run / "metrics.jsonl").exists() else 0
    assert steps < STEPS
    if engine.name == "vllm":  # the engine killed first: one restart, said once with its cause
        assert not wait_gone(killed_engine), "a process of the killed engine's group outlived its restart"
        died = [line for line in out.splitlines() if "the vllm generation engine died" in line]
        assert len(died) == 1 and died[0].startswith("[collector] the vllm generation engine died (its "), out[-4000:]
        assert "killed by SIGKILL" in died[0] and "restart 1 of at most 5 in a row" in died[0]
        last = read_metrics(rounds)[-1]  # the last round of the first start came after the restart
        assert (last["engine_restarts"], last["engine_starts"]) == (1, 2)

    resumed = preloaded.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert resumed.stderr.count("the vllm generation engine started in") == (1 if engine.name == "vllm" else 0)
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, STEPS + 1))
    _same_rows(run, reference)


@pytest.mark.parametrize("engine", ["url"], indirect=True)
def test_a_server_of_another_shape_is_refused_in_one_line_before_any_row(engine, tmp_path):
    result = preloaded.run(engine_command(engine, tmp_path, "refused", heads=[]), cwd=REPO, capture_output=True,
                           text=True, timeout=900)  # num_heads=4: the server's model has 2
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "generation.url:" in line]
    assert len(lines) == 1 and "num_attention_heads=2" in lines[0] and "num_attention_heads=4" in lines[0], \
        result.stderr[-3000:]
    buffer = tmp_path / "refused" / "buffer"
    if buffer.exists():
        with open_buffer(buffer, mode="r") as store:
            assert len(store) == 0
