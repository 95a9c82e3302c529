"""Where the prompts and rewards come from when environments own them (TRL's `environment_factory=` semantics).

An environment may own the data: its `reset()` returns the prompt, so no `train_dataset` is needed. The engine
then trains on one round of empty user messages, cycled, and `max_steps` sets the length of the run. A dict of
environments routes each row by its `environment` column, so it still needs a dataset, but that dataset may
hold only the routing column: a missing `prompt` is an empty user message, kept out of `reset()`'s keywords.

An environment with `get_reward()` is one more reward source after the trainer's own, of weight 1:
`reward_weights` and `reward_processing_classes` describe only the reward functions the user passed.
"""

from __future__ import annotations

from collections.abc import Mapping

from datasets import Dataset

from posttrain.errors import ConfigError, DataError
from posttrain.online.prompts import column_names
from posttrain.online.rollout import PROMPT_COLUMN
from posttrain.training.streaming import is_streaming

__all__ = ["EMPTY_PROMPT", "environment_dataset", "environment_reward_settings"]

EMPTY_PROMPT = [{"role": "user", "content": ""}]


def environment_dataset(train_dataset, args, environment_factory, trainer_name: str) -> tuple[object, bool]:
    """`(train_dataset, prompt_is_placeholder)`: the dataset to train on, and whether its 'prompt' column is the
    engine's empty user message rather than the user's (then `reset()` does not receive it)."""
    if train_dataset is None:
        if environment_factory is None:
            raise DataError(
                f"`train_dataset` is required unless an `environment_factory` is provided: {trainer_name} trains "
                "on a dataset with a 'prompt' column, or on prompts its environments return from reset()."
            )
        if isinstance(environment_factory, Mapping):
            raise ConfigError(
                "A dict environment_factory (multiple environments) requires a `train_dataset` with an "
                "'environment' column naming each row's environment; pass one, or a single environment factory."
            )
        if args.max_steps is None or args.max_steps <= 0:
            raise ConfigError(
                "Without a train_dataset the environment owns the data (reset() returns the prompt), so nothing "
                "bounds the run: set max_steps to a positive number of optimizer steps."
            )
        rows = args.generation_batch_size // args.num_generations
        return Dataset.from_dict({PROMPT_COLUMN: [EMPTY_PROMPT] * rows}), True
    if environment_factory is None or PROMPT_COLUMN in column_names(train_dataset):
        return train_dataset, False
    if is_streaming(train_dataset):
        return train_dataset.map(lambda row: {PROMPT_COLUMN: EMPTY_PROMPT}), True
    return train_dataset.add_column(PROMPT_COLUMN, [EMPTY_PROMPT] * len(train_dataset)), True


def environment_reward_settings(args, reward_processing_classes, owned: int, from_environments: int):
    """`(reward_weights, reward_processing_classes)` for the `owned` reward functions followed by the
    environments' `get_reward` sources (weight 1, no tokenizer). Settings sized for every source are kept."""
    weights = args.reward_weights
    if weights is not None and from_environments and len(weights) == owned:
        weights = list(weights) + [1.0] * from_environments
    classes = reward_processing_classes
    if classes is not None and not isinstance(classes, (list, tuple)):
        classes = [classes]  # one tokenizer for one reward model, as TRL takes it
    if isinstance(classes, (list, tuple)) and from_environments and len(classes) == owned:
        classes = list(classes) + [None] * from_environments
    return weights, classes
