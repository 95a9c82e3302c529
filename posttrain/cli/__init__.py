"""The `posttrain` command line and the end-of-run report.

`main` is the command's entry function, as `trl.cli.main` is TRL's: `from posttrain.cli import main; main()` runs
the command that `sys.argv` names. The module of the same name stays importable as `posttrain.cli.main`
(`importlib.import_module("posttrain.cli.main")`)."""

from posttrain.cli.main import main

__all__ = ["main"]
