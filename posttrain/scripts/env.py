"""TRL's `trl.scripts.env` import path; the report lives in `posttrain.cli.environment`."""

from posttrain.cli.environment import print_env

__all__ = ["print_env"]
