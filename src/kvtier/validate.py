"""One validation helper for config and request fields.

Each check raises ``error(field, message)`` (``ValueError("field: message")`` by default;
``kvtier.engine.ParamError`` for request fields) naming the field and the accepted range,
so a bad flag, config or request reads as one actionable line. Pure functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def _value_error(name: str, message: str) -> Exception:
    return ValueError(f"{name}: {message}")


ErrorFactory = Callable[[str, str], Exception]


def is_int(value: object) -> bool:
    """An integer that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """A real, finite number (not a bool, not NaN or infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def check_int(
    name: str,
    value: object,
    minimum: int = 0,
    *,
    none: str | None = None,
    error: ErrorFactory = _value_error,
) -> None:
    """``value`` is an integer ``>= minimum`` (or None, when ``none`` says what None means)."""
    if value is None and none is not None:
        return
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        also = f" or None ({none})" if none is not None else ""
        raise error(name, f"must be an integer >= {minimum}{also}, got {value!r}")


def check_number(
    name: str,
    value: object,
    minimum: float = 0.0,
    *,
    none: str | None = None,
    error: ErrorFactory = _value_error,
) -> None:
    """``value`` is a finite number ``>= minimum`` (or None, when ``none`` says what None
    means)."""
    if value is None and none is not None:
        return
    if not is_number(value) or value < minimum:  # type: ignore[operator]
        also = f" or None ({none})" if none is not None else ""
        raise error(name, f"must be a number >= {minimum:g}{also}, got {value!r}")
