"""Input checks shared by vagen.core: errors that name what was received and what is valid."""

import math

import torch


def check_same_shape(fn: str, ndim: int | None = None, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor has the same shape (and `ndim` dims, when given)."""
    names = list(tensors)
    first = tensors[names[0]]
    for name in names:
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if ndim is not None and t.dim() != ndim:
            raise ValueError(
                f"{fn}: {name} must have {ndim} dims, got shape {tuple(t.shape)}; expected "
                f"{'[B]' if ndim == 1 else '[B, L]'} for all of {', '.join(names)}"
            )
        if t.shape != first.shape:
            raise ValueError(
                f"{fn}: {name} has shape {tuple(t.shape)} but {names[0]} has shape "
                f"{tuple(first.shape)}; {', '.join(names)} must all have the same shape"
            )


def unknown_choice(fn: str, arg: str, value: object, choices: tuple[str, ...]) -> ValueError:
    """The error raised by the `else` branch of an if/elif on a string argument."""
    return ValueError(f"{fn}: unknown {arg} {value!r}; choices: {', '.join(repr(c) for c in choices)}")


def check_unit_interval(fn: str, **values: float) -> None:
    """Raise ValueError unless every value is a float in [0, 1]."""
    for name, v in values.items():
        if not (isinstance(v, int | float) and 0.0 <= v <= 1.0):
            raise ValueError(f"{fn}: {name} must be a float in [0, 1], got {v!r}")


def ceil_count(ratio: float, n: int) -> int:
    """ceil(ratio * n), tolerant to float round-off (0.1 * 30 -> 3, not 4)."""
    return math.ceil(ratio * n - 1e-9)
