"""``plot``: PNG charts of runs' learner metrics (``metrics.jsonl``), runs overlaid.

One PNG per chart plus ``overview.png``; raw values faint, a moving average solid. Replays are
left out of the staleness chart (a chart of their recorded versions instead); a branch is drawn
from its branch step on (a dotted line), and a resume that changed the training settings is a dashed
line at its step. A run evaluated on held-out sets (``eval/metrics.jsonl``) gets one chart per
evaluation, ``eval_<name>.png``: its ``pass@1``, ``pass@k`` and ``mean_score`` beside the training
reward on the same learner-step axis, so a training reward that rises while the held-out score stays
flat shows at a glance. Design: docs/architecture.md#rows-in-and-out.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlhf_pipeline.dataio.extras import require
from rlhf_pipeline.files.log_parts import json_records, read_log_lines
from rlhf_pipeline.files.run_paths import local_run_path
from rlhf_pipeline.files.run_store import LocalRunStore


@dataclass(frozen=True)
class Chart:
    name: str  # file name without .png
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]  # (metric key, label); the first solid, the others dashed, dotted...
    runs: str = "all"  # which runs it draws: "all", "live" (runs that generate) or "replay"
    needs: tuple[str, ...] = ()  # keys of which a run must have a point to be drawn (an evaluation's scores)

    def draws(self, run: RunMetrics) -> bool:
        return self.runs in ("all", run.kind) and (
            not self.needs or any(_series(run.records, key) is not None for key in self.needs))


@dataclass(frozen=True)
class RunMetrics:
    kind: str  # "live" or "replay"
    records: list[dict]
    branch_step: int | None = None  # a branch (``rlhf-pipeline branch``): the parent's step it started from
    lead_in: list[dict] = field(default_factory=list)
    """A branch drawn beside its parent: its records before the branch step (the parent's, which the
    parent draws). Not drawn; they only seed the moving average of ``records``."""
    resumed_at: tuple[int, ...] = ()  # steps after which a resume trained with other settings (settings_history)


CHARTS: tuple[Chart, ...] = (
    Chart("reward", "Reward", "mean reward", (("charts/reward_mean", "mean"),)),
    Chart("kl", "KL", "KL estimate", (("losses/kl", "to reference"), ("losses/approx_kl_old", "to sampler"))),
    Chart("response_length", "Response length", "tokens", (("charts/response_length_mean", "mean"),)),
    Chart("clip_fraction", "Clip fractions", "fraction of tokens",
          (("losses/clip_frac_low", "low"), ("losses/clip_frac_high", "high"))),
    Chart("staleness", "Staleness", "policy versions behind",
          (("charts/staleness_mean", "mean"), ("charts/staleness_max", "max")), runs="live"),
    Chart("row_versions", "Recorded policy versions (replay)", "policy version of the rows",
          (("charts/row_version_min", "min"), ("charts/row_version_max", "max")), runs="replay"),
    Chart("throughput", "Throughput", "tokens / s", (("charts/tokens_per_s", "learner"),)),
    # multi-turn runs only (learn/trajectories.py logs these): how long the trained conversations are,
    # and how many trajectories a step trained against how many a masked termination reason left out
    Chart("turns", "Turns per trajectory", "model turns", (("charts/turns_per_trajectory_mean", "mean"),)),
    Chart("trajectories", "Trajectories per step", "trajectories",
          (("charts/trajectories", "trained"), ("charts/trajectories_masked", "masked out"))),
    # agent collectors' rounds (collector/metrics-KKKK.jsonl), by the policy version that generated them
    Chart("tool_calls", "Tool calls (collectors, by policy version)", "per episode / per call",
          (("collector/tool_call_rate", "episodes calling a tool"), ("collector/tool_error_rate", "failed calls"))),
    Chart("episode_turns", "Turns per episode (collectors, by policy version)", "model turns",
          (("collector/turns_per_episode", "mean"),)),
)


EVAL_SUMMARY = re.compile(r"^eval/(?P<name>.+)/(?P<stat>pass@\d+|mean_score)$")
"""The evaluator's summaries charted (``evaluation/scores.py``): the scores, not the counts."""


def eval_charts(data: dict[str, RunMetrics]) -> list[Chart]:
    """One chart per evaluation the runs logged: its scores beside the training reward."""
    found: dict[str, set[str]] = {}
    for run in data.values():
        for record in run.records:
            for key in record:
                if (m := EVAL_SUMMARY.match(key)) is not None:
                    found.setdefault(m["name"], set()).add(key)
    charts = []
    for name, keys in sorted(found.items()):
        ordered = sorted(keys, key=lambda k: (k.endswith("mean_score"), k))  # pass@1, pass@k, then mean_score
        # a run evaluated on other sets only would add its training reward alone
        charts.append(Chart(f"eval_{name}", f"Held-out {name} beside the training reward", "score / mean reward",
                            (("charts/reward_mean", "training reward"),
                             *((key, f"held-out {key.rsplit('/', 1)[1]}") for key in ordered)), needs=tuple(ordered)))
    return charts


def eval_records(run: Path) -> list[dict]:
    """The evaluator's summary lines of ``run`` (``eval/metrics.jsonl``), keyed by the learner step that
    published each version evaluated; none for a run evaluated on no held-out set."""
    path = run / "eval" / "metrics.jsonl"
    return read_metrics(path) if run.is_dir() and path.is_file() else []


class NotMetricsError(ValueError):
    """A file given as a run's metrics that holds no metrics record."""


def read_metrics(path: Path) -> list[dict]:
    """The records of a ``metrics.jsonl`` (``files/log_parts.json_records``); a file with lines and
    not one learner record among them is no run's metrics: :class:`NotMetricsError`."""
    lines = [line for line in read_log_lines(LocalRunStore(path.parent), path.name) if line.strip()]
    records = [r for r in json_records(lines) if "step" in r]
    if lines and not records:
        raise NotMetricsError(f"{path} is not a run's metrics.jsonl: none of its {len(lines)} lines is a learner "
                              f"metrics record (a JSON object with a step); give a run directory")
    return records


def collector_records(run: Path) -> list[dict]:
    """Agent collectors' round metrics (``collector/metrics-KKKK.jsonl``), averaged per policy
    version over rounds and collectors, as records whose ``step`` is that version: a learner that
    publishes every step makes it the step whose weights generated the rounds. Collectors that
    log no tool metrics (single-turn ones) give none."""
    sums: dict[int, dict[str, float]] = {}
    for path in sorted((run / "collector").glob("metrics-*.jsonl")) if run.is_dir() else []:
        for record in read_metrics(path):  # an empty file (a collector that wrote no round yet) has none
            if "tool_call_rate" not in record or "policy_version" not in record:
                continue
            acc = sums.setdefault(int(record["policy_version"]), {"rounds": 0.0, "calls": 0.0, "failed": 0.0,
                                                                  "tool_call_rate": 0.0, "turns_per_episode": 0.0})
            acc["rounds"] += 1
            acc["tool_call_rate"] += float(record["tool_call_rate"])
            acc["turns_per_episode"] += float(record.get("turns_per_episode", 0.0))
            acc["calls"] += float(record.get("tools/calls", 0.0))
            acc["failed"] += float(record.get("tools/calls", 0.0)) - float(record.get("tools/ok", 0.0))
    out = []
    for version, acc in sorted(sums.items()):
        record = {"step": version, "collector/tool_call_rate": acc["tool_call_rate"] / acc["rounds"],
                  "collector/turns_per_episode": acc["turns_per_episode"] / acc["rounds"]}
        if acc["calls"]:
            record["collector/tool_error_rate"] = acc["failed"] / acc["calls"]
        out.append(record)
    return out


def run_kind(run: Path) -> str:
    """"replay" for a run made by ``rlhf-pipeline replay``, else "live"."""
    settings = (run if run.is_dir() else run.parent) / "settings.json"
    try:
        return "replay" if "replay" in json.loads(settings.read_text()) else "live"
    except (OSError, ValueError, TypeError):
        return "live"  # a bare metrics.jsonl, or settings unreadable: charted as generated


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Legend names: the directory names, with the parent's added where two would be equal."""
    names = [p.resolve().name for p in run_dirs]
    return [f"{p.resolve().parent.name}/{n}" if names.count(n) > 1 else n for p, n in zip(run_dirs, names)]


def smooth(values: list[float], weight: float) -> list[float]:
    """TensorBoard's debiased exponential moving average."""
    out, last, norm = [], 0.0, 0.0
    for v in values:
        last = weight * last + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out.append(last / norm)
    return out


def load_runs(run_dirs: list[str | Path]) -> dict[str, RunMetrics]:
    """Each run's metrics to draw, by legend label (see the module docstring for branches)."""
    from rlhf_pipeline.files.run_paths import cache_dir, is_url
    from rlhf_pipeline.runs.lineage import read_parent

    runs = [Path(local_run_path(run, "RUN")) for run in run_dirs]
    resolved = {run.resolve() for run in runs}
    data = {}
    for run, label in zip(runs, run_labels(runs)):
        metrics = run / "metrics.jsonl" if run.is_dir() else run
        if not metrics.is_file():
            from rlhf_pipeline.storage.backends import runs_inside

            if runs := runs_inside(str(run)):  # `plot storage`: the runs it holds are what to give
                raise FileNotFoundError(f"{run} is a directory of runs, not a run: give those to draw, e.g. "
                                        f"{' '.join(str(run / name) for name in runs[:3])}")
            raise FileNotFoundError(f"{run} has no metrics.jsonl (is it a run directory? the learner writes it)")
        records = read_metrics(metrics) + collector_records(run) + eval_records(run)
        parent = read_parent(run) if run.is_dir() else None
        step = int(parent["step"]) if parent else None
        lead_in = []
        if parent is not None:
            label = f"{label} (branch at step {step})"
            drawn_as = cache_dir(parent["parent"]) if is_url(parent["parent"]) else Path(parent["parent"]).resolve()
            if drawn_as in resolved:  # the parent draws the steps before (a parent at a URL: from its cache)
                lead_in = [r for r in records if r["step"] < step]
                records = [r for r in records if r["step"] >= step]
        data[label] = RunMetrics(run_kind(run), records, step, lead_in, _resumed_at(run, step or 0))
    return data


def _resumed_at(run: Path, since: int) -> tuple[int, ...]:
    """The steps after which ``run`` was resumed with other training settings, past ``since``; none
    where its history is damaged (``inspect RUN`` says so)."""
    from rlhf_pipeline.files.run_store import LocalRunStore
    from rlhf_pipeline.files.settings_history import history_entries
    from rlhf_pipeline.files.state_files import StateFileError

    if not run.is_dir():
        return ()
    try:
        return tuple(sorted({entry["after_step"] for entry in history_entries(LocalRunStore(run))
                             if entry["after_step"] > since}))
    except StateFileError:
        return ()


def plot_runs(run_dirs: list[str | Path], out_dir: str | Path) -> list[Path]:
    """Writes the charts of ``run_dirs`` into ``out_dir``; returns the PNG paths written."""
    data = load_runs(run_dirs)  # read first: a path that is no run's metrics is reported with or without the extra
    matplotlib = require("matplotlib", "plot")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    drawn = charts_to_draw(data)
    earlier = _earlier_charts(out)  # read once: the refusal and the clean-up after drawing both go by it
    _refuse_files_not_plotted(out, [f"{chart.name}.png" for chart in drawn] + ["overview.png"] * bool(drawn), earlier)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for chart in drawn:
        fig = chart_figure(chart, data)
        path = out / f"{chart.name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    if drawn:
        cols = 3 if len(drawn) > 4 else 2
        rows = math.ceil(len(drawn) / cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.9 * rows), dpi=100, squeeze=False)
        for ax, chart in zip(axes.flat, drawn):
            _draw(ax, chart, data, colors, compact=True)
        for ax in list(axes.flat)[len(drawn):]:
            ax.axis("off")
        fig.tight_layout()
        path = out / "overview.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    _replace_earlier_plot(out, written, run_dirs, earlier or [])
    return written


PLOT_RECORD = "plot.json"
"""What the last ``plot`` into a directory drew there: its runs and its charts."""


def _earlier_charts(out: Path) -> list[str] | None:
    """The charts the last plot into ``out`` wrote, by its record (none when there is no record); None when
    a ``plot.json`` there is not a plot's record."""
    try:
        earlier = json.loads((out / PLOT_RECORD).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        return None
    charts = earlier.get("charts") if isinstance(earlier, dict) else None
    if not isinstance(charts, list) or not all(isinstance(name, str) for name in charts):
        return None
    return charts


def _refuse_files_not_plotted(out: Path, names: list[str], earlier: list[str] | None) -> None:
    """Refuses, before any chart is written, to replace a file of ``out`` that no earlier plot wrote there:
    a user's own ``reward.png`` or ``plot.json`` is theirs, not a chart to draw again. ``earlier``: what
    :func:`_earlier_charts` read there."""
    taken = [name for name in (*names, PLOT_RECORD) if (out / name).exists()
             and (earlier is None or (name not in earlier and name != PLOT_RECORD))]
    if taken:
        them = "it" if len(taken) == 1 else "them"
        foreign_record = "; this one is not a plot's" if earlier is None else ""
        raise FileExistsError(
            f"--out {out} holds {', '.join(taken)}, which no earlier plot wrote there (the {PLOT_RECORD} beside "
            f"its charts names them{foreign_record}): plot would replace {them}; choose another directory or "
            f"move {them}")


def _replace_earlier_plot(out: Path, written: list[Path], run_dirs: list[str | Path], earlier: list[str]) -> None:
    """Removes the charts an earlier plot into ``out`` wrote and this one did not (an evaluation chart of
    runs not drawn now read as these runs'), by its record only: no other file of ``out`` is touched."""
    drawn = sorted(path.name for path in written)
    for name in earlier:
        if name not in drawn and name == Path(name).name and name.endswith(".png"):
            (out / name).unlink(missing_ok=True)
    (out / PLOT_RECORD).write_text(json.dumps({"runs": [str(run) for run in run_dirs], "charts": drawn}, indent=1)
                                   + "\n", encoding="utf-8")


def charts_to_draw(data: dict[str, RunMetrics]) -> list[Chart]:
    """The charts of which some run has a point: the fixed ones, then one per evaluation."""
    return [c for c in (*CHARTS, *eval_charts(data))
            if any(c.draws(r) and _series(r.records, key) for r in data.values() for key, _ in c.series)]


def chart_figure(chart: Chart, data: dict[str, RunMetrics]) -> Any:
    """``chart`` of the runs ``data`` as a matplotlib figure of its own (the plot extra)."""
    require("matplotlib", "plot").use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
    _draw(ax, chart, data, plt.rcParams["axes.prop_cycle"].by_key()["color"])
    fig.tight_layout()
    return fig


SMOOTHING = 0.8  # TensorBoard's slider; a curve of fewer than SMOOTHED_FROM points is drawn raw
SMOOTHED_FROM = 10


def curve(run: RunMetrics, key: str) -> tuple[list[int], list[float], list[float] | None] | None:
    """``run``'s points of ``key`` to draw: (steps, raw values, moving average or None when too few
    points to smooth), the average seeded with the run's lead-in; None when it has no such point."""
    series = _series(run.records, key)
    if series is None:
        return None
    steps, values = series
    lead_in = (_series(run.lead_in, key) or ([], []))[1]
    if len(lead_in) + len(values) < SMOOTHED_FROM:
        return steps, values, None
    return steps, values, smooth(lead_in + values, SMOOTHING)[len(lead_in):]


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]] | None:
    points = [(r["step"], float(r[key])) for r in records
              if isinstance(r.get(key), (int, float)) and math.isfinite(float(r[key]))]
    if not points:
        return None
    steps, values = zip(*points)
    return list(steps), list(values)


def _draw(ax, chart: Chart, data: dict[str, RunMetrics], colors: list[str], compact: bool = False) -> None:
    several_series = len(chart.series) > 1
    for i, (label, run) in enumerate(data.items()):
        color = colors[i % len(colors)]  # by position among all runs: a run keeps its colour across charts
        if not chart.draws(run):
            continue
        for j, (key, series_label) in enumerate(chart.series):
            points = curve(run, key)
            if points is None:
                continue
            steps, values, smoothed = points
            style = ("-", "--", ":", "-.")[j % 4]
            name = f"{label} ({series_label})" if several_series else label
            if smoothed is not None:
                ax.plot(steps, values, style, color=color, alpha=0.2, linewidth=0.8)
                ax.plot(steps, smoothed, style, color=color, linewidth=1.5, label=name)
            else:
                ax.plot(steps, values, style, color=color, marker="o", markersize=3, linewidth=1.5, label=name)
        if run.branch_step is not None:
            ax.axvline(run.branch_step, color=color, linestyle=":", linewidth=1)
        for step in run.resumed_at:
            ax.axvline(step, color=color, linestyle="--", linewidth=0.8, alpha=0.6)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.set_title(chart.title, fontsize=10 if compact else 11)
    ax.set_xlabel("learner step", fontsize=8 if compact else 9)
    ax.set_ylabel(chart.ylabel, fontsize=8 if compact else 9)
    ax.tick_params(labelsize=7 if compact else 8)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=6 if compact else 7, loc="best")
