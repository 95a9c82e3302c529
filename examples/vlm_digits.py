"""A vision-language model learns to read digits: SFT, then GRPO with an exact-match reward, all on the CPU.

The model is LLaVA-style: the built-in SmolLM2-135M-Instruct as the language model, and a small fresh SigLIP tower
(32 px images, 8 px patches: 16 image tokens) with a fresh projector (`posttrain.models.tiny_vlm`). The images are
digits drawn with PIL's bundled font, randomly scaled, shifted, rotated and noised (no download, no scikit-learn).
Held-out accuracy (greedy decoding, the first digit of the answer) is measured before training, after SFT and after
GRPO, with the wall times.

    OMP_NUM_THREADS=2 python examples/vlm_digits.py --sft_steps 150 --grpo_steps 30
"""

from __future__ import annotations

import argparse
import random
import re
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from PIL import Image, ImageDraw, ImageFont
from transformers import AutoModelForImageTextToText, AutoProcessor

from posttrain import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
from posttrain.data.transforms import prepare_multimodal_messages
from posttrain.models import tiny_vlm
from posttrain.models.builtin import builtin_model_path

QUESTION = "Which digit is in the image? Reply with the digit only."
DIGIT = re.compile(r"\d")


def digit_image(digit: int, rng: random.Random, size: int = 32) -> Image.Image:
    """One digit, white on a noisy dark background, at a random size, offset and angle."""
    canvas = Image.new("L", (size * 2, size * 2), 0)
    font = ImageFont.load_default(size=rng.randint(int(size * 0.7), int(size * 1.0)))
    ImageDraw.Draw(canvas).text((size + rng.randint(-4, 4), size + rng.randint(-4, 4)), str(digit), fill=255,
                                font=font, anchor="mm")
    canvas = canvas.rotate(rng.uniform(-20, 20), resample=Image.BILINEAR)
    crop = canvas.crop((size // 2, size // 2, size // 2 + size, size // 2 + size))
    noise = np.random.RandomState(rng.randint(0, 2**31)).normal(0, 25, (size, size))
    pixels = np.asarray(crop, dtype=np.float32) + noise
    return Image.fromarray(np.clip(pixels, 0, 255).astype("uint8")).convert("RGB")


def digits(count: int, seed: int) -> list[tuple[Image.Image, int]]:
    rng = random.Random(seed)
    return [(digit_image(d, rng), d) for d in (rng.randrange(10) for _ in range(count))]


def prompt(with_answer: int | None = None) -> dict:
    row = {"prompt": [{"role": "user", "content": QUESTION}]}
    if with_answer is not None:
        row["completion"] = [{"role": "assistant", "content": str(with_answer)}]
    return row


def exact_match(completions, answer, **kwargs) -> list[float]:
    """1.0 when the reply, stripped, is exactly the digit."""
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer)]


@torch.no_grad()
def accuracy(model, processor, samples, batch_size: int = 32) -> float:
    """Greedy decoding; a reply counts as right when its first digit is the answer."""
    model.eval()
    right = 0
    for start in range(0, len(samples), batch_size):
        chunk = samples[start:start + batch_size]
        texts = [processor.apply_chat_template(prepare_multimodal_messages(prompt()["prompt"], [image]),
                                               add_generation_prompt=True, tokenize=False) for image, _ in chunk]
        inputs = processor(text=texts, images=[[image] for image, _ in chunk], padding=True, padding_side="left",
                           add_special_tokens=False, return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=3, do_sample=False,
                                suppress_tokens=[model.config.image_token_id])
        replies = processor.batch_decode(output[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        right += sum(bool(m := DIGIT.search(r)) and m.group() == str(d) for r, (_, d) in zip(replies, chunk))
    return right / len(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output_dir", default="outputs/vlm_digits")
    parser.add_argument("--train_size", type=int, default=1200)
    parser.add_argument("--test_size", type=int, default=200)
    parser.add_argument("--sft_steps", type=int, default=150)
    parser.add_argument("--grpo_steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--full_finetune", dest="freeze_language_model", action="store_false",
                        help="also train the language model (slower)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    out = Path(args.output_dir)
    started = time.perf_counter()

    model_path = tiny_vlm.build_llava_from_causal_lm(builtin_model_path(), out / "base", seed=args.seed,
                                                     vision_hidden_size=64)
    processor = AutoProcessor.from_pretrained(model_path)
    train, test = digits(args.train_size, args.seed), digits(args.test_size, args.seed + 1)
    model = AutoModelForImageTextToText.from_pretrained(model_path)
    if args.freeze_language_model:  # only the fresh tower and projector learn (SmolLM2 stays as it is)
        for name, parameter in model.named_parameters():
            if "language_model" in name or "lm_head" in name:
                parameter.requires_grad_(False)
    before = accuracy(model, processor, test)
    print(f"held-out accuracy before training: {before:.3f}")

    common = dict(logging_steps=10, save_strategy="no", report_to="none", use_cpu=True, bf16=False,
                  seed=args.seed, disable_tqdm=True)
    sft_data = Dataset.from_list([{"images": [image], **prompt(d)} for image, d in train])
    sft_start = time.perf_counter()
    sft = SFTTrainer(model, args=SFTConfig(output_dir=str(out / "sft"), max_steps=args.sft_steps,
                                           per_device_train_batch_size=args.batch_size, learning_rate=1e-3,
                                           lr_scheduler_type="cosine", warmup_steps=10,
                                           freeze_vision_tower=False, **common),  # the tower is fresh
                     train_dataset=sft_data, processing_class=processor)
    sft.train()
    sft_seconds = time.perf_counter() - sft_start
    after_sft = accuracy(sft.model, processor, test)
    print(f"held-out accuracy after SFT: {after_sft:.3f} ({sft_seconds:.0f} s)")

    grpo_data = Dataset.from_list([{"images": [image], **prompt(), "answer": str(d)} for image, d in train])
    grpo_start = time.perf_counter()
    grpo = GRPOTrainer(sft.model, reward_funcs=exact_match, processing_class=processor, train_dataset=grpo_data,
                       args=GRPOConfig(output_dir=str(out / "grpo"), max_steps=args.grpo_steps,
                                       per_device_train_batch_size=args.batch_size, num_generations=8,
                                       max_completion_length=4,
                                       learning_rate=1e-4, beta=0.0, temperature=1.0, **common))
    grpo.train()
    grpo_seconds = time.perf_counter() - grpo_start
    after_grpo = accuracy(grpo.model, processor, test)
    rewards = [log["reward"] for log in grpo.state.log_history if "reward" in log]
    print(f"held-out accuracy after GRPO: {after_grpo:.3f} ({grpo_seconds:.0f} s); train reward per logging "
          f"window: {[round(r, 3) for r in rewards]}")
    print(f"before {before:.3f} -> SFT {after_sft:.3f} -> GRPO {after_grpo:.3f}; "
          f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
