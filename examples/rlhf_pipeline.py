"""The classic RLHF pipeline on the built-in SmolLM2-135M-Instruct: SFT -> reward model -> PPO.

The task is reasoning-gym's basic_arithmetic (two-term sums and differences below 100), answered as
"<working> = <result>. The answer is <result>."

1. SFT (LoRA, merged afterwards) teaches that answer format.
2. RewardTrainer learns from preference pairs: the correct worked answer is preferred to a corrupted one
   (a wrong result carried through, or a final number that does not match the working).
3. PPO trains a LoRA adapter on the SFT model against that reward model. The reference is the SFT model (the
   adapter switched off, no copy). The critic is a value head on the policy, the cheapest one on a CPU; with
   --value_model_from_reward_model it is the classic separate value model, a trainable copy of the reward
   model (a full 135M-parameter backward per step, about twice the time).

It reports the reward model's held-out pairwise accuracy, and the policy's mean reward-model score and exact
answer accuracy on held-out problems (greedy decoding) before and after PPO, with the wall time of each stage.

    OMP_NUM_THREADS=1 python examples/rlhf_pipeline.py      # about 15 minutes on a CPU
    OMP_NUM_THREADS=1 python examples/rlhf_pipeline.py --sft_steps 2 --reward_steps 2 --ppo_steps 2 --eval_size 8

More threads than free cores slows PyTorch on a CPU down many times over: set OMP_NUM_THREADS to the cores
that are actually free.
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

import reasoning_gym
import torch
from datasets import Dataset
from peft import LoraConfig

from posttrain import PPOConfig, PPOTrainer, RewardConfig, RewardTrainer, SFTConfig, SFTTrainer
from posttrain.generation import SamplingParams, TransformersBackend, stop_token_ids
from posttrain.models import load_tokenizer
from posttrain.rewards.scoring import RewardScorer

MODEL = "builtin:SmolLM2-135M-Instruct"
INSTRUCTION = "Show the working, then the answer."
NUMBER = re.compile(r"-?\d+")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


# -- data ------------------------------------------------------------------------------------------------------
def problems(size: int, seed: int) -> list[dict]:
    items = reasoning_gym.create_dataset(
        "basic_arithmetic",
        size=size,
        seed=seed,
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=2,
        operators=("+", "-"),
        allow_parentheses=False,
        allow_negation=False,
    )
    return [
        {
            "prompt": [{"role": "user", "content": f"{item['question']} {INSTRUCTION}"}],
            "expression": item["metadata"]["expression"],
            "answer": item["answer"],
        }
        for item in items
    ]


def worked_answer(expression: str, result: int | str, final: int | str | None = None) -> list[dict]:
    final = result if final is None else final
    return [{"role": "assistant", "content": f"{expression} = {result}. The answer is {final}."}]


def corrupted_answer(problem: dict, rng: random.Random) -> list[dict]:
    """A wrong final number: either the working is wrong too, or the answer contradicts correct working."""
    right = int(problem["answer"])
    wrong = right + rng.choice([-10, -2, -1, 1, 2, 10])
    if rng.random() < 0.5:
        return worked_answer(problem["expression"], wrong)
    return worked_answer(problem["expression"], right, wrong)


def sft_dataset(items: list[dict]) -> Dataset:
    return Dataset.from_list(
        [{"prompt": p["prompt"], "completion": worked_answer(p["expression"], p["answer"])} for p in items]
    )


def preference_dataset(items: list[dict], seed: int) -> Dataset:
    rng = random.Random(seed)
    return Dataset.from_list(
        [
            {
                "prompt": p["prompt"],
                "chosen": worked_answer(p["expression"], p["answer"]),
                "rejected": corrupted_answer(p, rng),
            }
            for p in items
        ]
    )


def prompt_dataset(items: list[dict]) -> Dataset:
    return Dataset.from_list([{"prompt": p["prompt"], "answer": p["answer"]} for p in items])


# -- measurements ----------------------------------------------------------------------------------------------
def exact_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's last number is the answer."""
    scores = []
    for completion, expected in zip(completions, answer):
        numbers = NUMBER.findall(completion[-1]["content"])
        scores.append(float(bool(numbers) and int(numbers[-1]) == int(expected)))
    return scores


def reward_model_accuracy(scorer: RewardScorer, pairs: Dataset) -> float:
    """Fraction of held-out pairs whose chosen answer the reward model scores above the rejected one."""

    def scores(column: str) -> torch.Tensor:
        return scorer(pairs["prompt"], pairs[column], [[]] * len(pairs), {})[1]

    return (scores("chosen") > scores("rejected")).float().mean().item()


def evaluate(model, tokenizer, scorer: RewardScorer, held_out: Dataset, max_tokens: int) -> dict[str, float]:
    """Greedy answers to held-out problems: mean reward-model score and exact-answer accuracy."""
    prompt_ids = [
        tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False)
        for p in held_out["prompt"]
    ]
    backend = TransformersBackend(model, tokenizer.pad_token_id, stop_token_ids(tokenizer, model))
    generated = backend.generate(prompt_ids, 1, SamplingParams(max_tokens=max_tokens, top_k=1), seed=0)
    completions = [
        [{"role": "assistant", "content": tokenizer.decode(c.token_ids, skip_special_tokens=True)}] for c in generated
    ]
    _, rewards = scorer(held_out["prompt"], completions, [c.token_ids for c in generated], {})
    accuracy = exact_answer(completions, held_out["answer"])
    print(f"    e.g. {held_out['prompt'][0][0]['content']!r} -> {completions[0][0]['content']!r}")
    return {"reward": rewards.mean().item(), "accuracy": sum(accuracy) / len(accuracy)}


def common_settings(output_dir: Path, name: str) -> dict:
    return dict(
        output_dir=str(output_dir / name),
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
    )


# -- the pipeline ----------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft_steps", type=int, default=20)
    parser.add_argument("--reward_steps", type=int, default=25)
    parser.add_argument("--ppo_steps", type=int, default=16)
    parser.add_argument("--value_model_from_reward_model", action="store_true")
    parser.add_argument("--train_size", type=int, default=600)
    parser.add_argument("--eval_size", type=int, default=64)
    parser.add_argument("--max_completion_length", type=int, default=24)
    parser.add_argument("--output_dir", default="outputs/rlhf_pipeline")
    options = parser.parse_args()
    output_dir = Path(options.output_dir)
    tokenizer = load_tokenizer(MODEL)
    train_items = problems(options.train_size, seed=0)
    held_out_items = problems(options.eval_size, seed=1234)
    third = len(train_items) // 3
    sft_items, reward_items, ppo_items = train_items[:third], train_items[third : 2 * third], train_items[2 * third :]
    times = {}

    print("1. SFT")
    start = time.perf_counter()
    sft = SFTTrainer(
        MODEL,
        args=SFTConfig(
            max_steps=options.sft_steps,
            per_device_train_batch_size=8,
            learning_rate=2e-4,
            max_length=128,
            **common_settings(output_dir, "sft"),
        ),
        train_dataset=sft_dataset(sft_items),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"),
    )
    sft.train()
    sft_path = output_dir / "sft_merged"
    sft.model.merge_and_unload().save_pretrained(sft_path)
    tokenizer.save_pretrained(sft_path)
    times["sft"] = time.perf_counter() - start

    print("2. Reward model")
    start = time.perf_counter()
    reward = RewardTrainer(
        str(sft_path),
        args=RewardConfig(
            max_steps=options.reward_steps,
            per_device_train_batch_size=4,
            learning_rate=3e-4,
            max_length=128,
            **common_settings(output_dir, "reward"),
        ),
        train_dataset=preference_dataset(reward_items, seed=0),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="SEQ_CLS"),
    )
    reward.train()
    reward_model = reward.model.merge_and_unload().eval()
    scorer = RewardScorer([reward_model], reward_processing_classes=[tokenizer])
    reward_accuracy = reward_model_accuracy(scorer, preference_dataset(held_out_items, seed=1))
    times["reward model"] = time.perf_counter() - start
    print(f"    reward model held-out pairwise accuracy: {reward_accuracy:.3f}")

    print("3. PPO")
    held_out = prompt_dataset(held_out_items)
    start = time.perf_counter()
    trainer = PPOTrainer(
        str(sft_path),
        reward_model,
        args=PPOConfig(
            max_steps=options.ppo_steps,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            num_ppo_epochs=2,
            learning_rate=1e-4,
            kl_coef=0.05,
            max_completion_length=options.max_completion_length,
            max_prompt_length=64,
            temperature=0.7,
            missing_eos_penalty=1.0,
            use_value_head=not options.value_model_from_reward_model,
            **common_settings(output_dir, "ppo"),
        ),
        train_dataset=prompt_dataset(ppo_items),
        processing_class=tokenizer,
        peft_config=LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"),
    )
    setup = time.perf_counter() - start
    before = evaluate(trainer.model, tokenizer, scorer, held_out, options.max_completion_length)
    print(f"    before PPO: held-out reward {before['reward']:.3f}, accuracy {before['accuracy']:.3f}")
    start = time.perf_counter()
    trainer.train()
    times["ppo"] = setup + time.perf_counter() - start
    after = evaluate(trainer.model, tokenizer, scorer, held_out, options.max_completion_length)

    history = trainer.state.log_history
    print(
        "    training score per logging window:",
        [round(h["objective/scores"], 3) for h in history if "objective/scores" in h],
    )
    print(
        "    KL to the reference per logging window:",
        [round(h["objective/kl"], 3) for h in history if "objective/kl" in h],
    )
    print(f"\nreward model held-out pairwise accuracy: {reward_accuracy:.3f}")
    print(
        f"policy on {len(held_out)} held-out problems (greedy): reward-model score {before['reward']:.3f} -> "
        f"{after['reward']:.3f}, exact-answer accuracy {before['accuracy']:.3f} -> {after['accuracy']:.3f}"
    )
    print("wall time: " + ", ".join(f"{stage} {seconds:.0f} s" for stage, seconds in times.items()))


if __name__ == "__main__":
    main()
