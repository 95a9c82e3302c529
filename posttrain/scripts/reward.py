"""`python -m posttrain.scripts.reward`: TRL's `trl/scripts/reward.py` on posttrain. The command line is
`posttrain reward` (the flags and YAML keys of `trl reward`); `make_parser` and `main` drive the script from
Python as in TRL."""

from posttrain.cli.data import ScriptArguments
from posttrain.cli.trl_scripts import command_line, script_entry_points

make_parser, main = script_entry_points("reward", ScriptArguments)

if __name__ == "__main__":
    raise SystemExit(command_line("reward"))
