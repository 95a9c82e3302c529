"""TRL's `trl.trainer` import path: `from posttrain.trainer import SFTTrainer` works as `from trl.trainer import
SFTTrainer`. The trainers live in `posttrain.trainers` (one module per method); this module only forwards names."""


def __getattr__(name):
    import posttrain

    if name in posttrain.__all__ and name != "__version__":  # the public names, not the version
        return getattr(posttrain, name)
    raise AttributeError(
        f"module 'posttrain.trainer' has no attribute {name!r}; posttrain's trainers are in posttrain.trainers"
    )
