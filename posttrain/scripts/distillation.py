"""`python -m posttrain.scripts.distillation`: TRL's `trl/scripts/distillation.py` on posttrain. The command line is
`posttrain distillation` (also `posttrain distill`); `make_parser` and `main` drive the script from Python as in TRL."""

from posttrain.cli.data import ScriptArguments
from posttrain.scripts import _run


def make_parser(subparsers=None, prog: str | None = None):
    return _run.make_parser("distillation", ScriptArguments, subparsers, prog)


def main(script_args, training_args, model_args, dataset_args):
    _run.run("distillation", script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    raise SystemExit(_run.command_line("distillation"))
