"""bf16 autocast against float32 on a CPU: the step time of the same run with `bf16=True` (TRL's default, and
posttrain's, on every device) and `bf16=False`.

Cases (each precision in a fresh single-threaded interpreter, the two alternating, `--repeats` pairs):

    sft-lora   the main job's shape (examples/sft_smollm2.yaml): the built-in SmolLM2-135M-Instruct, LoRA r=16 on
               every linear layer, GSM8K-style rows (examples/data/gsm_sft.jsonl), completion-only loss,
               max_length 256, padding-free, batch 4
    sft-full   the same, full fine-tuning
    grpo-tiny  GRPO on the tests' tiny Llama (posttrain.models.tiny): 8 prompts x 4 completions of 16 tokens
    grpo-smol  GRPO on SmolLM2-135M-Instruct: 2 prompts x 4 completions of 32 tokens

Reported per run: the median steady step (the first step left out) in wall and process-CPU seconds, the first
step's loss. On a machine shared with other jobs the CPU-time figure is the one that measures the code.

    OMP_NUM_THREADS=1 python benchmarks/bench_bf16_cpu.py [--cases sft-lora grpo-tiny] [--steps 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from common import REPO_ROOT, print_table, run_isolated

CASES = ("sft-lora", "sft-full", "grpo-tiny", "grpo-smol")


def _timer():
    from transformers import TrainerCallback

    marks = [(time.perf_counter(), time.process_time())]

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            marks.append((time.perf_counter(), time.process_time()))

    return marks, Timer()


def _common(output_dir: str, bf16: bool, steps: int) -> dict:
    return dict(
        output_dir=output_dir, bf16=bf16, max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, seed=0, write_report=False,
    )  # fmt: skip


def _sft(case: str, bf16: bool, steps: int, output_dir: str, callback):
    from datasets import load_dataset
    from peft import LoraConfig

    from posttrain import SFTConfig, SFTTrainer
    from posttrain.models.builtin import builtin_model_path

    data = load_dataset("json", data_files=str(REPO_ROOT / "examples/data/gsm_sft.jsonl"), split="train")
    args = SFTConfig(
        **_common(output_dir, bf16, steps), per_device_train_batch_size=4, learning_rate=3e-4,
        max_length=256, padding_free=True, completion_only_loss=True,
    )  # fmt: skip
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
    return SFTTrainer(
        builtin_model_path(),
        args=args,
        train_dataset=data.select(range(4 * steps)),
        peft_config=lora if case == "sft-lora" else None,
        callbacks=[callback],
    )


def _grpo(case: str, bf16: bool, steps: int, output_dir: str, callback):
    from datasets import Dataset

    from posttrain import GRPOConfig, GRPOTrainer

    if case == "grpo-tiny":
        from posttrain.models.tiny import save_tiny_model

        model, shape = str(save_tiny_model(f"{output_dir}/tiny")), dict(prompts=8, generations=4, tokens=16)
    else:
        from posttrain.models.builtin import builtin_model_path

        model, shape = builtin_model_path(), dict(prompts=2, generations=4, tokens=32)
    words = ["cat", "dog", "sky", "sun", "sea", "tree", "moon", "star"]
    rows = [{"prompt": f"Write one sentence about the {words[i % 8]} number {i}."} for i in range(64)]
    args = GRPOConfig(
        **_common(output_dir, bf16, steps), per_device_train_batch_size=shape["prompts"] * shape["generations"],
        num_generations=shape["generations"], max_completion_length=shape["tokens"], learning_rate=1e-5,
    )  # fmt: skip
    reward = lambda completions, **kw: [float(len(str(c))) for c in completions]  # noqa: E731
    data = Dataset.from_list(rows)
    return GRPOTrainer(model, reward_funcs=reward, args=args, train_dataset=data, callbacks=[callback])


def run_case(case: str, bf16: bool, steps: int) -> dict:
    """One run: builds the trainer, trains `steps` steps, returns the step times."""
    import torch

    torch.set_num_threads(1)
    marks, timer = _timer()
    with tempfile.TemporaryDirectory(prefix="bench_bf16_") as output_dir:
        build = _sft if case.startswith("sft") else _grpo
        trainer = build(case, bf16, steps, output_dir, timer)
        assert trainer.args.bf16 is bf16 and trainer.args.mixed_precision == ("bf16" if bf16 else "no")
        marks.clear()
        marks.append((time.perf_counter(), time.process_time()))
        trainer.train()
        loss = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
    wall = [b[0] - a[0] for a, b in zip(marks, marks[1:])]
    cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:])]
    return {"wall": wall, "cpu": cpu, "loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=["sft-lora", "grpo-tiny"], choices=CASES)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    rows = []
    for case in options.cases:
        runs = {True: [], False: []}
        for repeat in range(options.repeats):
            order = (False, True) if repeat % 2 == 0 else (True, False)
            for bf16 in order:
                result = run_isolated("bench_bf16_cpu:run_case", dict(case=case, bf16=bf16, steps=options.steps))
                runs[bf16].append(result)
                load = result["conditions"].get("load_average", "")
                print(f"{case} bf16={bf16}: step cpu {result['cpu']} wall {result['wall']} load {load}", flush=True)
        for bf16 in (False, True):
            steady = [(statistics.median(r["cpu"][1:]), statistics.median(r["wall"][1:])) for r in runs[bf16]]
            rows.append(
                [
                    case,
                    "bf16 autocast" if bf16 else "float32",
                    ", ".join(f"{c:.2f}" for c, _ in steady),
                    ", ".join(f"{w:.2f}" for _, w in steady),
                    f"{runs[bf16][0]['loss']:.4f}",
                ]
            )
    print_table(["case", "precision", "step CPU s (per run)", "step wall s (per run)", "first loss"], rows)


if __name__ == "__main__":
    main()
