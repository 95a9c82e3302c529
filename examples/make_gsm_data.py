"""Writes the main job's data: GSM8K-style word problems with chain-of-thought solutions from
reasoning-gym's `gsm_symbolic` generator (Apache-2.0), as conversational prompt-completion JSONL.

    python examples/make_gsm_data.py            # -> examples/data/gsm_sft.jsonl, gsm_sft_eval.jsonl

The files are committed, so the main job does not need reasoning-gym; rerun this to regenerate them.
"""

import json
import sys
from pathlib import Path

import reasoning_gym


def rows(size: int, seed: int):
    for item in reasoning_gym.create_dataset("gsm_symbolic", size=size, seed=seed):
        yield {
            "prompt": [{"role": "user", "content": item["question"]}],
            "completion": [{"role": "assistant", "content": item["metadata"]["answer_cot"]}],
            "solution": item["answer"],
        }


def main(out_dir: str = "examples/data", train_size: int = 400, eval_size: int = 16) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, size, seed in (("gsm_sft.jsonl", train_size, 1), ("gsm_sft_eval.jsonl", eval_size, 2)):
        with open(out / name, "w") as f:
            for row in rows(size, seed):
                f.write(json.dumps(row) + "\n")
        print(f"wrote {size} rows to {out / name}")


if __name__ == "__main__":
    main(*sys.argv[1:2])
