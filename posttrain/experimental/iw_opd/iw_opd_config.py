"""TRL's `trl.experimental.iw_opd.iw_opd_config` path."""

from posttrain.experimental.iw_opd import IWOPDConfig

__all__ = ["IWOPDConfig"]
