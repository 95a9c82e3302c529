"""Padding-free batch layouts: the whole batch in one row (needed by flash attention) vs one row per
example (what SFTTrainer uses with sdpa / eager). Forward + backward of a tiny Llama, one thread.

    OMP_NUM_THREADS=1 python benchmarks/bench_packed_layout.py [--unpacked]
"""

import argparse
import os
import random
import statistics
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from posttrain.data.collators import LanguageModelingCollator  # noqa: E402
from posttrain.data.packing import pack_dataset  # noqa: E402
from posttrain.losses.sft import nll_sum  # noqa: E402
from posttrain.models.tiny import save_tiny_model  # noqa: E402


def step_seconds(model, batch, repeats: int) -> tuple[float, float]:
    """Median forward+backward seconds and the loss."""
    batch = dict(batch)
    labels = batch.pop("labels")
    times = []
    for _ in range(repeats):
        model.zero_grad()
        start = time.perf_counter()
        loss_sum, _, count = nll_sum(model(**batch).logits, labels)
        (loss_sum / count).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times), (loss_sum / count).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unpacked", action="store_true", help="8 plain examples instead of 8 packed rows")
    parser.add_argument("--repeats", type=int, default=10)
    options = parser.parse_args()
    torch.manual_seed(0)
    random.seed(0)
    path = save_tiny_model(os.path.join(tempfile.mkdtemp(), "model"))
    lengths = [random.randint(20, 200) for _ in range(64)]
    data = Dataset.from_dict({"input_ids": [[random.randint(3, 300) for _ in range(n)] for n in lengths]})
    source = data if options.unpacked else pack_dataset(data, 512, "bfd")
    rows = [source[i] for i in range(8)]
    print(
        f"{'unpacked' if options.unpacked else 'packed'}: {len(rows)} rows, "
        f"{sum(len(r['input_ids']) for r in rows)} tokens"
    )
    print(
        f"{'attention':<10}{'one row ms':>12}{'per row ms':>12}{'speed-up':>10}{'loss one row':>14}{'loss per row':>14}"
    )
    for attention in ("sdpa", "eager"):
        model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention)
        one, one_loss = step_seconds(model, LanguageModelingCollator(0, True, one_row=True)(rows), options.repeats)
        per, per_loss = step_seconds(model, LanguageModelingCollator(0, True, one_row=False)(rows), options.repeats)
        print(
            f"{attention:<10}{one * 1e3:>12.1f}{per * 1e3:>12.1f}{one / per:>10.2f}{one_loss:>14.6f}{per_loss:>14.6f}"
        )


if __name__ == "__main__":
    main()
