"""TRL's private module path `trl.experimental.harbor._spec`, which TRL's own tests import: its two helpers under
TRL's private names, the same objects as the public `outcome_reward` and `resolve_agent`."""

from posttrain.experimental.harbor import outcome_reward as _outcome_reward_func
from posttrain.experimental.harbor import resolve_agent as _resolve_agent

__all__ = ["_outcome_reward_func", "_resolve_agent"]
