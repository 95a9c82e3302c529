"""SFT throughput: posttrain's SFTTrainer against TRL's on the same model, data and settings.

    OMP_NUM_THREADS=1 python benchmarks/bench_sft.py [--rows tiny-llama,smollm2-135m] [--repeats 2] [--tcmalloc]

Each (model, mode) is trained by posttrain, then TRL, then posttrain, then TRL ... each run in a fresh
single-threaded interpreter (benchmarks/common.py), and the fastest run of each library is reported
(the best of several runs is the least disturbed by other jobs on a shared machine). Step times are
the process's CPU time: with one thread that is the wall time of an idle machine, and unlike wall
time it does not count other jobs' turns on a shared one (the wall-time ratio is shown too).

Apples to apples:
- one dataset of `text` rows of varied lengths, all tokens trained (TRL and posttrain both append EOS,
  both truncate to max_length keeping the start);
- the batch holds the whole (padded or packed) dataset, so every step trains the same sequences in
  both libraries, whatever their sampler or packing order; step-0 losses must then agree;
- "padded": right padding with an attention mask; "packed": best-fit-decreasing packing, padding-free
  (posttrain `packing=True`; TRL `packing=True`, its default `bfd` and padding-free); "wrapped": packing
  with `packing_strategy="wrapped"` (posttrain keeps the sequence boundaries inside a row, TRL does not, so
  their step-0 losses differ); "completion": the same texts cut into prompt + completion, completion-only
  loss (both libraries' default); "messages": the same halves as a user and an assistant message, rendered
  with the chat template, all tokens trained;
- Set the same on both sides: `bf16=False` (float32; both libraries' default is bf16 autocast, on a CPU too),
  `gradient_checkpointing=False` (TRL's default: on; posttrain's on a CPU: off); `logging_steps=1`. Each library
  otherwise computes its loss its own way: TRL's fused, chunked LM head (which also computes entropy
  for logging), posttrain's fused chunked loss (its default; `--posttrain-full-logits` adds rows with
  `chunked_loss=False`).

Throughput is measured between the ends of the first and the last optimizer step (data loading,
collation, forward, backward, optimizer and logging included; the first step's warm-up excluded).
MFU (model FLOP utilisation) = 6 x parameters x real tokens per second / the measured single-thread
fp32 matmul peak (attention-score FLOPs neglected).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

from common import print_table, run_isolated, tcmalloc_path
from transformers import TrainerCallback

WORDS = (
    "the a of to and in is was for on with as by at from that this it be not are or which one two three "
    "red green blue cat dog bird tree sky sun moon answer question because therefore result first second "
    "step number plus minus times equals good bad yes no think final sum"
).split()

ROWS = {
    # A Llama small enough that framework overhead (data, collation, logging, optimizer) shows.
    "tiny-llama": dict(steps=20, max_length=256, lengths=[300, 240, 200, 160, 120, 90, 60, 30], batch_size=8),
    # The built-in SmolLM2-135M: compute-bound, so few steps.
    "smollm2-135m": dict(steps=5, max_length=256, lengths=[300, 200, 150, 100], batch_size=4),
}


def make_texts(tokenizer, lengths: list[int], seed: int = 0) -> list[str]:
    """Deterministic word salads of about `lengths` tokens each (EOS included)."""
    rng = random.Random(seed)
    texts = []
    for target in lengths:
        words: list[str] = []
        while len(tokenizer(" ".join(words))["input_ids"]) < target - 1:
            words.append(rng.choice(WORDS))
        texts.append(" ".join(words))
    return texts


class StepTimer(TrainerCallback):
    """Records when each optimizer step ends, in wall-clock and in this process's CPU time."""

    def __init__(self):
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def seconds_per_step(self, clock: list[float]) -> float:
        """Mean time of the steps after the first (whose warm-up is left out)."""
        return (clock[-1] - clock[0]) / (len(clock) - 1)


MODES = ("padded", "packed", "wrapped", "completion", "messages")


def make_dataset(texts: list[str], mode: str):
    """The rows of `mode`: plain text, or each text's first half as the prompt / user turn and the rest as the
    completion / assistant turn (the completion starts with a space, so both halves tokenize as the whole)."""
    from datasets import Dataset

    if mode in ("padded", "packed", "wrapped"):
        return Dataset.from_list([{"text": t} for t in texts])
    halves = []
    for text in texts:
        words = text.split(" ")
        cut = len(words) // 2
        halves.append((" ".join(words[:cut]), " " + " ".join(words[cut:])))
    if mode == "completion":
        return Dataset.from_list([{"prompt": p, "completion": c} for p, c in halves])
    return Dataset.from_list(
        [{"messages": [{"role": "user", "content": p}, {"role": "assistant", "content": c}]} for p, c in halves]
    )


def train(
    library: str,
    model_path: str,
    mode: str,
    steps: int,
    max_length: int,
    lengths: list[int],
    batch_size: int,
    chunked_loss: bool | None = None,
    peft: bool = False,
) -> dict:
    """One benchmark run (inside a fresh interpreter): trains `steps` steps and returns timings."""
    import torch
    from transformers import AutoTokenizer

    if library == "posttrain":
        from posttrain import SFTConfig, SFTTrainer
    else:
        from trl import SFTConfig, SFTTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    dataset = make_dataset(make_texts(tokenizer, lengths), mode)
    extra = {"chunked_loss": chunked_loss} if library == "posttrain" and chunked_loss is not None else {}
    args = SFTConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_sft_"),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        max_length=max_length,
        packing=mode in ("packed", "wrapped"),
        packing_strategy="wrapped" if mode == "wrapped" else "bfd",
        learning_rate=1e-4,
        logging_steps=1,
        seed=0,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **extra,
    )
    assert torch.get_num_threads() == 1, "set OMP_NUM_THREADS=1 before torch is imported"
    peft_config = None
    if peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = SFTTrainer(model_path, args=args, train_dataset=dataset, peft_config=peft_config)
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    assert len(rows) <= batch_size, "each step must train on the whole dataset"
    batch = trainer.data_collator(rows)
    trained = int((batch["labels"][:, 1:] != -100).sum())
    real = sum(len(r["input_ids"]) for r in rows)
    timer = StepTimer()
    trainer.add_callback(timer)
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    steps_s = timer.seconds_per_step(timer.cpu)
    return {
        "loss0": losses[0],
        "steps_per_s": 1 / steps_s,
        "tokens_per_s": trained / steps_s,
        "step_s": steps_s,
        "wall_step_s": timer.seconds_per_step(timer.wall),
        "trained_tokens": trained,
        "real_tokens": real,
        "params": sum(p.numel() for p in trainer.model.parameters()),
    }


HEADERS = [
    "model",
    "mode",
    "alloc",
    "tok/step",
    "pt steps/s",
    "trl steps/s",
    "pt/trl",
    "pt/trl wall",
    "pt tok/s",
    "trl tok/s",
    "pt RSS MB",
    "trl RSS MB",
    "pt loss0",
    "trl loss0",
    "|dloss0|",
    "pt MFU",
    "trl MFU",
]


def _model_paths(rows: list[str], workdir: str) -> dict[str, str]:
    paths = {}
    if "tiny-llama" in rows:
        from posttrain.models.tiny import save_tiny_model

        paths["tiny-llama"] = save_tiny_model(f"{workdir}/tiny-llama", hidden_size=256, num_layers=4)
    if "smollm2-135m" in rows:
        from posttrain.models.builtin import builtin_model_path

        paths["smollm2-135m"] = builtin_model_path()
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="Comma-separated: " + ", ".join(ROWS))
    parser.add_argument("--modes", default=",".join(MODES), help="Comma-separated: " + ", ".join(MODES))
    parser.add_argument("--repeats", type=int, default=2, help="Runs per library (alternating).")
    parser.add_argument("--tcmalloc", action="store_true", help="Also run both libraries with LD_PRELOAD=tcmalloc.")
    parser.add_argument(
        "--posttrain-full-logits",
        action="store_true",
        help="Also run posttrain with chunked_loss=False (against the same TRL runs).",
    )
    cli = parser.parse_args()
    rows, modes = cli.rows.split(","), cli.modes.split(",")
    allocators = {"malloc": {"LD_PRELOAD": ""}}  # not what scripts/env.sh may have preloaded
    if cli.tcmalloc:
        path = tcmalloc_path()
        if path is None:
            raise SystemExit("tcmalloc not found: apt-get install -y libtcmalloc-minimal4")
        allocators["tcmalloc"] = {"LD_PRELOAD": path}

    peak = max(run_isolated("common:matmul_peak_flops")["flops"] for _ in range(3))
    table = []
    with tempfile.TemporaryDirectory() as workdir:
        paths = _model_paths(rows, workdir)
        for row in rows:
            for mode in modes:
                for alloc, env in allocators.items():
                    variants = {"posttrain": None, "trl": None}
                    if cli.posttrain_full_logits:
                        variants["posttrain full logits"] = False
                    runs = {name: [] for name in variants}
                    for _ in range(cli.repeats):
                        for name, chunked in variants.items():
                            kwargs = dict(
                                library=name.split()[0],
                                model_path=paths[row],
                                mode=mode,
                                chunked_loss=chunked,
                                **ROWS[row],
                            )
                            runs[name].append(run_isolated("bench_sft:train", kwargs, env=env))
                    for name in runs:
                        if name.startswith("posttrain"):
                            label = mode + name[len("posttrain") :]
                            table.append(
                                _table_row(row, label, alloc, {"posttrain": runs[name], "trl": runs["trl"]}, peak)
                            )
                            print_table(HEADERS, table[-1:], title=None)
    print()
    print_table(
        HEADERS,
        table,
        title=f"SFT, posttrain (pt) vs TRL, 1 thread, best of {cli.repeats} alternating runs "
        f"each; pt/trl = speed ratio (CPU time; wall time); fp32 matmul peak "
        f"{peak / 1e9:.1f} GFLOP/s",
    )


def _table_row(row: str, mode: str, alloc: str, runs: dict[str, list[dict]], peak: float) -> list:
    best = {lib: min(results, key=lambda r: r["step_s"]) for lib, results in runs.items()}
    pt, trl = best["posttrain"], best["trl"]
    if pt["trained_tokens"] != trl["trained_tokens"]:
        print(
            f"warning: {row}/{mode}: posttrain trains {pt['trained_tokens']} tokens per step, TRL "
            f"{trl['trained_tokens']}"
        )
    rss = {lib: max(r["peak_rss_mb"] for r in results) for lib, results in runs.items()}

    def mfu(result):
        return 6 * result["params"] * result["real_tokens"] / result["step_s"] / peak

    wall = {lib: min(r["wall_step_s"] for r in results) for lib, results in runs.items()}
    return [
        row,
        mode,
        alloc,
        pt["trained_tokens"],
        1 / pt["step_s"],
        1 / trl["step_s"],
        trl["step_s"] / pt["step_s"],
        wall["trl"] / wall["posttrain"],
        pt["trained_tokens"] / pt["step_s"],
        trl["trained_tokens"] / trl["step_s"],
        rss["posttrain"],
        rss["trl"],
        f"{pt['loss0']:.6f}",
        f"{trl['loss0']:.6f}",
        f"{abs(pt['loss0'] - trl['loss0']):.1e}",
        mfu(pt),
        mfu(trl),
    ]


if __name__ == "__main__":
    main()
