"""Mixture-of-Experts expert computation: transformers 5's implementations side by side, CPU time per training step
(forward and backward of a Qwen3-MoE sparse block) and per no-grad forward, one thread, alternating runs.

    python benchmarks/bench_moe_experts.py [--repeats 3]

"eager" is a Python loop over the experts that tokens were routed to (one gather, two matmuls and a scatter per
expert); "batched_mm" gathers each token's k experts' weights and multiplies them in one batched matmul;
"grouped_mm" (transformers' default where torch has the kernel) sorts the token-expert pairs by expert and runs one
grouped matmul per projection. posttrain keeps the model's implementation (grouped_mm by default) and runs the
expert block as it is, also inside its fast no-grad forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import print_table, run_isolated

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")
# (name, hidden, experts, experts per token, expert width, tokens): the tiny test model, and a block with many small
# experts like Qwen3-30B-A3B's, scaled down (batched_mm gathers every token's experts' weights: 1.6 GB here).
SHAPES = {
    "tiny": (32, 4, 2, 16, 256),
    "medium": (256, 32, 4, 128, 1024),
}


def block_times(implementation: str, shape: str, steps: int = 5) -> dict:
    """CPU ms per forward+backward and per no-grad forward of one sparse MoE block."""
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.set_num_threads(1)
    hidden, experts, top_k, width, tokens = SHAPES[shape]
    config = Qwen3MoeConfig(
        hidden_size=hidden, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width
    )
    config._experts_implementation = implementation
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(config)
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.02)
    x = torch.randn(1, tokens, hidden, requires_grad=True)

    def train_step():
        block(x).square().mean().backward()

    def forward():
        with torch.no_grad():
            block(x)

    result = {}
    for name, run in (("train_ms", train_step), ("forward_ms", forward)):
        run()  # warm-up
        start = time.process_time()
        for _ in range(steps):
            run()
        result[name] = 1000 * (time.process_time() - start) / steps
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        runs = {impl: [] for impl in IMPLEMENTATIONS}
        for repeat in range(args.repeats):
            order = IMPLEMENTATIONS if repeat % 2 == 0 else tuple(reversed(IMPLEMENTATIONS))
            for impl in order:
                runs[impl].append(run_isolated("bench_moe_experts:block_times", dict(implementation=impl, shape=shape)))
        eager = {key: statistics.median(r[key] for r in runs["eager"]) for key in ("train_ms", "forward_ms")}
        for impl, results in runs.items():
            train = statistics.median(r["train_ms"] for r in results)
            forward = statistics.median(r["forward_ms"] for r in results)
            rows.append(
                [
                    shape,
                    impl,
                    f"{train:.2f}",
                    f"{eager['train_ms'] / train:.2f}x",
                    f"{forward:.2f}",
                    f"{eager['forward_ms'] / forward:.2f}x",
                ]
            )
    print_table(
        ["block", "experts", "train step ms", "vs eager", "no-grad forward ms", "vs eager"],
        rows,
        title=f"Qwen3-MoE sparse block, CPU ms (1 thread, median of {args.repeats} alternating runs); "
        f"shapes (hidden, experts, per token, expert width, tokens): {SHAPES}",
    )


if __name__ == "__main__":
    main()
