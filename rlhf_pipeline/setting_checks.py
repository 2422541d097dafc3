"""The checks every settings dataclass runs on itself: each choice one its type allows, each number
finite, within 64 bits and within the bounds declared on its field.

A choice is a field typed ``Literal[...]``; a bound is a :class:`Bounds` in the field's ``Annotated``
type (``num_heads: Annotated[int, Bounds(ge=1)] = 4``). :func:`check_fields`, called by every settings
class's ``__post_init__``, refuses a value outside either, naming the setting, the value, and the
choices with the closest one in the words ``--set`` uses for the same mistake (:func:`choice_error`) or
the bound; it refuses ``nan``, ``inf`` and integers past 64 bits, which a range check lets through
(:func:`check_finite`). Rules between fields stay in the class's ``__post_init__``. Imports nothing of the package.
Design: docs/pipelines.md#settings-and-set.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal


@dataclass(frozen=True)
class Bounds:
    """The range of a number setting, declared on its field: ``Annotated[int, Bounds(ge=1)]``,
    ``Annotated[float, Bounds(ge=0, lt=1)]``. ``why`` follows the bound in the error (" (0: off)",
    ": GRPO compares completions within a group"). A field that takes none is not bounded when none."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    why: str = ""

    def allows(self, value: Any) -> bool:
        # written so that nan fails each
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))

    def __str__(self) -> str:
        """``>= 1``, ``> 0``, ``in [0, 1)``, ``<= 4``"""
        low, high = (self.ge, "[") if self.ge is not None else (self.gt, "(")
        top, close = (self.le, "]") if self.le is not None else (self.lt, ")")
        if low is not None and top is not None:
            return f"in {high}{_number(low)}, {_number(top)}{close}"
        if low is not None:
            return f"{'>=' if high == '[' else '>'} {_number(low)}"
        return f"{'<=' if close == ']' else '<'} {_number(top)}"


SEEDS = Bounds(ge=0, lt=2**32)
"""A seed's range: NumPy's, and what most trainers take. The seeds derived from it (per collector, per
sampler draw) stay within the 64 bits torch's generators take."""


def _number(bound: float) -> str:
    return str(int(bound)) if isinstance(bound, int) else f"{bound:g}"  # 4294967296, not 4.29497e+09


def bounds_error(key: str, value: Any, bounds: Bounds, *, takes_none: bool) -> str:
    """``setting 'num_heads' must be >= 1, got 0``"""
    return f"setting {key!r} must be {bounds}{' or none' if takes_none else ''}{bounds.why}, got {value!r}"


@functools.cache
def field_bounds(cls: type) -> dict[str, Bounds]:
    """The :class:`Bounds` declared on ``cls``'s fields, by field name. A field a subclass declares again
    for another default (a pipeline's ``steps: int = 500``) keeps its base class's bounds, unless it
    declares bounds of its own."""
    found: dict[str, Bounds] = {}
    for klass in reversed(cls.__mro__):
        try:
            hints = typing.get_type_hints(klass, include_extras=True)
        except (NameError, TypeError):
            continue
        for name, hint in hints.items():
            # Annotated[int | None, Bounds(...)], or Annotated[int, Bounds(...)] | None
            for part in (hint, *typing.get_args(hint)):
                if typing.get_origin(part) is Annotated:
                    found.update({name: extra for extra in part.__metadata__ if isinstance(extra, Bounds)})
    return found


def choice_error(key: str, value: Any, choices: Sequence[Any]) -> str:
    """``setting 'learner.sampler' must be one of ['window', 'exact'], got 'exakt'; did you mean 'exact'?``"""
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"setting {key!r} must be one of {list(choices)}, got {value!r}{hint}"


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values a ``Literal[...]`` (or ``Literal[...] | None``) annotation allows; None for another type."""
    if typing.get_origin(annotation) is Literal:
        return typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        literals = [a for a in typing.get_args(annotation) if typing.get_origin(a) is Literal]
        if literals and all(a is type(None) or typing.get_origin(a) is Literal for a in typing.get_args(annotation)):
            return tuple(c for a in literals for c in typing.get_args(a))
    return None


def check_fields(settings: Any, prefix: str = "") -> None:
    """Raises ValueError naming the first field of ``settings`` (one dataclass; its nested settings check
    themselves) whose value is outside its ``Literal`` choices, a float that is not finite, or a number
    outside its field's :class:`Bounds`.

    Every settings class calls it in its ``__post_init__``, so a value is refused where it is declared,
    whoever builds the settings (``--set``, a pipeline file, a test): a dataclass built in Python is not
    held to its type, and a range check such as ``lr > 0`` lets ``inf`` through (``nan`` fails every
    comparison, so ``not x > 0`` catches it but ``x <= 0`` does not). No setting means anything by
    infinity: "for ever" and "no limit" are ``none`` where a setting offers them."""
    hints = _hints(type(settings))
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        choices = literal_choices(hints.get(field.name))
        if choices is not None and value not in choices and not (value is None and _takes_none(hints, field.name)):
            raise ValueError(choice_error(prefix + field.name, value, choices))
        length = fixed_length(hints.get(field.name))
        if length is not None and (not isinstance(value, (tuple, list)) or len(value) != length):
            raise ValueError(f"setting {prefix + field.name!r} takes {length} values, got {value!r}")
    check_finite(settings, prefix, nested=False)
    for name, bounds in field_bounds(type(settings)).items():
        value = getattr(settings, name)
        # the bounds of a tuple setting (adam_betas) hold for each of its values
        items = value if isinstance(value, (tuple, list)) else (value,)
        if value is not None and not all(bounds.allows(item) for item in items):
            raise ValueError(bounds_error(prefix + name, value, bounds, takes_none=_takes_none(hints, name)))


def check_applies(settings: Any, prefix: str, rules: dict[str, tuple[str, tuple[Any, ...]]]) -> None:
    """Raises ValueError naming the first field of ``settings`` set to other than its default while the
    field it is for has none of the values it means something with: ``rules`` maps a field's name to
    ``(the field it depends on, the values it is for)``, as ``{"priority_alpha": ("sampler",
    ("prioritized",))}``. A value that nothing reads is a mistake the user would not otherwise see."""
    fields = {field.name: field for field in dataclasses.fields(settings)}
    for name, (depends_on, values) in rules.items():
        field = fields[name]
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
        current = getattr(settings, depends_on)
        if getattr(settings, name) != default and current not in values:
            wanted = " or ".join(f"{prefix}{depends_on}={_as_set(v)}" for v in values)
            raise ValueError(f"setting '{prefix}{name}' is for {wanted}; this run's {prefix}{depends_on} is "
                             f"{_as_set(current)}: drop it, or set {wanted}")


def _as_set(value: Any) -> str:
    """A value as ``--set`` spells it."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def fixed_length(annotation: Any) -> int | None:
    """How many values a ``tuple[float, float]`` annotation takes; None for any other type
    (``tuple[str, ...]`` takes any number)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is tuple and args and Ellipsis not in args:
        return len(args)
    return None


def check_finite(settings: Any, prefix: str = "", *, nested: bool = True) -> Any:
    """Returns ``settings`` (a dataclass; with ``nested``, its nested dataclasses too, keys prefixed with
    ``prefix``) when every float setting in it is finite and every integer one fits in 64 bits (a count
    past them passed every ``>= 1`` and failed later, in the child process that handed it to torch),
    else raises ValueError naming the first that is not and offering the field's declared default."""
    hints = _hints(type(settings))
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        key = prefix + field.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            if nested:
                check_finite(value, key + ".")
            continue
        default = field.default if field.default is not dataclasses.MISSING else None
        if not_finite(value):
            raise ValueError(finite_error(key, value, default, takes_none=_takes_none(hints, field.name)))
        if past_64_bits(value):
            offer = f", e.g. its default {default!r}" if default is not None else ""
            raise ValueError(f"setting {key!r} must fit in 64 bits (from -2**63 to 2**63 - 1), got {value!r}: "
                             f"give a number within them{offer}")
    return settings


def not_finite(value: Any) -> bool:
    """A float (or a float in a tuple or list) that is nan or infinite."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(item, float) and not math.isfinite(item) for item in values)


def past_64_bits(value: Any) -> bool:
    """An int (or an int in a tuple or list) that a signed 64-bit integer cannot hold."""
    values = value if isinstance(value, (tuple, list)) else (value,)
    return any(isinstance(item, int) and not -2**63 <= item < 2**63 for item in values)


def finite_error(key: str, value: Any, default: Any, *, takes_none: bool) -> str:
    offer = f", e.g. its default {default!r}" if default is not None else ""
    return (f"setting {key!r} must be a finite number{' or none' if takes_none else ''}, got {value!r}: "
            f"give one{offer}")


@functools.cache  # settings are checked as they are built, the loss's once a learner step: resolve once
def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation that does not resolve: no choices, no "or none"
        return {}


def _takes_none(hints: dict[str, Any], name: str) -> bool:
    return type(None) in typing.get_args(hints.get(name))
