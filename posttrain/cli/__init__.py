"""The `posttrain` command line and the end-of-run report."""
