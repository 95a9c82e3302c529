"""`python -m posttrain.scripts.rloo`: TRL's `trl/scripts/rloo.py` on posttrain. The command line is `posttrain rloo`
(the flags and YAML keys of `trl rloo`); `make_parser` and `main` drive the script from Python as in TRL."""

from posttrain.cli.trl_scripts import RLOOScriptArguments, command_line, script_entry_points

make_parser, main = script_entry_points("rloo", RLOOScriptArguments)

__all__ = ["RLOOScriptArguments", "main", "make_parser"]

if __name__ == "__main__":
    raise SystemExit(command_line("rloo"))
