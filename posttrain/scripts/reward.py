"""`python -m posttrain.scripts.reward`: TRL's `trl/scripts/reward.py` on posttrain. The command line is
`posttrain reward` (the flags and YAML keys of `trl reward`); `make_parser` and `main` drive the script from
Python as in TRL."""

from posttrain.cli.data import ScriptArguments
from posttrain.scripts import _run


def make_parser(subparsers=None, prog: str | None = None):
    return _run.make_parser("reward", ScriptArguments, subparsers, prog)


def main(script_args, training_args, model_args, dataset_args):
    _run.run("reward", script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    raise SystemExit(_run.command_line("reward"))
