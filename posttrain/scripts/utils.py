"""TRL's `trl.scripts.utils` names, from posttrain."""

from posttrain.compat import (  # noqa: F401
    DatasetConfig,
    DatasetMixtureConfig,
    ScriptArguments,
    TrlParser,
    get_dataset,
    init_zero_verbose,
)
from posttrain.runtime.package_source import get_git_commit_hash  # noqa: F401
