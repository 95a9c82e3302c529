"""`python -m posttrain.scripts.sft`: TRL's `trl/scripts/sft.py` on posttrain. The command line is `posttrain sft`
(the flags and YAML keys of `trl sft`); `make_parser` and `main` drive the script from Python as in TRL."""

from posttrain.cli.data import ScriptArguments
from posttrain.scripts import _run


def make_parser(subparsers=None, prog: str | None = None):
    return _run.make_parser("sft", ScriptArguments, subparsers, prog)


def main(script_args, training_args, model_args, dataset_args):
    _run.run("sft", script_args, training_args, model_args, dataset_args)


if __name__ == "__main__":
    raise SystemExit(_run.command_line("sft"))
