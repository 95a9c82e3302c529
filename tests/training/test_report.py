"""The end-of-run report: grouping and plotted data against the log history, files, HTML, errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import posttrain.training.report as report_module
from posttrain.errors import DataError
from posttrain.training.report import (
    Series,
    display_name,
    load_log_history,
    metric_groups,
    plot_group,
    sample_completions,
    save_plots,
    write_report,
)

NAN = float("nan")

# A GRPO-like run with evaluation, a DPO-style rewards/* pair, an SFT accuracy and its eval twin, and the final
# summary row the Trainer appends. grad_norm is NaN at step 2 and missing at step 3; rewards/accuracy/std is None.
HISTORY = [
    {
        "loss": 2.5,
        "grad_norm": 4.0,
        "learning_rate": 1e-05,
        "reward": 0.25,
        "reward_std": 0.5,
        "kl": 0.0,
        "rewards/accuracy/mean": 0.25,
        "rewards/accuracy/std": 0.5,
        "completions/mean_length": 31.5,
        "completions/clipped_ratio": 0.0,
        "clip_ratio/region_mean": 0.0,
        "entropy": 1.75,
        "mean_token_accuracy": 0.125,
        "note": "warmup",
        "epoch": 0.25,
        "step": 1,
    },
    {
        "loss": 2.25,
        "grad_norm": NAN,
        "learning_rate": 7.5e-06,
        "reward": 0.5,
        "reward_std": 0.375,
        "kl": 0.125,
        "rewards/accuracy/mean": 0.5,
        "rewards/accuracy/std": None,
        "completions/mean_length": 28.0,
        "completions/clipped_ratio": 0.125,
        "clip_ratio/region_mean": 0.0625,
        "entropy": 1.5,
        "epoch": 0.5,
        "step": 2,
    },
    {
        "eval_loss": 2.0,
        "eval_reward": 0.5,
        "eval_runtime": 1.5,
        "eval_samples_per_second": 8.0,
        "eval_steps_per_second": 2.0,
        "epoch": 0.5,
        "step": 2,
    },
    {
        "loss": 2.0,
        "learning_rate": 5e-06,
        "reward": 0.75,
        "reward_std": 0.25,
        "kl": 0.25,
        "rewards/accuracy/mean": 0.75,
        "rewards/accuracy/std": 0.25,
        "rewards/margins": 0.5,
        "rewards/accuracies": 1.0,
        "completions/mean_length": 24.0,
        "completions/clipped_ratio": 0.25,
        "clip_ratio/region_mean": 0.125,
        "entropy": 1.25,
        "mean_token_accuracy": 0.375,
        "epoch": 0.75,
        "step": 3,
    },
    {
        "eval_loss": 1.75,
        "eval_reward": 0.75,
        "eval_rewards/margins": 0.25,
        "eval_mean_token_accuracy": 0.5,
        "eval_runtime": 1.25,
        "eval_samples_per_second": 9.0,
        "eval_steps_per_second": 2.5,
        "epoch": 1.0,
        "step": 4,
    },
    {
        "train_runtime": 3723.4,
        "train_samples_per_second": 0.5,
        "train_steps_per_second": 0.125,
        "total_flos": 0.0,
        "train_loss": 2.25,
        "epoch": 1.0,
        "step": 4,
    },
]

# Written out by hand from HISTORY: (steps, values) per key, group order, key order within each group.
EXPECTED_GROUPS = {
    "loss": {"loss": ([1, 2, 3], [2.5, 2.25, 2.0]), "eval_loss": ([2, 4], [2.0, 1.75])},
    "learning_rate": {"learning_rate": ([1, 2, 3], [1e-05, 7.5e-06, 5e-06])},
    "grad_norm": {"grad_norm": ([1], [4.0])},
    "reward": {"reward": ([1, 2, 3], [0.25, 0.5, 0.75]), "eval_reward": ([2, 4], [0.5, 0.75])},
    "reward_std": {"reward_std": ([1, 2, 3], [0.5, 0.375, 0.25])},
    "kl": {"kl": ([1, 2, 3], [0.0, 0.125, 0.25])},
    "rewards": {
        "rewards/accuracy/mean": ([1, 2, 3], [0.25, 0.5, 0.75]),
        "rewards/accuracy/std": ([1, 3], [0.5, 0.25]),
        "rewards/margins": ([3], [0.5]),
        "rewards/accuracies": ([3], [1.0]),
        "eval_rewards/margins": ([4], [0.25]),
    },
    "completions": {
        "completions/mean_length": ([1, 2, 3], [31.5, 28.0, 24.0]),
        "completions/clipped_ratio": ([1, 2, 3], [0.0, 0.125, 0.25]),
    },
    "clip_ratio": {"clip_ratio/region_mean": ([1, 2, 3], [0.0, 0.0625, 0.125])},
    "entropy": {"entropy": ([1, 2, 3], [1.75, 1.5, 1.25])},
    "mean_token_accuracy": {
        "mean_token_accuracy": ([1, 3], [0.125, 0.375]),
        "eval_mean_token_accuracy": ([4], [0.5]),
    },
}


def _write_state(directory: Path, history: list[dict]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "trainer_state.json").write_text(json.dumps({"global_step": 4, "log_history": history}))


def test_metric_groups_match_the_log_history_exactly():
    groups = metric_groups(HISTORY)
    assert list(groups) == list(EXPECTED_GROUPS)
    for name, expected_lines in EXPECTED_GROUPS.items():
        assert list(groups[name]) == list(expected_lines), name
        for key, (steps, values) in expected_lines.items():
            assert groups[name][key].steps == steps, key
            assert groups[name][key].values == values, key


def test_every_metric_key_is_plotted_and_run_statistics_are_not():
    plotted = {key for lines in metric_groups(HISTORY).values() for key in lines}
    numeric = {key for row in HISTORY for key, value in row.items() if isinstance(value, (int, float))}
    run_statistics = {
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "total_flos",
        "train_loss",
        "eval_runtime",
        "eval_samples_per_second",
        "eval_steps_per_second",
    }
    assert plotted == numeric - run_statistics - {"step", "epoch"}


def _drawn_lines(chart) -> dict[str, tuple[list, list]]:
    """Every labelled data line of every panel (reference levels drawn for one-point series are unlabelled)."""
    return {line.label: (list(line.xs), list(line.ys)) for panel in chart.panels for line in panel.lines}


def test_figures_draw_exactly_the_grouped_series():
    for name, lines in metric_groups(HISTORY).items():
        figure = plot_group(name, lines)
        assert _drawn_lines(figure) == EXPECTED_GROUPS[name]
        assert figure.title == name


def test_each_quantity_has_its_own_panel_and_scale():
    """A train metric shares a panel only with its eval twin; every panel scales to its own data."""
    figure = plot_group("rewards", metric_groups(HISTORY)["rewards"])
    panels = {panel.title: sorted(line.label for line in panel.lines) for panel in figure.panels}
    assert panels == {
        "rewards/accuracy/mean": ["rewards/accuracy/mean"],
        "rewards/accuracy/std": ["rewards/accuracy/std"],
        "rewards/margins": ["eval_rewards/margins", "rewards/margins"],
        "rewards/accuracies": ["rewards/accuracies"],
    }
    assert all(panel.xlabel == "step" for panel in figure.panels)
    figure = plot_group("mixed", {"big": Series([1, 2], [1000.0, 2000.0]), "small": Series([1, 2], [0.001, 0.002])})
    big, small = figure.boxes()
    assert big.ylim == (950.0, 2050.0) and small.ylim == pytest.approx((0.00095, 0.00205))


def test_a_metric_logged_once_is_drawn_as_a_line_not_a_dot():
    """max_steps < logging_steps gives one log row: each train value spans the window it averages (steps 0-3);
    an eval value logged once is a level across its panel."""
    history = [{"loss": 2.0, "entropy": 1.5, "step": 3}, {"eval_loss": 1.5, "step": 3}]
    groups = metric_groups(history)
    assert groups["loss"]["loss"].window_start == 0 and groups["loss"]["eval_loss"].window_start == 3
    (loss_panel,) = plot_group("loss", groups["loss"]).panels
    # The train value spans its window (solid, 0 to 3); the eval value is a dotted level across the panel.
    assert [(level.x0, level.x1, level.y, level.dotted) for level in loss_panel.levels] == [
        (0, 3, 2.0, False),
        (None, None, 1.5, True),
    ]
    assert [level.color for level in loss_panel.levels] == [line.color for line in loss_panel.lines]
    # A later window starts at the previous train log, not at the eval row in between.
    later = metric_groups(
        [{"loss": 1.0, "step": 2}, {"eval_loss": 1.0, "step": 2}, {"loss": 1.0, "kl": 0.5, "step": 5}]
    )
    assert later["kl"]["kl"].window_start == 2


def test_reward_model_paths_become_short_names():
    assert display_name("rewards//tmp/models/Qwen2-RM/mean") == "rewards/Qwen2-RM/mean"
    assert display_name("eval_rewards/org/Skywork-RM/std") == "eval_rewards/Skywork-RM/std"
    assert display_name("rewards/accuracy/mean") == "rewards/accuracy/mean"
    assert display_name("loss") == "loss"
    figure = plot_group("rewards", {"rewards/org/RM/mean": Series([1, 2], [0.5, 0.75])})
    assert figure.panels[0].title == "rewards/RM/mean"
    assert [line.label for line in figure.panels[0].lines] == ["rewards/RM/mean"]


def test_write_report_embeds_every_plot_and_summarises_the_run(tmp_path, monkeypatch):
    saved = {}  # the figures write_report actually saved, to check their data against the history
    draw = report_module.plot_group

    def recording_plot_group(name, lines):
        saved[name] = draw(name, lines)
        return saved[name]

    monkeypatch.setattr(report_module, "plot_group", recording_plot_group)
    _write_state(tmp_path, HISTORY)
    report = write_report(tmp_path)
    assert {name: _drawn_lines(figure) for name, figure in saved.items()} == EXPECTED_GROUPS
    assert report == tmp_path / "report.html"
    page = report.read_text(encoding="utf-8")

    svgs = sorted(path.name for path in tmp_path.glob("plot_*"))
    assert set(svgs) == {f"plot_{name}.svg" for name in EXPECTED_GROUPS}
    for name, lines in EXPECTED_GROUPS.items():
        inline = saved[name].svg(name=f"plot_{name}")
        assert inline in page  # the page carries the chart itself
        saved_file = (tmp_path / f"plot_{name}.svg").read_text()
        assert saved_file == inline.replace("<svg ", '<svg xmlns="http://www.w3.org/2000/svg" ', 1)
        assert f'title="plot_{name}.svg"' in page
        assert f'aria-label="{name}: {", ".join(lines)}"' in page
    page_without_namespace = page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "http://" not in page_without_namespace and "https://" not in page and "<script" not in page
    assert "<img" not in page and "png" not in page.lower()

    assert re.search(r"<th>Steps</th><td>4</td>", page)
    assert re.search(r"<th>Epochs</th><td>1</td>", page)
    assert "<th>Wall time</th><td>1h 02m 03s</td>" in page  # 3723.4 s
    # final value, its step, min, max, number of finite points
    row = re.search(r"<tr><td>grad_norm</td>(.*?)</tr>", page).group(1)
    assert re.findall(r'<td class="num">(.*?)</td>', row) == ["4", "1", "4", "4", "1"]
    row = re.search(r"<tr><td>loss</td>(.*?)</tr>", page).group(1)
    assert re.findall(r'<td class="num">(.*?)</td>', row) == ["2", "3", "2", "2.5", "3"]
    row = re.search(r"<tr><td>learning_rate</td>(.*?)</tr>", page).group(1)
    assert re.findall(r'<td class="num">(.*?)</td>', row) == ["5e-06", "3", "5e-06", "1e-05", "3"]
    assert "<tr><td>train_loss</td>" in page
    assert "Sample completions" not in page  # no completions.jsonl


def test_plot_file_names_are_unique_safe_slugs(tmp_path):
    line = {"x": Series([1], [1.0])}
    paths = save_plots({"Reward Fn (v2)": line, "a-b": line, "a b": line, "///": line}, tmp_path)
    assert {name: path.name for name, (path, _) in paths.items()} == {
        "Reward Fn (v2)": "plot_reward_fn_v2.svg",
        "a-b": "plot_a_b.svg",
        "a b": "plot_a_b_2.svg",
        "///": "plot_metric.svg",
    }
    assert all(path.is_file() for path, _ in paths.values())


def test_newest_checkpoint_is_the_fallback_and_top_level_state_wins(tmp_path):
    _write_state(tmp_path / "checkpoint-9", [{"loss": 9.0, "step": 9}])
    _write_state(tmp_path / "checkpoint-10", [{"loss": 10.0, "step": 10}])  # lexicographically before -9
    (tmp_path / "checkpoint-11").mkdir()  # a save in progress: no trainer_state.json yet
    (tmp_path / "checkpoint-last").mkdir()
    assert load_log_history(tmp_path) == [{"loss": 10.0, "step": 10}]

    _write_state(tmp_path, [{"loss": 1.0, "step": 12}])
    assert load_log_history(tmp_path) == [{"loss": 1.0, "step": 12}]


def test_sample_completions_spreads_steps_and_keeps_the_first_per_step(tmp_path):
    path = tmp_path / "completions.jsonl"
    lines = [
        json.dumps({"step": step, "prompt": "p", "completion": f"{step}-{i}", "reward": i})
        for step in (50, 0, 10, 20, 30, 40)
        for i in range(3)
    ]
    path.write_text("\n".join(lines) + "\n\n")
    picked = [(record["step"], record["completion"]) for record in sample_completions(path)]
    # 6 steps into 4: indices round(i * 5 / 3) for i = 0..3 -> 0, 2, 3, 5
    assert picked == [
        (0, "0-0"),
        (0, "0-1"),
        (20, "20-0"),
        (20, "20-1"),
        (30, "30-0"),
        (30, "30-1"),
        (50, "50-0"),
        (50, "50-1"),
    ]


def test_sample_completions_shows_tool_transcripts_first(tmp_path):
    path = tmp_path / "completions.jsonl"
    call = [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {}}}],
        }
    ]
    lines = [
        json.dumps({"step": 1, "prompt": "p", "completion": f"c{i}", **({"transcript": call} if i in (2, 4) else {})})
        for i in range(5)
    ]
    path.write_text("\n".join(lines) + "\n")
    # The first plain records give way to the tool episodes; the kept ones stay in the order they came.
    assert [r["completion"] for r in sample_completions(path, steps=2, per_step=2)] == ["c2", "c4"]
    assert [r["completion"] for r in sample_completions(path, steps=2, per_step=3)] == ["c1", "c2", "c4"]
    assert [r["completion"] for r in sample_completions(path, steps=2, per_step=1)] == ["c2"]


def test_completions_table_escapes_html(tmp_path):
    records = [
        {"step": 1, "prompt": "<script>alert(1)</script>", "completion": "a < b & c", "reward": 0.5},
        {
            "step": 2,
            "prompt": [{"role": "user", "content": "<b>hi</b>"}],
            "completion": [{"role": "assistant", "content": "</pre></td><script>x()</script>"}],
        },
    ]
    (tmp_path / "completions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    page = write_report(tmp_path, log_history=[{"loss": 1.0, "step": 1}], title="<i>run</i>").read_text()
    assert "<script" not in page.lower() and "<b>" not in page and "<i>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "a &lt; b &amp; c" in page
    assert "user: &lt;b&gt;hi&lt;/b&gt;" in page
    assert "assistant: &lt;/pre&gt;&lt;/td&gt;&lt;script&gt;x()&lt;/script&gt;" in page
    assert "<title>&lt;i&gt;run&lt;/i&gt;</title>" in page
    rewards = re.findall(
        r'<td class="num">(\d+)</td><td><pre>.*?</pre></td><td><pre>.*?</pre></td>'
        r'<td class="num">(.*?)</td>',
        page,
        flags=re.S,
    )
    assert rewards == [("1", "0.5"), ("2", "")]


@pytest.mark.parametrize("history", [[], [{"step": 1, "note": "text only"}], [{"train_runtime": 2.0, "step": 1}]])
def test_history_without_metrics_is_a_clear_error(tmp_path, history):
    _write_state(tmp_path, history)
    with pytest.raises(DataError, match=r"no metric to plot.*logging_steps"):
        write_report(tmp_path)
    assert not (tmp_path / "report.html").exists()


def test_bad_inputs_name_the_problem(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_log_history(tmp_path / "missing")
    with pytest.raises(DataError, match=r"No trainer_state\.json.*checkpoint-N"):
        load_log_history(tmp_path)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"global_step": 3}))
    with pytest.raises(DataError, match="no 'log_history'"):
        load_log_history(tmp_path)
    with pytest.raises(DataError, match="row 1 has no numeric 'step'"):
        metric_groups([{"loss": 1.0, "step": 1}, {"loss": 0.5}])
    (tmp_path / "completions.jsonl").write_text('{"step": 1, "completion": "ok"}\n{"step": 2}\n')
    with pytest.raises(DataError, match="line 2 must be a JSON object"):
        sample_completions(tmp_path / "completions.jsonl")


def test_import_does_not_load_matplotlib():
    code = "import sys, posttrain.training.report; print('matplotlib' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_summarys_repeat_of_the_last_window_is_not_drawn_twice():
    """The end-of-training summary repeats the last window's metrics (as TRL's does): one point, not two; a summary
    that carries a window never logged before (TRL's logs) still adds its point."""
    logged = [
        {"loss": 2.0, "reward": 0.5, "step": 4},
        {"train_runtime": 1.0, "train_loss": 2.0, "reward": 0.5, "step": 4},
    ]
    reward = metric_groups(logged)["reward"]["reward"]
    assert (reward.steps, reward.values) == ([4], [0.5])
    unlogged = [{"loss": 2.0, "reward": 0.5, "step": 4}, {"train_runtime": 1.0, "reward": 0.7, "step": 6}]
    reward = metric_groups(unlogged)["reward"]["reward"]
    assert (reward.steps, reward.values) == ([4, 6], [0.5, 0.7])
