"""A table of prompts, completions, their rewards and advantages printed to the terminal with rich (TRL's
`print_prompt_completions_sample`, which online trainers call when `log_completions` is on)."""

from __future__ import annotations

import random
from typing import Any


def _message_text(message: dict[str, Any]):
    """One chat message as rich Text: the role in capitals, then the reasoning, the content and any tool calls."""
    from rich.text import Text

    text = Text()
    text.append(str(message.get("role", "")).upper(), style="bold")
    reasoning = message.get("reasoning_content") or message.get("thinking")
    if reasoning:
        text.append("\n" + str(reasoning), style="italic dim")
    content = message.get("content")
    if isinstance(content, list):  # typed blocks: keep the text ones
        content = " ".join(str(block.get("text", f"<{block.get('type')}>")) for block in content)
    if content:
        text.append("\n" + str(content))
    for call in message.get("tool_calls") or []:
        function = call.get("function", call)
        text.append(f"\n{function.get('name')}({function.get('arguments', '')})", style="cyan")
    if message.get("role") == "tool" and "name" in message and "args" in message:
        text.append(f"\n{message['name']}({message['args']})", style="cyan")
    return text


def _cell(value: Any):
    from rich.text import Text

    if isinstance(value, list) and all(isinstance(m, dict) for m in value):
        parts = [_message_text(message) for message in value]
        return Text("\n\n").join(parts)
    return Text(str(value))


def print_prompt_completions_sample(
    prompts: list,
    completions: list,
    rewards: dict[str, list[float]],
    advantages: list[float] | None,
    step: int,
    num_samples: int | None = None,
    extra: dict[str, list] | None = None,
) -> None:
    """Prints one row per sample (all of them, or `num_samples` drawn at random): the prompt and the completion
    (strings, or conversations shown message by message), each reward, the advantage and any `extra` column, in a
    panel titled with the step."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.table import Table

    extra = extra or {}
    rows = list(range(len(prompts)))
    if num_samples is not None and num_samples < len(rows):
        rows = sorted(random.sample(rows, num_samples))
    table = Table(show_header=True, header_style="bold white", expand=False, show_lines=True)
    table.add_column("Prompt", style="bright_yellow")
    table.add_column("Completion", style="bright_green")
    for name in rewards:
        table.add_column(name, style="bold cyan", justify="right")
    if advantages is not None:
        table.add_column("Advantage", style="bold magenta", justify="right")
    for name in extra:
        table.add_column(name)
    for i in rows:
        cells = [_cell(prompts[i]), _cell(completions[i])]
        cells += [f"{values[i]:.2f}" for values in rewards.values()]
        if advantages is not None:
            cells.append(f"{advantages[i]:.2f}")
        cells += [str(values[i]) for values in extra.values()]
        table.add_row(*cells)
    Console().print(Panel(table, expand=False, title=f"Step {step}", border_style="bold white"))
