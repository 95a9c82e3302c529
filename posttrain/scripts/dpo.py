"""`python -m posttrain.scripts.dpo`: TRL's `trl/scripts/dpo.py` on posttrain. The command line is `posttrain dpo`
(the flags and YAML keys of `trl dpo`); `make_parser` and `main` drive the script from Python as in TRL."""

from posttrain.cli.data import ScriptArguments
from posttrain.scripts import _run


def make_parser(subparsers=None, prog: str | None = None):
    return _run.make_parser("dpo", ScriptArguments, subparsers, prog)


def main(script_args, training_args, model_args, dataset_args):
    _run.run("dpo", script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    raise SystemExit(_run.command_line("dpo"))
