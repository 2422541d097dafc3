"""``plot``: PNG charts of runs' metrics, several runs overlaid."""

from __future__ import annotations

import json
import sys

import pytest
import preloaded

from rlhf_pipeline.cli.main import main
from rlhf_pipeline.dataio.extras import MissingExtraError, require
from rlhf_pipeline.dataio.plots import CHARTS as CHARTS_DRAWN
from rlhf_pipeline.dataio.plots import RunMetrics, collector_records, read_metrics, run_labels, smooth

CHARTS = {"reward", "kl", "response_length", "clip_fraction", "staleness", "throughput", "overview"}


def test_plot_writes_one_png_per_chart_for_overlaid_runs(tiny_run, tmp_path, capsys):
    image = pytest.importorskip("matplotlib.image")
    second = tmp_path / "other" / "tiny"  # same name as the first run: the legend tells them apart
    second.mkdir(parents=True)
    records = read_metrics(tiny_run / "metrics.jsonl")
    with open(second / "metrics.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps({**record, "charts/reward_mean": record["charts/reward_mean"] + 0.5}) + "\n")
        f.write('{"step": 4, "charts/rew')  # a line torn by a kill: skipped
    out = tmp_path / "charts"
    assert main(["plot", str(tiny_run), str(second), "--out", str(out)]) == 0
    assert {p.stem for p in out.glob("*.png")} == CHARTS
    for png in out.glob("*.png"):
        pixels = image.imread(png)
        assert pixels.shape[0] > 200 and pixels.shape[1] > 300
        assert pixels[..., :3].std() > 0.01  # something was drawn
    assert run_labels([tiny_run, second]) == [f"{tiny_run.parent.name}/tiny", "other/tiny"]


def test_plot_errors_name_what_is_missing(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "charts")]) == 2
    assert "has no metrics.jsonl" in capsys.readouterr().err
    for name in ("b", "a"):  # `plot storage`, the directory of runs: its runs are named
        (tmp_path / "home" / name / "buffer").mkdir(parents=True)
    assert main(["plot", str(tmp_path / "home"), "--out", str(tmp_path / "charts")]) == 2
    assert (f"{tmp_path / 'home'} is a directory of runs, not a run: give those to draw, e.g. {tmp_path / 'home' / 'a'} "
            f"{tmp_path / 'home' / 'b'}") in capsys.readouterr().err
    # a run's metrics, read before the extra is asked for: without it, the one line says how to install it
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "charts/reward_mean": 0.5}) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the extra were not installed
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "charts")]) == 2
    assert "pip install -e '.[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "charts").exists()


def test_missing_extra_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(MissingExtraError, match=r"reading Parquet needs the optional package 'pyarrow'; install it "
                                                r"with `pip install -e '.\[data\]'`"):
        require("pyarrow", "reading Parquet")


def test_smoothing_is_debiased_and_follows_a_constant():
    assert smooth([2.0, 2.0, 2.0], 0.8) == pytest.approx([2.0, 2.0, 2.0])
    assert smooth([0.0, 1.0], 0.5)[1] == pytest.approx(2 / 3)


def test_a_file_that_is_not_a_runs_metrics_is_one_line_error(tmp_path, capsys):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    text = tmp_path / "notes.txt"
    text.write_text("not json\n{\"no\": \"step\"}\n")
    for path in (binary, text):
        assert main(["plot", str(path), "--out", str(tmp_path / "charts")]) == 2
        err = capsys.readouterr().err
        assert f"{path} is not a run's metrics.jsonl" in err and len(err.strip().splitlines()) == 1, err


def test_a_replay_gets_its_recorded_versions_charted_instead_of_staleness(tiny_run, tmp_path):
    """A replay's own version counter starts again while its rows keep the recording's versions:
    its 'staleness' runs from -150 to +300 and means nothing; the rows' versions do."""
    pytest.importorskip("matplotlib")
    replay = tmp_path / "replay"
    replay.mkdir()
    (replay / "settings.json").write_text(json.dumps({"seed": 0, "replay": {"source": "storage/default/buffer"}}))
    with open(replay / "metrics.jsonl", "w") as f:
        for step in range(1, 21):
            f.write(json.dumps({"step": step, "charts/reward_mean": 0.5, "charts/staleness_mean": step - 150.0,
                                "charts/staleness_max": step + 300.0, "charts/row_version_min": 10.0 + step,
                                "charts/row_version_max": 300.0}) + "\n")
    assert main(["plot", str(replay), "--out", str(tmp_path / "alone")]) == 0
    assert {p.stem for p in (tmp_path / "alone").glob("*.png")} == {"reward", "row_versions", "overview"}
    # beside a live run: the staleness chart is the live run's alone
    assert main(["plot", str(tiny_run), str(replay), "--out", str(tmp_path / "both")]) == 0
    assert {p.stem for p in (tmp_path / "both").glob("*.png")} == CHARTS | {"row_versions"}
    staleness = next(c for c in CHARTS_DRAWN if c.name == "staleness")
    assert staleness.draws(RunMetrics("live", [])) and not staleness.draws(RunMetrics("replay", []))


def test_a_multi_turn_run_gets_its_turns_and_trajectories_charted(tiny_run, tmp_path):
    """Charts of the multi-turn learner's metrics, drawn for runs that log them and only then."""
    image = pytest.importorskip("matplotlib.image")
    agent = tmp_path / "agent"
    agent.mkdir()
    with open(agent / "metrics.jsonl", "w") as f:
        for step in range(1, 16):
            f.write(json.dumps({"step": step, "charts/reward_mean": 0.1 * step, "charts/trajectories": 12.0,
                                "charts/trajectories_masked": float(step % 3), "charts/turns_per_trajectory_mean":
                                2.0 + 0.1 * step}) + "\n")
    (agent / "collector").mkdir()
    for collector in range(2):  # two collectors' rounds, two rounds per policy version each
        with open(agent / "collector" / f"metrics-{collector:04d}.jsonl", "w") as f:
            for step in range(1, 31):
                f.write(json.dumps({"step": step, "policy_version": (step - 1) // 2, "tool_call_rate": 0.5 + collector / 4,
                                    "turns_per_episode": 1.5, "tools/calls": 8.0, "tools/ok": 6.0 + collector}) + "\n")
    records = collector_records(agent)
    assert [r["step"] for r in records] == list(range(15))
    assert records[0]["collector/tool_call_rate"] == 0.625 and records[0]["collector/tool_error_rate"] == 3 / 16
    assert collector_records(tiny_run) == []  # a single-turn collector logs no tool metrics
    assert main(["plot", str(agent), str(tiny_run), "--out", str(tmp_path / "both")]) == 0
    assert {p.stem for p in (tmp_path / "both").glob("*.png")} == CHARTS | {"turns", "trajectories", "tool_calls",
                                                                          "episode_turns"}
    assert image.imread(tmp_path / "both" / "turns.png")[..., :3].std() > 0.01
    assert main(["plot", str(tiny_run), "--out", str(tmp_path / "single")]) == 0  # a single-turn run: none
    assert not (tmp_path / "single" / "turns.png").exists()


def test_a_branch_curve_continues_its_parents_moving_average(tmp_path):
    """A branch plotted beside its parent is drawn from its branch step; its moving average goes on
    from the parent's there instead of starting again at that one (noisy) point."""
    from rlhf_pipeline.dataio.plots import curve, load_runs

    parent, branch = tmp_path / "parent", tmp_path / "branch"
    parent.mkdir()
    branch.mkdir()
    reward = {step: 0.1 * (step % 3) for step in range(1, 21)}
    reward[10] = 5.0  # an outlier at the branch step: the average there is far from this value
    lines = [json.dumps({"step": step, "charts/reward_mean": value}) + "\n" for step, value in reward.items()]
    (parent / "metrics.jsonl").write_text("".join(lines))
    # a branch's metrics are its parent's lines up to the branch step, then its own
    own = [json.dumps({"step": step, "charts/reward_mean": 0.3}) + "\n" for step in range(11, 21)]
    (branch / "metrics.jsonl").write_text("".join(lines[:10] + own))
    (branch / "branch.json").write_text(json.dumps({"parent": str(parent), "step": 10}))

    drawn = load_runs([parent, branch])
    parent_steps, _, parent_average = curve(drawn["parent"], "charts/reward_mean")
    steps, values, average = curve(drawn["branch (branch at step 10)"], "charts/reward_mean")
    assert steps[0] == 10 and values[0] == 5.0  # the raw points are the branch's from its step on
    assert average[0] == pytest.approx(parent_average[parent_steps.index(10)])
    assert average[0] < 2.0  # not the raw outlier, where a restarted average would begin


@pytest.mark.slow
def test_a_runs_held_out_scores_are_charted_beside_its_training_reward_on_the_same_steps(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    from pathlib import Path

    from rlhf_pipeline.dataio.plots import chart_figure, charts_to_draw, load_runs

    repo = Path(__file__).resolve().parents[2]
    settings = ["warm_start_steps=5", "prompts_per_round=4", "group_size=4", "learner.batch_size=16",
                "learner.sample_window=32", "learner.new_rows_per_step=16", "eval.every_steps=2", "eval.samples=2",
                "eval.temperature=1.0", "eval.max_prompts=8"]
    result = preloaded.run([sys.executable, "-m", "rlhf_pipeline.cli.main", "run", str(repo / "pipelines" / "default.py"),
                             "--steps", "4", "--home", str(tmp_path), "--run-name", "r",
                             *[word for item in settings for word in ("--set", item)]],
                           cwd=repo, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "r"
    assert main(["plot", str(run), "--out", str(tmp_path / "charts")]) == 0
    assert (tmp_path / "charts" / "eval_held_out-k2-t1-n8.png").is_file()
    # a run without evaluations plotted into the same directory: the earlier plot's evaluation chart read
    # as this run's, and stayed; it goes now, by the record the plot keeps, and nothing else of the directory
    (tmp_path / "charts" / "mine.png").write_bytes(b"a file of the user's own")
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in read_metrics(run / "metrics.jsonl")))
    assert main(["plot", str(plain), "--out", str(tmp_path / "charts")]) == 0
    assert sorted(p.name for p in (tmp_path / "charts").iterdir()) == sorted(
        [f"{name}.png" for name in CHARTS] + ["mine.png", "plot.json"])
    assert json.loads((tmp_path / "charts" / "plot.json").read_text())["runs"] == [str(plain)]
    assert main(["plot", str(run), "--out", str(tmp_path / "charts")]) == 0

    data = load_runs([run])
    (chart,) = [c for c in charts_to_draw(data) if c.name.startswith("eval_")]
    lines = {line.get_label(): line for line in chart_figure(chart, data).axes[0].get_lines()}
    learner = read_metrics(run / "metrics.jsonl")
    evaluated = read_metrics(run / "eval" / "metrics.jsonl")
    drawn = {label: (list(line.get_xdata()), list(line.get_ydata())) for label, line in lines.items()}
    assert drawn["r (training reward)"] == ([r["step"] for r in learner], [r["charts/reward_mean"] for r in learner])
    for stat in ("pass@1", "pass@2", "mean_score"):
        key = f"eval/held_out-k2-t1-n8/{stat}"
        assert drawn[f"r (held-out {stat})"] == ([0, 2, 4], [r[key] for r in evaluated])  # the same step axis
    assert [r["step"] for r in evaluated] == [0, 2, 4]
    # beside a run not evaluated on that set: the chart is the evaluated run's alone (the other added its
    # training reward, a line with no held-out score to read it against)
    both = load_runs([run, plain])
    (chart,) = [c for c in charts_to_draw(both) if c.name.startswith("eval_")]
    assert {line.get_label() for line in chart_figure(chart, both).axes[0].get_lines()} == set(lines)
    reward = next(c for c in charts_to_draw(both) if c.name == "reward")
    assert {line.get_label() for line in chart_figure(reward, both).axes[0].get_lines()} == {"r", "plain"}


def test_a_resume_with_other_training_settings_is_marked_at_its_step(tmp_path):
    """A run resumed with another learning rate at step 4 and back to its first at 8 (settings_history.json):
    each chart draws a dashed line at those steps, where its curves may bend for it."""
    pytest.importorskip("matplotlib")
    from rlhf_pipeline.dataio.plots import chart_figure, load_runs

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "charts/reward_mean": 0.1 * step}) + "\n"
                                               for step in range(1, 13)))
    entries = [{"after_step": 4, "settings": {"learner.lr": 0.01}}, {"after_step": 8, "settings": {}}]
    (run / "settings_history.json").write_text(json.dumps({"format": 1, "entries": entries}))
    drawn = load_runs([run])
    assert [data.resumed_at for data in drawn.values()] == [(4, 8)]
    figure = chart_figure(CHARTS_DRAWN[0], drawn)
    assert [line.get_xdata()[0] for line in figure.axes[0].lines if line.get_linestyle() == "--"] == [4, 8]
    (run / "settings_history.json").write_text("damaged")  # inspect says so; the charts are drawn without marks
    assert [data.resumed_at for data in load_runs([run]).values()] == [()]


def test_an_out_named_like_an_image_is_refused_before_a_directory_of_that_name_is_made(tiny_run, tmp_path, capsys):
    """plot draws several charts into a directory: ``--out chart.png`` would have made a directory called
    chart.png holding them."""
    out = tmp_path / "chart.png"
    assert main(["plot", str(tiny_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out is the directory plot writes its charts into" in err and f"--out {tmp_path / 'chart'}" in err, err
    assert not out.exists()


def test_a_file_of_the_users_named_like_a_chart_is_refused_and_kept_and_plots_own_charts_are_drawn_again(
        tiny_run, tmp_path, capsys):
    """plot replaces the charts an earlier plot wrote into ``--out`` (its ``plot.json`` names them), never a
    file it did not write: a ``reward.png`` of the user's own, or a ``plot.json`` that is not its record."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "charts"
    out.mkdir()
    (out / "reward.png").write_bytes(b"the user's own chart")
    (out / "notes.txt").write_text("the user's notes")
    assert main(["plot", str(tiny_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} holds reward.png, which no earlier plot wrote there" in err and "move it" in err, err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "reward.png"]  # nothing drawn, nothing replaced
    assert (out / "reward.png").read_bytes() == b"the user's own chart"

    (out / "reward.png").unlink()
    assert main(["plot", str(tiny_run), "--out", str(out)]) == 0
    drawn = {p.stem for p in out.glob("*.png")}
    assert drawn == CHARTS
    before = (out / "reward.png").read_bytes()
    (out / "reward.png").write_bytes(b"an older drawing")  # a chart the last plot wrote: drawn again
    assert main(["plot", str(tiny_run), "--out", str(out)]) == 0
    assert (out / "reward.png").read_bytes() == before

    (out / "plot.json").write_text('{"my": "settings"}')  # not a plot's record: none of the charts is known as its
    assert main(["plot", str(tiny_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "plot.json" in err and "this one is not a plot's" in err, err
    assert (out / "plot.json").read_text() == '{"my": "settings"}'
