"""`python -m posttrain.scripts.grpo`: TRL's `trl/scripts/grpo.py` on posttrain. The command line is `posttrain grpo`
(the flags and YAML keys of `trl grpo`); `make_parser` and `main` drive the script from Python as in TRL."""

from posttrain.scripts import _run


class GRPOScriptArguments(_run.RewardScriptArguments):
    """ScriptArguments plus the reward model and reward functions of the GRPO script."""


def make_parser(subparsers=None, prog: str | None = None):
    return _run.make_parser("grpo", GRPOScriptArguments, subparsers, prog)


def main(script_args, training_args, model_args, dataset_args):
    _run.run("grpo", script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    raise SystemExit(_run.command_line("grpo"))
