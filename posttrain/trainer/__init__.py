"""TRL's `trl.trainer` import path: `from posttrain.trainer import SFTTrainer` works as `from trl.trainer import
SFTTrainer`. The trainers live in `posttrain.trainers` (one module per method); this module only forwards names."""

# TRL's helpers that `trl.trainer` names besides the trainers (they live in posttrain.trainer.utils' sources)
_HELPERS = ("add_fused_lm_head", "disable_dropout_in_model", "ensure_master_addr_port")


def __getattr__(name):
    import posttrain

    if name in posttrain.__all__ and name != "__version__":  # the public names, not the version
        return getattr(posttrain, name)
    if name in _HELPERS:
        from posttrain.trainer import utils

        return getattr(utils, name)
    raise AttributeError(
        f"module 'posttrain.trainer' has no attribute {name!r}; posttrain's trainers are in posttrain.trainers"
    )
