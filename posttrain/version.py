"""The version of posttrain, at the bottom of the import graph so that any layer may report it."""

__version__ = "0.1.0"
