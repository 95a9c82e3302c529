"""One table of posttrain against TRL 1.16 for every trainer: steps/s, tokens/s, MFU and peak RSS, with ratios.

    python benchmarks/bench_table.py [--repeats 3] [--only sft,reward,kto,dpo,grpo,rloo] [--steps-scale 1]
        [--families llama,qwen2,qwen3,gemma3,mistral,qwen3_moe] [--smollm2] [--qwen3-smollm2]
        [--sft-modes padded,packed,wrapped,completion,messages]
    python benchmarks/bench_table.py --only async [--repeats 3]

Each cell comes from the trainer's own benchmark, whose run functions are imported and called here (never
copied): SFT from bench_sft (padded, packed BFD, packed wrapped, completion-only, messages), Reward and KTO from
bench_reward_kto (KTO also on 16 rows, epoch after epoch), DPO from bench_dpo, GRPO and RLOO from bench_grpo, each on
a tiny model of every family in --families (models/tiny.py; a row per family and trainer). --smollm2 adds
SmolLM2-135M (SFT full and LoRA, DPO with `ref_model=None`); --qwen3-smollm2 a SmolLM2-sized Qwen3 with random
weights (SFT, DPO, GRPO). Every run is a fresh single-threaded interpreter (common.run_isolated), posttrain and TRL
alternate, and each cell is the median of `--repeats` runs.

Every trainer is timed in process CPU time between the first and the last optimizer step (GRPO/RLOO: generation
included): with one thread that is the step time of an idle machine, and other jobs on a shared machine do not
count in it. MFU = 6 x parameters x real tokens per second / the measured single-thread fp32 matmul peak (full
fine-tuning only; attention-score FLOPs neglected). Peak RSS is the run's maximum resident set size.

`--only async` (not in the default set: minutes a run) adds posttrain's own table of asynchronous generation
against synchronous GRPO on SmolLM2-135M (bench_async_generation.table): wall steps/s on all the cores, since
asynchronous generation is about using more than one.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import tempfile
from pathlib import Path

import bench_async_generation
import bench_dpo
import bench_reward_kto
import bench_sft
from common import REPO_ROOT, run_isolated, tcmalloc_path
from provenance import conditions, describe

LIBRARIES = ("posttrain", "trl")
SFT_MODES = {
    "padded": "SFT padded",
    "packed": "SFT packed BFD",
    "wrapped": "SFT packed wrapped",
    "completion": "SFT completion-only",
    "messages": "SFT messages",
}


def _cpu_rates(result: dict) -> dict:
    """steps/s and tokens/s in CPU time from a reward/KTO/DPO run (which report wall-time rates and CPU ms/step)."""
    steps = 1000 / result["cpu_ms_per_step"]
    return {
        "steps_per_s": steps,
        "tokens_per_s": steps * result["tokens_per_step"],
        "peak_rss_mb": result["peak_rss_mb"],
    }


def _sft_rates(result: dict, peak: float, full: bool) -> dict:
    out = {k: result[k] for k in ("steps_per_s", "tokens_per_s", "peak_rss_mb")}
    if full:
        out["mfu"] = 6 * result["params"] * result["real_tokens"] / result["step_s"] / peak
    return out


def _online_rates(result: dict) -> dict:
    """steps/s and tokens/s in CPU time from a GRPO/RLOO run."""
    steps = result["steps_per_cpu_s"]
    return {
        "steps_per_s": steps,
        "tokens_per_s": steps * result["tokens_per_step"],
        "peak_rss_mb": result["peak_rss_mb"],
    }


# What a benchmark model of each family gets beyond models/tiny.py's test settings: Gemma 3 without final
# soft-capping (as the released models), and windows of 128 tokens (real ones, 512 and more, are longer than these
# sequences; 128 still cuts SFT's longest rows).
FAMILY_SETTINGS = {
    "gemma3": dict(sliding_window=128, final_logit_softcapping=None),
    "mistral": dict(sliding_window=128),
}
FAMILY_NAMES = {
    "llama": "Llama",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gemma3": "Gemma 3",
    "mistral": "Mistral",
    "phi3": "Phi-3",
    "qwen3_moe": "Qwen3-MoE",
    "mixtral": "Mixtral",
}
# SmolLM2-135M's shape (30 layers, hidden 576, 9 heads of 64, 3 key-value heads, 49,152 tokens) as a Qwen3 (q/k
# norms), random weights.
QWEN3_SMOLLM2 = dict(
    hidden_size=576,
    num_layers=30,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
)


def _cell(label: str, setting: str, target: str, cpu_rates, **kwargs) -> tuple:
    """(trainer, setting, {library: zero-argument run}) of one benchmark function run for both libraries."""
    key = "library" if target.startswith(("bench_sft", "bench_grpo")) else "impl"
    return (
        label,
        setting,
        {lib: (lambda lib=lib: cpu_rates(run_isolated(target, {key: lib, **kwargs}))) for lib in LIBRARIES},
    )


def family_cells(
    family: str, only: set[str], workdir: Path, peak: float, steps, sft_modes: tuple[str, ...] = tuple(SFT_MODES)
) -> list[tuple]:
    """The tiny-model cells of one family: SFT's modes (`sft_modes`), Reward, KTO, DPO, GRPO and RLOO."""
    from posttrain.models.tiny import save_tiny_model

    name, extra = FAMILY_NAMES[family], FAMILY_SETTINGS.get(family, {})
    root = workdir / family
    cells = []
    if "sft" in only:
        path = save_tiny_model(root / "sft", family=family, hidden_size=256, num_layers=4, **extra)
        settings = dict(bench_sft.ROWS["tiny-llama"], steps=steps(bench_sft.ROWS["tiny-llama"]["steps"]))
        for mode in sft_modes:
            label = SFT_MODES[mode]
            rates = lambda result: _sft_rates(result, peak, True)  # noqa: E731
            cells.append(
                _cell(label, f"tiny {name}, batch 8", "bench_sft:train", rates, model_path=path, mode=mode, **settings)
            )
    if {"reward", "kto"} & only:
        bench_reward_kto.make_models(root / "preference", family=family, **extra)
        for method in ("reward", "kto"):
            if method in only:
                label = "Reward" if method == "reward" else "KTO"
                kwargs = dict(method=method, root=str(root / "preference"), steps=steps(30))
                cells.append(_cell(label, f"tiny {name}, batch 8", "bench_reward_kto:worker", _cpu_rates, **kwargs))
        if "kto" in only:  # 16 rows: epoch after epoch, where posttrain knows each row's reference log-probs
            kwargs = dict(method="kto", root=str(root / "preference"), steps=steps(30), rows=16)
            cells.append(
                _cell(
                    "KTO, later epochs",
                    f"tiny {name}, batch 8, 16 rows",
                    "bench_reward_kto:worker",
                    _cpu_rates,
                    **kwargs,
                )
            )
    if "dpo" in only:
        policy = save_tiny_model(root / "dpo" / "policy", seed=0, family=family, hidden_size=256, num_layers=4, **extra)
        ref = save_tiny_model(root / "dpo" / "ref", seed=1, family=family, hidden_size=256, num_layers=4, **extra)
        kwargs = dict(model_path=policy, ref_path=ref, steps=steps(30), batch=bench_dpo.MODELS["tiny"]["batch"])
        cells.append(_cell("DPO", f"tiny {name}, batch 8", "bench_dpo:worker", _cpu_rates, **kwargs))
    for method in ("grpo", "rloo"):
        if method in only:
            path = save_tiny_model(root / "grpo", family=family, **extra)
            kwargs = dict(method=method, model_path=path, steps=steps(20))
            cells.append(
                _cell(method.upper(), f"tiny {name}, 16 completions", "bench_grpo:run_one", _online_rates, **kwargs)
            )
    return cells


def smollm2_cells(only: set[str], peak: float, steps) -> list[tuple]:
    """The built-in SmolLM2-135M: SFT full and LoRA, DPO without a reference model."""
    from posttrain.models.builtin import builtin_model_path

    cells = []
    if "sft" in only:
        rows = bench_sft.ROWS["smollm2-135m"]
        for peft, label in ((False, "SFT SmolLM2-135M full"), (True, "SFT SmolLM2-135M LoRA r16")):
            rates = lambda result, peft=peft: _sft_rates(result, peak, not peft)  # noqa: E731
            kwargs = dict(model_path=builtin_model_path(), mode="padded", peft=peft, **rows)
            cells.append(_cell(label, "padded, batch 4 x 256", "bench_sft:train", rates, **kwargs))
    if "dpo" in only:
        rows = bench_dpo.MODELS["smollm2"]
        kwargs = dict(model_path=builtin_model_path(), ref_path=None, steps=steps(rows["steps"]), batch=rows["batch"])
        cells.append(
            _cell(
                "DPO SmolLM2-135M full",
                f"ref_model=None, batch {rows['batch']} pairs",
                "bench_dpo:worker",
                _cpu_rates,
                **kwargs,
            )
        )
    return cells


def qwen3_smollm2_cells(only: set[str], workdir: Path, peak: float, steps) -> list[tuple]:
    """A SmolLM2-sized Qwen3 (QWEN3_SMOLLM2, random weights): SFT, DPO without a reference model, GRPO."""
    from posttrain.models.tiny import save_tiny_model

    path = save_tiny_model(workdir / "qwen3-smollm2", family="qwen3", **QWEN3_SMOLLM2)
    setting = "Qwen3, SmolLM2-135M-sized"
    cells = []
    if "sft" in only:
        rows = bench_sft.ROWS["smollm2-135m"]
        rates = lambda result: _sft_rates(result, peak, True)  # noqa: E731
        cells.append(
            _cell(
                "SFT padded",
                f"{setting}, batch 4 x 256",
                "bench_sft:train",
                rates,
                model_path=path,
                mode="padded",
                **rows,
            )
        )
    if "dpo" in only:
        rows = bench_dpo.MODELS["smollm2"]
        kwargs = dict(model_path=path, ref_path=None, steps=steps(rows["steps"]), batch=rows["batch"])
        cells.append(
            _cell(
                "DPO",
                f"{setting}, ref_model=None, batch {rows['batch']} pairs",
                "bench_dpo:worker",
                _cpu_rates,
                **kwargs,
            )
        )
    if "grpo" in only:
        kwargs = dict(method="grpo", model_path=path, steps=steps(4))
        cells.append(_cell("GRPO", f"{setting}, 16 completions", "bench_grpo:run_one", _online_rates, **kwargs))
    return cells


def benchmarks(
    only: set[str],
    families: list[str],
    smollm2: bool,
    qwen3_smollm2: bool,
    workdir: Path,
    peak: float,
    steps_scale: float,
    sft_modes: tuple[str, ...] = tuple(SFT_MODES),
) -> list[tuple]:
    """(trainer, setting, {library: zero-argument run returning a rates dict}) for every cell of the table."""

    def steps(n: int) -> int:
        return max(3, round(n * steps_scale))

    cells = [cell for family in families for cell in family_cells(family, only, workdir, peak, steps, sft_modes)]
    if smollm2:
        cells += smollm2_cells(only, peak, steps)
    if qwen3_smollm2:
        cells += qwen3_smollm2_cells(only, workdir, peak, steps)
    return cells


def _machine() -> str:
    model = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def _row(trainer: str, setting: str, runs: dict[str, list[dict]]) -> list[str]:
    med = {lib: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for lib, rs in runs.items()}
    p, t = med["posttrain"], med["trl"]

    def ratio(key):
        return f"{p[key] / t[key]:.2f}x"

    # Every repeat's own ratio beside the median's (repeat r of each side), so that no chosen run stands alone.
    each_ratio = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs["posttrain"], runs["trl"])]
    each = " (" + ", ".join(f"{r:.2f}" for r in each_ratio) + ")" if len(each_ratio) > 1 else ""

    mfu = f"{p['mfu']:.2f} / {t['mfu']:.2f}" if "mfu" in p else ""
    return [
        trainer,
        setting,
        f"{p['steps_per_s']:.3g} / {t['steps_per_s']:.3g}",
        ratio("steps_per_s") + each,
        f"{p['tokens_per_s']:,.0f} / {t['tokens_per_s']:,.0f}",
        mfu,
        f"{p['peak_rss_mb']:,.0f} / {t['peak_rss_mb']:,.0f}",
        f"{p['peak_rss_mb'] / t['peak_rss_mb']:.0%}",
    ]


HEADERS = [
    "trainer",
    "setting",
    "steps/s (pt / TRL)",
    "speed pt/TRL",
    "tokens/s (pt / TRL)",
    "MFU (pt / TRL)",
    "peak RSS MB (pt / TRL)",
    "RSS pt/TRL",
]


def markdown(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="Runs per library and cell (alternating); median.")
    parser.add_argument("--only", default="sft,reward,kto,dpo,grpo,rloo", help="Comma-separated trainers to run.")
    parser.add_argument(
        "--smollm2", action="store_true", help="Add SmolLM2-135M SFT (full and LoRA) and DPO: minutes a run."
    )
    parser.add_argument(
        "--families",
        default="llama",
        help="Comma-separated tiny-model families: " + ", ".join(FAMILY_NAMES) + " (a row per family and trainer); "
        "'none' for no tiny-model rows.",
    )
    parser.add_argument(
        "--qwen3-smollm2", action="store_true", help="Add a SmolLM2-sized Qwen3 (random weights): SFT, DPO, GRPO."
    )
    parser.add_argument(
        "--sft-modes", default=",".join(SFT_MODES), help="Comma-separated SFT modes: " + ", ".join(SFT_MODES) + "."
    )
    parser.add_argument("--steps-scale", type=float, default=1.0, help="Scale every benchmark's step count.")
    parser.add_argument("--tcmalloc", action="store_true", help="Run both libraries with tcmalloc preloaded.")
    cli = parser.parse_args()
    if cli.tcmalloc:
        if tcmalloc_path() is None:
            raise SystemExit("tcmalloc not found: apt-get install -y libtcmalloc-minimal4")
        os.environ["LD_PRELOAD"] = tcmalloc_path()
    else:
        os.environ["LD_PRELOAD"] = ""  # not what scripts/env.sh may have preloaded: both libraries on glibc malloc
    load_before = os.getloadavg()
    peak = max(run_isolated("common:matmul_peak_flops")["flops"] for _ in range(3))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_table_") as workdir:
        for trainer, setting, run in benchmarks(
            set(cli.only.split(",")),
            [family for family in cli.families.split(",") if family != "none"],
            cli.smollm2,
            cli.qwen3_smollm2,
            Path(workdir),
            peak,
            cli.steps_scale,
            tuple(cli.sft_modes.split(",")),
        ):
            runs = {lib: [] for lib in LIBRARIES}
            for repeat in range(cli.repeats):
                for lib in LIBRARIES if repeat % 2 == 0 else reversed(LIBRARIES):
                    runs[lib].append(run[lib]())
            rows.append(_row(trainer, setting, runs))
            print(" | ".join(rows[-1]), flush=True)
    load_after = os.getloadavg()
    if "async" in cli.only.split(","):
        from posttrain.runtime.cores import free_cores

        steps = max(6, round(12 * cli.steps_scale))
        print()
        print(bench_async_generation.table("smollm2", steps, cli.repeats, len(free_cores(0))))
        if cli.only == "async":
            return
    print()
    print(
        f"posttrain vs TRL 1.16, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {_machine()}; "
        f"1 thread per run, {'tcmalloc' if cli.tcmalloc else 'glibc malloc'}, median of {cli.repeats} alternating "
        f"runs; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (1 min); fp32 matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s; steps in CPU time from the first step to the last "
        f"(`{Path(__file__).relative_to(REPO_ROOT)}`); {describe(conditions())}. Speed: the median's ratio, each "
        "repeat's own in brackets."
    )
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
