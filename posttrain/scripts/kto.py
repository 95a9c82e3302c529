"""`python -m posttrain.scripts.kto`: TRL's `trl/scripts/kto.py` on posttrain. The command line is `posttrain kto`
(the flags and YAML keys of `trl kto`); `make_parser` and `main` drive the script from Python as in TRL."""

from posttrain.cli.data import ScriptArguments
from posttrain.cli.trl_scripts import command_line, script_entry_points

make_parser, main = script_entry_points("kto", ScriptArguments)

if __name__ == "__main__":
    raise SystemExit(command_line("kto"))
