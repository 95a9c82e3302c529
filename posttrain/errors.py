"""Errors raised before training starts. Each message names what is wrong and how to fix it."""


class PosttrainError(ValueError):
    """Base class: bad input or settings detected by posttrain."""


class DataError(PosttrainError):
    """The dataset does not have the shape the trainer needs (columns, types, lengths)."""


class ConfigError(PosttrainError):
    """Settings that cannot work together (batch arithmetic, incompatible options)."""


class NonFiniteError(RuntimeError):
    """Training produced a NaN or infinite loss or gradient; the update was not applied."""
