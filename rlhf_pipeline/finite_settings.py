"""Every number a run is set with is finite: one check for every settings dataclass, no torch.

``--set learner.lr=inf`` parses as a float, and a range check such as ``lr > 0`` lets it through
(``nan`` fails every comparison, so ``not x > 0`` catches it, but ``x <= 0`` does not): such a value
used to reach the learner or the collector and break there. :func:`check_finite` walks a settings
dataclass, nested settings included, and refuses the first float (or float in a tuple) that is
``nan`` or infinite, naming the setting by its dotted key. No setting means anything by infinity:
"for ever" and "no limit" are ``none`` where a setting offers them.

It runs where settings are made (``pipeline.make_settings``: every ``--set`` of every pipeline, before
any process starts) and in the settings classes' own checks (``LearnerSettings.check``,
``generation.settings.check_generation``) for settings built in Python.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any


def check_finite(settings: Any, prefix: str = "", *, defaults: Any = None,
                 error: type[ValueError] = ValueError) -> Any:
    """Returns ``settings`` (a dataclass; its nested dataclasses too, keys prefixed with ``prefix``)
    when every float setting in it is finite, else raises ``error`` naming the first that is not.
    ``defaults``: the same settings at their defaults (default: ``type(settings)()``), whose value
    the message offers."""
    if defaults is None:
        try:
            defaults = type(settings)()
        except (TypeError, ValueError):  # a field without a default: the message offers none
            defaults = None
    try:
        hints = typing.get_type_hints(type(settings))
    except (NameError, TypeError):  # an annotation that does not resolve: the message leaves out "or none"
        hints = {}
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        default = getattr(defaults, field.name, None)
        key = prefix + field.name
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_finite(value, key + ".", defaults=default if type(default) is type(value) else None, error=error)
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        for item in values:
            if not isinstance(item, float) or math.isfinite(item):
                continue
            takes_none = type(None) in typing.get_args(hints.get(field.name))
            offer = f", e.g. its default {default!r}" if default is not None else ""
            raise error(f"setting {key!r} must be a finite number{' or none' if takes_none else ''}, got "
                        f"{value!r}: give one{offer}")
    return settings
