"""`python -m posttrain.scripts.rloo`: TRL's `trl/scripts/rloo.py` on posttrain. The command line is `posttrain rloo`
(the flags and YAML keys of `trl rloo`); `make_parser` and `main` drive the script from Python as in TRL."""

from posttrain.scripts import _run


class RLOOScriptArguments(_run.RewardScriptArguments):
    """ScriptArguments plus the reward model and reward functions of the RLOO script."""


def make_parser(subparsers=None, prog: str | None = None):
    return _run.make_parser("rloo", RLOOScriptArguments, subparsers, prog)


def main(script_args, training_args, model_args, dataset_args):
    _run.run("rloo", script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    raise SystemExit(_run.command_line("rloo"))
