"""TRL's `trl.extras` import path."""
