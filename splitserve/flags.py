"""Command-line flags made from the config dataclasses (vLLM's EngineArgs idea).

A config field declared with `flag(...)` metadata is a flag whose default and choices are the
field's own: a command cannot offer another default or another list than the config takes,
nor differ from another command taking the same flag. A nested config declared with
`flags_within()` contributes its fields' flags to its parent's. Commands pick the flags they
take by name (add_flags); from_flags builds the config back from what was parsed.
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import Field, dataclass, fields
from types import NoneType, UnionType


@dataclass(frozen=True)
class Flag:
    name: str                            # "--kv-cache-gib"; "--no-X" turns off a True field
    # What the flag sets; a None default's meaning too. A value default is appended.
    help: str
    choices: tuple | None = None         # the values the field's validation accepts
    type: typing.Callable | None = None  # argparse type; None: the field's annotated type
    unit: int = 1                        # field value = flag value * unit
    aliases: tuple[str, ...] = ()
    metavar: str | None = None

    @property
    def dest(self) -> str:
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def negated(self) -> bool:
        return self.name.startswith("--no-")

    def to_field(self, value):
        """The field's value for a parsed flag value."""
        if self.negated:
            return not value
        return value if self.unit == 1 or value is None else int(value * self.unit)


def flag(name: str, help: str, **options) -> dict:
    """A field's metadata that makes it a flag (see Flag)."""
    return {"flag": Flag(name, help, **options)}


def flags_within() -> dict:
    """A nested config field's metadata: its flags are its parent's."""
    return {"flags_within": True}


def config_flags(cls) -> dict[str, tuple[type, Field, Flag]]:
    """Flag name -> (the config class holding the field, the field, its Flag), in field order."""
    out = {}
    for f in fields(cls):
        if f.metadata.get("flags_within"):
            out.update(config_flags(f.default_factory))
        elif "flag" in f.metadata:
            out[f.metadata["flag"].name] = (cls, f, f.metadata["flag"])
    return out


def add_flags(parser: argparse.ArgumentParser, cls, *names: str,
              help: dict[str, str] | None = None,
              choices: dict[str, tuple] | None = None) -> None:
    """cls's flags on parser: those named, in that order, or all in field order. help and
    choices replace a flag's text or narrow its list for this command, by flag name."""
    known = config_flags(cls)
    for name in names or known:
        owner, f, fl = known[name]
        _add(parser, owner, f, fl, (help or {}).get(name, fl.help),
             (choices or {}).get(name, fl.choices))


def _add(parser, owner: type, f: Field, fl: Flag, text: str, choices: tuple | None) -> None:
    if fl.negated:
        if f.default is not True:
            raise TypeError(f"{fl.name}: a --no- flag turns off a field that defaults to True")
        parser.add_argument(fl.name, *fl.aliases, action="store_true", help=text)
        return
    if f.default is False:     # a switch that turns on a field that defaults to False
        parser.add_argument(fl.name, *fl.aliases, action="store_true", help=text)
        return
    default = f.default if fl.unit == 1 or f.default is None else f.default / fl.unit
    shown = "" if default is None or default == () else " (default: %(default)s)"
    parser.add_argument(fl.name, *fl.aliases, type=fl.type or _scalar_type(owner, f.name),
                        default=default, choices=choices, metavar=fl.metavar,
                        help=text + shown)


def _scalar_type(owner: type, name: str) -> type:
    """int for `int | None`, str for `str`: what argparse turns the text into."""
    hint = typing.get_type_hints(owner)[name]
    if isinstance(hint, UnionType):
        return next(t for t in typing.get_args(hint) if t is not NoneType)
    return hint


def from_flags(cls, args: argparse.Namespace, **given):
    """cls from the flags parsed into args, its flags_within() configs built the same way;
    `given` fields win. A field whose flag the command does not take keeps its default."""
    values = {}
    for f in fields(cls):
        fl = f.metadata.get("flag")
        if f.name in given:
            continue
        if f.metadata.get("flags_within"):
            values[f.name] = from_flags(f.default_factory, args)
        elif fl is not None and hasattr(args, fl.dest):
            values[f.name] = fl.to_field(getattr(args, fl.dest))
    return cls(**values, **given)
