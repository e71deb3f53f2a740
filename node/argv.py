"""NodeConfig <-> command line, both ways from the fields' metadata (node/config.py).

``add_config_args`` builds the ``join`` flags (help, choices, defaults, ranges) from the fields,
so a field cannot lack its flag or disagree with it; ``config_to_argv`` writes a config back as
those flags (``swarm``, bench/network/harness.py and bench/reliability/chaos.py start nodes with it).

Every flag's value is checked as it is parsed, in one place: ``field_type`` turns a field's
metadata (``node.config.opt``: min/max/above/below, parse) into argparse's ``type``, and
``bounded`` is the same check for a subcommand's own flags (node/cli.py); ``OneLineParser``
reports a refused flag in one line (``FlagError``: ``error: --heartbeat must be >= 0.1, got 0``,
exit code 2) instead of argparse's usage block, before anything is started.
"""

from __future__ import annotations

import argparse
import math
import re
import typing
from collections.abc import Callable, Iterable
from dataclasses import MISSING, Field, fields

from node.config import NET, NODE, RUN, NodeConfig

GROUP_TITLES = {
    NET: "network",
    RUN: "run settings (first node only; joiners take them from the swarm, except --model)",
    NODE: "this node",
}
_HINTS = typing.get_type_hints(NodeConfig)


class FlagError(ValueError):
    """A flag, or a combination of run flags, that cannot work; the message is one line saying why."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a refused command line raised as one-line ``FlagError`` (node.cli.main prints
    it and exits 2) instead of a usage block on stderr and ``SystemExit``."""

    def error(self, message: str):
        # argparse says "argument --x/-y: reason"; ours is "--x reason" (our reasons start with "must")
        m = re.match(r"argument ([^:/ ]+)(?:/\S+)?: (.*)", message)
        if m:
            flag, why = m.groups()
            message = f"{flag} {why}" if why.startswith("must") else f"{flag}: {why}"
        raise FlagError(f"{message} (see {self.prog} --help)")


GIVEN = "_given"  # the namespace attribute holding the fields whose flag was on the command line


class _Given(argparse.Action):
    """argparse's store, noting the flag as given (``given``): a flag given at its default value
    must still win over a layout resolved from other flags, and a flag that a setting ignores
    must be refused only when the user asked for it."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, GIVEN, getattr(namespace, GIVEN, frozenset()) | {self.dest})


def given(a: argparse.Namespace) -> frozenset[str]:
    """The NodeConfig fields whose (valued) flag the command line gave."""
    return getattr(a, GIVEN, frozenset())


def range_text(lo=None, hi=None, above=None, below=None) -> str:
    """``>= 0``, ``> 0``, ``in (0, 1]``: a range as a refusal names it."""
    g = "{:g}".format
    left = f"[{g(lo)}" if lo is not None else f"({g(above)}" if above is not None else None
    right = f"{g(hi)}]" if hi is not None else f"{g(below)})" if below is not None else None
    if left and right:
        return f"lie in {left}, {right}"
    if left:
        return f"be {'>=' if lo is not None else '>'} {left[1:]}"
    if right:
        return f"be {'<=' if hi is not None else '<'} {right[:-1]}"
    return ""


def bounded(
    kind: type = int,
    *,
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
    below: float | None = None,
) -> Callable[[str], int | float]:
    """argparse ``type``: a number of ``kind`` within the range, else a reason naming the range."""
    rng = range_text(min, max, above, below)

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be {'a whole number' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if isinstance(v, float) and not math.isfinite(v):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        if (
            (min is not None and v < min)
            or (max is not None and v > max)
            or (above is not None and v <= above)
            or (below is not None and v >= below)
        ):
            raise argparse.ArgumentTypeError(f"must {rng}, got {text}")
        return v

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


def _checked(fn: Callable[[str], typing.Any]) -> Callable[[str], typing.Any]:
    """A field's ``parse`` function as argparse's ``type``: its ValueError becomes the reason."""

    def parse(text: str):
        try:
            return fn(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def field_type(f: Field):
    """What argparse converts and checks one field's flag with (lists and bools: their items, none)."""
    m, kind = f.metadata, _HINTS[f.name]
    if m["parse"] is not None:
        return _checked(m["parse"])
    if kind in (int, float):
        limits = {k: m[k] for k in ("min", "max", "above", "below")}
        return bounded(kind, **limits) if any(v is not None for v in limits.values()) else kind
    return str


def flag_type(name: str):
    """``field_type`` of the NodeConfig field ``name``: a subcommand's copy of a join flag (``swarm
    --max-inflight``) accepts what join accepts."""
    return field_type({f.name: f for f in fields(NodeConfig)}[name])


def flag_of(f: Field) -> str:
    return f.metadata["flag"] or "--" + f.name.replace("_", "-")


def _default(f: Field):
    return f.default_factory() if f.default is MISSING else f.default


def add_config_args(p: argparse.ArgumentParser, group: str) -> None:
    """The flags of one group of NodeConfig fields."""
    g = p.add_argument_group(GROUP_TITLES[group])
    for f in fields(NodeConfig):
        m = f.metadata
        if m["group"] != group:
            continue
        kind, default = _HINTS[f.name], _default(f)
        kw: dict = {"dest": f.name, "help": m["help"]}
        if kind is bool:
            kw["action"] = "store_false" if default else "store_true"
        elif typing.get_origin(kind) is list:
            if m["append"]:
                kw["action"] = "append"
            else:
                kw["nargs"] = "*"
        else:
            # a factory's default (state dir) or a resolved field stays None: the config fills it in
            unset = f.default is MISSING or m["resolved"]
            kw.update(type=field_type(f), default=None if unset else default, action=_Given)
            if m["choices"]:
                kw["choices"] = list(m["choices"])
        g.add_argument(flag_of(f), **kw)


def config_from_args(a: argparse.Namespace) -> NodeConfig:
    """The config of parsed flags; a flag left None (not given, resolved later) keeps the default."""
    kw = {f.name: getattr(a, f.name) for f in fields(NodeConfig) if getattr(a, f.name, None) is not None}
    return NodeConfig(**kw)


def config_to_argv(
    cfg: NodeConfig, names: Iterable[str] | None = None, always: Iterable[str] = ()
) -> list[str]:
    """``join`` flags that give a node ``cfg`` (only those of ``names``, all by default).

    Settings at their default are left out, so a node reads them from its own release (a
    resolved one too: ``--outer-every`` left out is 10, or 0 with ``--dp scape``); those in
    ``always`` are written anyway (a benchmark's command line pins them against a moving default).
    """
    wanted, pinned = None if names is None else set(names), set(always)
    out: list[str] = []
    for f in fields(NodeConfig):
        if wanted is not None and f.name not in wanted:
            continue
        value, flag = getattr(cfg, f.name), flag_of(f)
        if value == _default(f) and f.name not in pinned:
            continue
        if isinstance(value, bool):
            # store_true, or store_false (--no-relay) when the default is on; a pinned default: nothing
            out += [flag] if value != _default(f) else []
        elif isinstance(value, list):
            out += [x for v in value for x in (flag, v)] if f.metadata["append"] else [flag, *value]
        elif value is not None:
            out += [flag, str(value)]
    unknown = ((wanted or set()) | pinned) - {f.name for f in fields(NodeConfig)}
    if unknown:
        raise ValueError(f"no NodeConfig fields {sorted(unknown)}")
    return out
