"""What the vLLM tests compare the engine with: the trainer's model, evaluated by transformers."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from posttrain.generation import SamplingParams
from posttrain.online.episodes import ToolRollouts
from posttrain.tools import ParsedTurn, ToolCall

PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 3, 9]]
EOS = 2
# Both sides compute in float32 but with different matmul kernels (oneDNN in vLLM), so logits of magnitude
# ~20-30 differ by ~1e-5 and log-probs by up to ~3e-4; a missed or wrong weight sync is off by > 0.1.
LOGP_ATOL = 3e-4


def perturbed_model(path: str, seed: int):
    """The saved model with every weight moved far from what the server loaded, so that only a working
    sync can make the two agree."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return model


@torch.no_grad()
def reference_logps(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The trainer's log-probs of `completion` after `prompt`, log-softmax in float64."""
    logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


@torch.no_grad()
def reference_greedy(model, prompt: list[int], steps: int, eos: int | None = EOS) -> tuple[list[int], float]:
    """Greedy decoding with the trainer's model, stopping after `eos` as a vLLM server does (it stops at the
    tokenizer's EOS even when a request names no stop ids), and the smallest gap between the best two logits
    (a tie could be broken either way by rounding)."""
    ids, gap = list(prompt), float("inf")
    for _ in range(steps):
        top = model(torch.tensor([ids])).logits[0, -1].double().topk(2)
        gap = min(gap, float(top.values[0] - top.values[1]))
        ids.append(int(top.indices[0]))
        if ids[-1] == eos:
            break
    return ids[len(prompt) :], gap


def low_id_fraction(completion_ids, **kwargs) -> list[float]:
    """A reward that varies between the random tiny model's completions: the share of token ids below 192."""
    return [sum(t < 192 for t in ids) / max(len(ids), 1) for ids in completion_ids]


def grpo_with_vllm(model_path: str, output_dir, reward=low_id_fraction, **vllm_settings):
    """A GRPO trainer on the tiny model that generates with vLLM: 4 prompts x 4 completions per step,
    a learning rate large enough that every step moves the weights visibly."""
    from datasets import Dataset

    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=8,
        max_steps=3,
        learning_rate=3e-2,
        logging_steps=1,
        seed=0,
        use_cpu=True,
        bf16=vllm_settings.pop("bf16", False),
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_vllm=True,
        **vllm_settings,
    )
    dataset = Dataset.from_list([{"prompt": f"cat {i} and dog {2 * i}"} for i in range(16)])
    return GRPOTrainer(model_path, reward, args=config, train_dataset=dataset)


def logged_per_step(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


def echo(text: str) -> str:
    """Repeats its argument.

    Args:
        text: What to repeat.
    """
    return f"echo: {text}"


def every_turn_calls_echo(text: str) -> ParsedTurn:
    return ParsedTurn("", [ToolCall("echo", {"text": str(len(text))})])


def tool_episodes(backend, tokenizer, max_tokens: int = 48):
    """Greedy two-call episodes of PROMPTS where every finished turn calls `echo` (a random model writes no call)."""
    rollouts = ToolRollouts(
        backend,
        tokenizer,
        [echo],
        None,
        max_completion_length=max_tokens,
        max_iterations=2,
        parser=every_turn_calls_echo,
    )
    rows = [{"prompt": [{"role": "user", "content": "hi"}]} for _ in PROMPTS]
    return rollouts.generate(
        rows, PROMPTS, 1, SamplingParams(max_tokens=max_tokens, top_k=1), seeds=[0, 1, 2], prompt_column="prompt"
    ), rollouts


def transformers_tool_episodes(model_path: str, seed: int):
    """A perturbed model, its tokenizer with a tool template, stop ids that end prompt 0's first greedy turn after
    4 tokens, and tool_episodes on the transformers backend (checked to be multi-turn): the reference that a
    vLLM backend given the same model and stop ids must reproduce token for token."""
    from transformers import AutoTokenizer

    from posttrain.generation import TransformersBackend
    from posttrain.tools import use_chatml_tool_template

    model = perturbed_model(model_path, seed=seed)
    tokenizer = use_chatml_tool_template(AutoTokenizer.from_pretrained(model_path), default_system=None)
    greedy, gap = reference_greedy(model, PROMPTS[0], 6)
    assert gap > 1e-3, "near-tie in the greedy reference: pick another seed"
    stop_ids = [tokenizer.eos_token_id, greedy[3]]
    episodes, rollouts = tool_episodes(TransformersBackend(model, tokenizer.pad_token_id, stop_ids), tokenizer)
    assert episodes[0].token_ids[:4] == greedy[:4] and episodes[0].info["turns"] >= 2  # a real multi-turn episode
    assert rollouts.stats.calls >= 1 and 0 in episodes[0].model_mask  # tool-turn tokens are in the episode
    return model, tokenizer, stop_ids, episodes


def assert_same_episodes(expected, actual) -> None:
    for mine, theirs in zip(expected, actual, strict=True):
        assert (theirs.token_ids, theirs.model_mask, theirs.info, theirs.finished) == (
            mine.token_ids,
            mine.model_mask,
            mine.info,
            mine.finished,
        )
