"""The report's SVG charts: points land exactly where the data puts them in the plot box, ticks are round numbers
inside the limits, and nothing in a report (nor `import posttrain`) imports matplotlib."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest

from posttrain.training.svg_plot import Chart, Panel, padded, ticks


def _numbers(text: str) -> list[float]:
    return [float(value) for value in re.split(r"[ ,]", text)]


def test_polyline_points_map_the_data_to_the_plot_box_exactly():
    panel = Panel(title="loss", xlabel="step")
    panel.add_line("loss", [0, 5, 10], [1.0, 3.0, 2.0])
    panel.add_line("eval_loss", [10], [1.5], dashed=True, markers=True)
    svg = Chart("loss", [panel]).svg()
    # One column: 700 px wide; the box starts 64 px in and 34 + 26 px down, 700 - 64 - 16 = 620 px wide and
    # 280 - 26 - 60 = 194 px tall. Limits: x 0..10 padded by 0.5 -> -0.5..10.5 (11 wide),
    # y 1..3 padded by 0.1 -> 0.9..3.1 (2.2 tall).
    box = re.search(r'<rect class="plot-box" x="(\S+)" y="(\S+)" width="(\S+)" height="(\S+)"', svg).groups()
    assert list(map(float, box)) == [64, 60, 620, 194]
    by_hand = [
        (64 + 0.5 / 11 * 620, 60 + 2.1 / 2.2 * 194),  # (0, 1.0)
        (64 + 5.5 / 11 * 620, 60 + 0.1 / 2.2 * 194),  # (5, 3.0)
        (64 + 10.5 / 11 * 620, 60 + 1.1 / 2.2 * 194),  # (10, 2.0)
    ]
    train, evaluation = re.findall(r'<polyline points="([^"]*)"[^>]*?( stroke-dasharray="[^"]*")?>', svg)
    assert _numbers(train[0]) == pytest.approx([v for point in by_hand for v in point], abs=0.005)
    assert train[1] == ""  # the train line is solid, the eval one dashed
    assert _numbers(evaluation[0]) == pytest.approx([64 + 10.5 / 11 * 620, 60 + 1.6 / 2.2 * 194], abs=0.005)
    assert evaluation[1]
    # Only the eval line has markers; both are in the legend, in their palette colours.
    assert re.findall(r'<circle cx="(\S+)" cy="(\S+)"', svg) == [("655.82", "201.09")]
    legend = re.search(r'<g class="legend">.*?</g>', svg, flags=re.S).group(0)
    assert re.findall(r">(\w+)</text>", legend) == ["loss", "eval_loss"]


def test_limits_and_ticks():
    assert padded([2.0, 4.0]) == (1.9, 4.1)
    assert padded([4.0]) == (3.8, 4.2) and padded([0.0]) == (-0.5, 0.5) and padded([]) == (0.0, 1.0)
    assert ticks(-0.5, 10.5) == [0, 2, 4, 6, 8, 10]
    assert ticks(0.9, 3.1) == pytest.approx([1.0, 1.5, 2.0, 2.5, 3.0])
    assert ticks(0.9, 3.1, integers=True) == [1, 2, 3]
    assert ticks(0, 13) == [0, 2.5, 5, 7.5, 10, 12.5] and ticks(0, 13, integers=True) == [0, 5, 10]
    assert ticks(0.9, 3.1) == pytest.approx([1.0, 1.5, 2.0, 2.5, 3.0])
    assert ticks(4.75e-06, 1.025e-05) == pytest.approx([5e-06, 6e-06, 7e-06, 8e-06, 9e-06, 1e-05])
    assert ticks(-0.0125, 0.2625) == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2, 0.25])
    svg = Chart("lr", [Panel(lines=[])]).svg()  # an empty panel still draws (limits 0..1)
    assert svg.count('class="plot-box"') == 1


def test_unequal_x_and_y_is_a_clear_error():
    with pytest.raises(ValueError, match="2 x values and 1 y values"):
        Panel().add_line("loss", [1, 2], [1.0])


def test_a_tiny_sft_runs_report_never_imports_matplotlib(tmp_path, tiny_model_path):
    code = textwrap.dedent(
        f"""
        import sys
        import posttrain
        assert "matplotlib" not in sys.modules, "import posttrain"
        from datasets import Dataset
        from posttrain import SFTConfig, SFTTrainer
        rows = [{{"prompt": f"{{i}} plus 1 is", "completion": f" {{i + 1}}"}} for i in range(8)]
        args = SFTConfig(output_dir={str(tmp_path / "out")!r}, per_device_train_batch_size=4, max_steps=2,
                         logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, max_length=32,
                         disable_tqdm=True)
        SFTTrainer({str(tiny_model_path)!r}, args=args, train_dataset=Dataset.from_list(rows)).train()
        print("matplotlib" in sys.modules)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "False"
    page = (tmp_path / "out" / "report.html").read_text()
    assert page.count("<svg ") == len(list((tmp_path / "out").glob("plot_*.svg"))) > 0
