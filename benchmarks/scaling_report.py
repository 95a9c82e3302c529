"""Tables, plots and the cost-model fit from benchmarks/bench_scaling.py's results (docs/results/scaling/*.json).

    python benchmarks/scaling_report.py [--markdown] [--fit]
    python benchmarks/scaling_report.py --from-log sft_seq=/tmp/sft_seq.log   # rebuild a JSON from a sweep's log

Per point: each library's step time (median of its runs, process CPU seconds), the speed ratio TRL/posttrain (> 1:
posttrain faster), the peak-RSS ratio, MFU against the measured matmul peak (docs/results/scaling/machine.json) and,
for GRPO, generation tokens per CPU-second against the decode bound. `--fit` fits step time ~ a + b * tokens
(+ c * tokens^2 with 3 or more points) to posttrain's curves and writes posttrain/runtime/cost_model.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
RESULTS = BENCH.parent / "docs" / "results" / "scaling"
COST_MODEL = BENCH.parent / "posttrain" / "runtime" / "cost_model.json"
# SmolLM2-135M's shape, for the decode bound: layers, key-value heads x head size, parameters.
SMOLLM2 = dict(layers=30, kv_width=3 * 64, params=134_515_008, prompt_tokens=40)


def load(results: Path = RESULTS) -> dict[str, dict]:
    """Every sweep's record by file name (SWEEP.json, and SWEEP_TAG.json for further parts of a curve)."""
    paths = [path for path in sorted(results.glob("*.json")) if path.stem != "machine"]
    return {path.stem: json.loads(path.read_text()) for path in paths}


def merged(records: dict[str, dict], sweep: str, full: bool = False, generations: int | None = None) -> dict | None:
    """One record of `sweep` with the points of all its parts (SWEEP.json and SWEEP_TAG.json) of the same kind
    (LoRA, or full fine-tuning with `full`; GRPO: `generations` completions a prompt), the later part's runs where a
    point is in both."""
    parts = [
        r
        for r in records.values()
        if r["sweep"] == sweep
        and bool(r.get("settings", {}).get("full")) == full
        and (generations is None or r.get("settings", {}).get("generations") == generations)
    ]
    if not parts:
        return None
    points: dict = {}
    for record in sorted(parts, key=lambda r: r.get("date") or ""):
        points.update(
            {p: (runs, record["commit"][:7]) for p, runs in record["points"].items() if runs.get("posttrain")}
        )
    ordered = dict(sorted(points.items(), key=lambda item: int(item[0]) if item[0].isdigit() else 0))
    commits = sorted({commit for _, commit in ordered.values()})
    return {**parts[-1], "points": {p: runs for p, (runs, _) in ordered.items()}, "commits": commits}


def curves(records: dict[str, dict]) -> dict[str, dict]:
    """The curves a page shows, each merged from its parts: SFT by length (LoRA; full), by model size, GRPO by
    completion length per group size."""
    out = {}
    for sweep in ("sft_seq", "model_size"):
        for full in (False, True):
            record = merged(records, sweep, full)
            if record:
                out[sweep + ("_full" if full else "")] = record
    for generations in sorted(
        {r["settings"]["generations"] for r in records.values() if r["sweep"] == "grpo_completion"}
    ):
        out[f"grpo_completion_x{generations}"] = merged(records, "grpo_completion", generations=generations)
    return out


def machine(results: Path = RESULTS) -> dict | None:
    path = results / "machine.json"
    return json.loads(path.read_text()) if path.exists() else None


def median(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def decode_bound(completion: int, generations: int, limits: dict) -> float:
    """Tokens per CPU-second one thread can at best decode: per decode step, the larger of reading the float32
    weights and the KV cache (mean context) at the measured copy bandwidth, and 2 x parameters x batch FLOPs at the
    measured matmul peak."""
    context = SMOLLM2["prompt_tokens"] + completion / 2
    kv_bytes = 2 * SMOLLM2["layers"] * SMOLLM2["kv_width"] * context * 4 * generations
    memory_s = (SMOLLM2["params"] * 4 + kv_bytes) / (limits["copy_1"]["gb_per_s_cpu"] * 1e9)
    flops_s = 2 * SMOLLM2["params"] * generations / (limits["matmul_1"]["gflops_cpu"] * 1e9)
    return generations / max(memory_s, flops_s)


def rows(record: dict, limits: dict | None) -> list[dict]:
    """One summary per point of a sweep."""
    out = []
    peak = limits["matmul_1"]["gflops_cpu"] * 1e9 if limits else None
    for point, runs in record["points"].items():
        p, t = runs.get("posttrain", []), runs.get("trl", [])
        row = {"point": point, "runs": {lib: [round(r["step_s"], 3) for r in rs] for lib, rs in runs.items()}}
        for lib, rs in (("posttrain", p), ("trl", t)):
            row[f"{lib}_step_s"] = median(rs, "step_s")
            row[f"{lib}_rss_mb"] = median(rs, "peak_rss_mb")
            flops = median(rs, "flops_per_step")
            row[f"{lib}_mfu"] = flops / row[f"{lib}_step_s"] / peak if flops and peak and rs else None
            row[f"{lib}_gen_tok_s"] = median(rs, "generation_tokens_per_s")
            row[f"{lib}_gen_s"] = median(rs, "generation_s_per_step")
            row[f"{lib}_other_s"] = median(rs, "other_s_per_step")
        if p and t:
            row["speed_ratio"] = row["trl_step_s"] / row["posttrain_step_s"]
            row["rss_ratio"] = row["posttrain_rss_mb"] / row["trl_rss_mb"]
        if record["sweep"] == "grpo_completion" and limits:
            row["decode_bound"] = decode_bound(int(point), record["settings"]["generations"], limits)
        out.append(row)
    return out


def _cell(value, digits: str = ".3g") -> str:
    return "-" if value is None else format(value, digits)


def markdown(name: str, record: dict, limits: dict | None) -> str:
    summary = rows(record, limits)
    commits = ", ".join(record.get("commits", [record["commit"][:7]]))
    head = f"### {name}: commits {commits}, last part {record['date']}, load average {record['loadavg_before']}\n\n"
    if record["sweep"] == "grpo_completion":
        lines = [
            "| completion | posttrain s/step (gen + rest) | TRL s/step (gen + rest) | speed | RSS ratio "
            "| gen tok/CPU-s posttrain / TRL | decode bound | posttrain of bound |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in summary:
            of_bound = r["posttrain_gen_tok_s"] / r["decode_bound"] if r.get("decode_bound") else None
            lines.append(
                f"| {r['point']} | {_cell(r['posttrain_step_s'])} ({_cell(r['posttrain_gen_s'])} + "
                f"{_cell(r['posttrain_other_s'])}) | {_cell(r['trl_step_s'])} ({_cell(r['trl_gen_s'])} + "
                f"{_cell(r['trl_other_s'])}) | {_cell(r.get('speed_ratio'), '.2f')}x | "
                f"{_cell(r.get('rss_ratio'), '.2f')} "
                f"| {_cell(r['posttrain_gen_tok_s'])} / {_cell(r['trl_gen_tok_s'])} | {_cell(r.get('decode_bound'))} "
                f"| {_cell(of_bound, '.0%')} |"
            )
        return head + "\n".join(lines) + "\n"
    lines = [
        "| point | posttrain s/step | TRL s/step | speed | peak RSS MB posttrain / TRL | MFU posttrain / TRL "
        "| runs (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        lines.append(
            f"| {r['point']} | {_cell(r['posttrain_step_s'])} | {_cell(r['trl_step_s'])} | "
            f"{_cell(r.get('speed_ratio'), '.2f')}x | {_cell(r['posttrain_rss_mb'], '.0f')} / "
            f"{_cell(r['trl_rss_mb'], '.0f')} | {_cell(r['posttrain_mfu'], '.0%')} / {_cell(r['trl_mfu'], '.0%')} | "
            f"{r['runs']} |"
        )
    return head + "\n".join(lines) + "\n"


def plot(name: str, record: dict, limits: dict | None, path: Path) -> None:
    """Step time of both libraries and their speed ratio against the swept quantity, as an SVG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    summary = [r for r in rows(record, limits) if r.get("speed_ratio")]
    if not summary:
        return
    labels = [r["point"] for r in summary]
    figure = Figure(figsize=(9, 3.4))
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    for lib in ("posttrain", "trl"):
        left.plot(labels, [r[f"{lib}_step_s"] for r in summary], marker="o", label=lib)
    left.set(title="step time (CPU s, 1 thread, loaded machine)", xlabel=name, ylabel="s")
    left.legend()
    right.plot(labels, [r["speed_ratio"] for r in summary], marker="o", label="TRL / posttrain step time")
    right.plot(labels, [r["rss_ratio"] for r in summary], marker="s", label="posttrain / TRL peak RSS")
    right.axhline(1.5, linestyle="--", color="gray", linewidth=1, label="speed goal 1.5x")
    right.axhline(1.0, linestyle=":", color="gray", linewidth=1)
    right.set(title=f"ratios (commit {record['commit'][:7]})", xlabel=name)
    right.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, format="svg")


def fit_cost_model(records: dict[str, dict]) -> dict:
    """posttrain's step time per token count: SFT from the sequence-length sweep, GRPO from the completion sweep
    (tokens = completions x completion length)."""
    from posttrain.runtime.cost_model import SMOLLM2_SHAPE, fit

    table = {}
    record = merged(records, "sft_seq")
    if record:
        points = [(int(p), median(r["posttrain"], "step_s")) for p, r in record["points"].items() if r["posttrain"]]
        tokens, seconds = zip(*points)
        a, b, c = fit(list(tokens), list(seconds), quadratic=len(points) >= 3)
        basis = (
            f"SmolLM2-135M LoRA, batch 1, {min(tokens)}-{max(tokens)} tokens, 1 thread CPU time (loaded 2-core "
            f"machine), commits {', '.join(record['commits'])}"
        )
        table["sft"] = {"a": a, "b": b, "c": c, "lora": True, "basis": basis, **SMOLLM2_SHAPE}
    grpo = [r for r in records.values() if r["sweep"] == "grpo_completion"]
    points = [
        (int(p) * record["settings"]["generations"], median(runs["posttrain"], "step_s"))
        for record in grpo
        for p, runs in record["points"].items()
        if runs.get("posttrain")
    ]
    if len({tokens for tokens, _ in points}) >= 2:
        tokens, seconds = zip(*points)
        a, b, c = fit(list(tokens), list(seconds))
        shapes = sorted({f"{p}x{r['settings']['generations']}" for r in grpo for p in r["points"]}, key=len)
        basis = (
            f"SmolLM2-135M LoRA GRPO, completions x length {', '.join(shapes)}, 1 thread CPU time (loaded), "
            f"commits {', '.join(sorted({r['commit'][:7] for r in grpo}))}"
        )
        table["grpo"] = {"a": a, "b": b, "c": c, "lora": True, "basis": basis, **SMOLLM2_SHAPE}
    return {"trainers": table}


def from_log(sweep: str, log: Path) -> dict:
    """A sweep's record rebuilt from its log lines ("POINT LIBRARY {json}"), for a sweep stopped before its end."""
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    record = {"sweep": sweep, "commit": commit, "date": None, "loadavg_before": None, "points": {}, "failed": {}}
    for line in log.read_text().splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[1] in ("posttrain", "trl") and parts[2].startswith("{"):
            point = record["points"].setdefault(parts[0], {"posttrain": [], "trl": []})
            point[parts[1]].append(json.loads(parts[2]))
    return record


def plot_all(results: Path = RESULTS) -> None:
    limits = machine(results)
    for name, record in curves(load(results)).items():
        plot(name, record, limits, results / f"{name}.svg")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="print a table per sweep")
    parser.add_argument("--fit", action="store_true", help="write posttrain/runtime/cost_model.json")
    parser.add_argument("--from-log", metavar="SWEEP=LOG", help="rebuild docs/results/scaling/SWEEP.json from LOG")
    args = parser.parse_args()
    if args.from_log:
        sweep, log = args.from_log.split("=", 1)
        (RESULTS / f"{sweep}.json").write_text(json.dumps(from_log(sweep, Path(log)), indent=1) + "\n")
    records, limits = load(), machine()
    if args.markdown:
        for name, record in curves(records).items():
            print(markdown(name, record, limits))
    if args.fit:
        COST_MODEL.write_text(json.dumps(fit_cost_model(records), indent=1) + "\n")
        print(f"wrote {COST_MODEL}")
    plot_all()


if __name__ == "__main__":
    main()
