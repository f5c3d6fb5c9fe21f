"""Option types and helpers shared by the ``memwal`` commands: durations, and the
deprecated spellings of renamed options (kept one release, each use warns on stderr)."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from typing import Any

import click

_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)([smhd])")


def parse_duration(text: str) -> dt.timedelta:
    """A duration written as ``90s``, ``30m``, ``24h``, ``7d`` or ``1h30m``.

    Raises
    ------
    ValueError
        ``text`` is not such a duration.
    """
    s = text.strip().lower()
    parts = _PART.findall(s)
    if not s or "".join(n + u for n, u in parts) != s:
        raise ValueError(f"{text!r} is not a duration (e.g. 90s, 30m, 24h, 7d, 1h30m)")
    return dt.timedelta(seconds=sum(float(n) * _UNITS[u] for n, u in parts))


def format_duration(value: dt.timedelta) -> str:
    """``value`` in the notation of :func:`parse_duration` (``1h``, ``90s``, ``1h30m``)."""
    seconds = value.total_seconds()
    out = ""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        n, seconds = divmod(seconds, size)
        if n:
            out += f"{int(n)}{unit}"
    if seconds or not out:
        out += f"{seconds:g}s"
    return out


class Duration(click.ParamType):
    """A click option type for :func:`parse_duration`. ``bare_unit`` (``"h"``, ``"s"``):
    a bare number is read in that unit, with a deprecation warning (the option's older
    spelling); without it a bare number is refused."""

    name = "duration"

    def __init__(self, bare_unit: str | None = None) -> None:
        self.bare_unit = bare_unit

    def convert(self, value: Any, param: Any, ctx: Any) -> dt.timedelta:
        if isinstance(value, dt.timedelta):
            return value
        text = str(value)
        if self.bare_unit is not None:
            try:
                number = float(text)
            except ValueError:
                pass
            else:
                name = param.opts[0] if param is not None else "the option"
                unit = {"h": "hours", "s": "seconds"}[self.bare_unit]
                spelled = f"{text}{self.bare_unit}"
                warn(f"a bare number of {unit} for {name} is deprecated; write {spelled}")
                return dt.timedelta(seconds=number * _UNITS[self.bare_unit])
        try:
            return parse_duration(text)
        except ValueError as e:
            self.fail(str(e), param, ctx)


def warn(message: str) -> None:
    """Print a deprecation warning for the command line user."""
    click.echo(f"warning: {message}", err=True)


def deprecated_option(old: str, new: str, **kw: Any) -> Callable[[Any], Any]:
    """A hidden option ``old`` (the older spelling of ``new``): accepted for one release,
    with a warning on stderr when used; the command merges its value into ``new``'s."""

    def callback(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None and value is not False and value != ():
            warn(f"{old} is deprecated and will be removed in the next release; use {new}")
        return value

    return click.option(old, hidden=True, callback=callback, help=f"Deprecated: {new}.", **kw)
