"""`python -m posttrain ...` runs the `posttrain` command (useful where the console script is not on PATH)."""

from posttrain.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
