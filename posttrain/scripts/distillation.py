"""`python -m posttrain.scripts.distillation`: TRL's `trl/scripts/distillation.py` on posttrain. The command line is
`posttrain distillation` (also `posttrain distill`); `make_parser` and `main` drive the script from Python as in TRL."""

from posttrain.cli.data import ScriptArguments
from posttrain.cli.trl_scripts import command_line, script_entry_points

make_parser, main = script_entry_points("distillation", ScriptArguments)

if __name__ == "__main__":
    raise SystemExit(command_line("distillation"))
