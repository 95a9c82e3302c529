"""`python -m posttrain.scripts.grpo`: TRL's `trl/scripts/grpo.py` on posttrain. The command line is `posttrain grpo`
(the flags and YAML keys of `trl grpo`); `make_parser` and `main` drive the script from Python as in TRL."""

from posttrain.cli.trl_scripts import GRPOScriptArguments, command_line, script_entry_points

make_parser, main = script_entry_points("grpo", GRPOScriptArguments)

__all__ = ["GRPOScriptArguments", "main", "make_parser"]

if __name__ == "__main__":
    raise SystemExit(command_line("grpo"))
