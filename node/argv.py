"""NodeConfig <-> command line, both ways from the fields' metadata (node/config.py).

``add_config_args`` builds the ``join`` flags (help, choices, defaults) from the fields, so a
field cannot lack its flag or disagree with it; ``config_to_argv`` writes a config back as those
flags (``swarm``, bench/harness.py and bench/chaos.py start nodes with it).
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable
from dataclasses import MISSING, Field, fields

from node.config import NET, NODE, RUN, NodeConfig

GROUP_TITLES = {
    NET: "network",
    RUN: "run settings (first node only; joiners take them from the swarm, except --model)",
    NODE: "this node",
}
_HINTS = typing.get_type_hints(NodeConfig)


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
            kw.update(type=kind if kind in (int, float) else str, default=None if unset else default)
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
