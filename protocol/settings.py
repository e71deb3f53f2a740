"""The typed nested parts of a run record: outer rounds, per-step DP, anchor priors.

Each part's defaults are defined here once: ``node.config.NodeConfig`` takes its flat run
fields' defaults from these classes, and ``RunRecord`` holds instances. On the wire a part is
a plain map (``asdict``); ``parse_part`` checks a stranger's map key by key and raises
``RecordError`` in one line naming the field (``outer.every``), never a KeyError later.

The link codec is not a part here: its description is whatever the codec's ``describe()``
returns (keys differ per codec), checked by the codec registry when it is built.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields
from typing import Any

# DiLoCo H (bench/results/diloco_h.md, 4 replicas vs one at equal tokens): H=10 ends at held-out loss
# 1.10, close to H=50's 1.04 and far from H=1's 1.80, at 15 rounds in 150 steps. We take 10, not 50:
# a volunteer that leaves loses its un-averaged steps and a joiner adopts the outer state of the last
# round, so fewer steps between rounds lose less under churn, and a 40-step demo sees 4 rounds, not 0.
# The price is 5x H=50's outer bytes (rank-16 PowerSGD: ~9x below dense fp32 either way).
DEFAULT_OUTER_EVERY = 10


class RecordError(ValueError):
    pass


def _f(
    default: Any,
    *,
    choices: tuple = (),
    min: float | None = None,
    max: float | None = None,
    above: float | None = None,
):
    """A part field with its default and the range a record's value must lie in."""
    return field(default=default, metadata={"choices": choices, "min": min, "max": max, "above": above})


@dataclass(frozen=True)
class OuterSettings:
    """Data-parallel outer rounds among replicas of a stage (DiLoCo/GASLoC with PowerSGD, DESIGN 4.3)."""

    every: int = _f(DEFAULT_OUTER_EVERY, min=0)  # inner steps between rounds; 0 = never
    rank: int = _f(16, min=0)  # PowerSGD rank; 0 = uncompressed pseudo-gradients
    bits: int = _f(32, choices=(32, 8, 4))  # what a round's numbers travel as (compression/outer_quant.py)
    overlap: bool = _f(False)  # inner steps go on while a round averages (node/dp/diloco.py, begin/poll)
    group_size: int = _f(2, min=1)
    lr: float = _f(0.7, min=0)
    momentum: float = _f(0.9, min=0)
    mode: str = _f("diloco", choices=("diloco", "gasloc"))
    timeout: float = _f(20.0, above=0)


@dataclass(frozen=True)
class DpSettings:
    """Per-inner-step DP among a stage's replicas: "scape" syncs ``density`` of the coordinates."""

    mode: str = _f("diloco", choices=("diloco", "scape"))
    density: float = _f(0.1, above=0, max=1)
    timeout: float = _f(10.0, above=0)


@dataclass(frozen=True)
class AnchorSettings:
    """Anchor priors (DESIGN 4.2): the fast nodes' spectral filter, the anchors' pull and packet rank."""

    alpha: float = _f(0.3, min=0, max=1)
    tau: float = _f(1e-3, min=0)
    beta: float = _f(0.95, min=0, max=1)
    max_staleness: int = _f(30, min=0)
    tau_relative: bool = _f(False)
    pull_every: int = _f(20, min=0)
    rank: int = _f(16, min=0)


LORA_TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # every Llama projection


@dataclass(frozen=True)
class FinetuneSettings:
    """What a stage trains: every weight (``full``), or LoRA adapters over a frozen base (``lora``).

    With ``lora`` every replica and any stage split starts from the same adapters (their init is
    seeded from the run seed and the module's whole-model name), and only the adapters move: the
    optimizer, outer rounds, checkpoints, a joiner's weight pull and export.
    """

    mode: str = _f("full", choices=("full", "lora"))
    rank: int = _f(16, min=1, max=1024)
    alpha: float = _f(32.0, above=0)
    targets: str = _f(LORA_TARGETS)  # comma-separated module names (the last part of their path)
    dropout: float = _f(0.0, min=0, max=0.9)


# the record field name of each part
PARTS: dict[str, type] = {
    "outer": OuterSettings,
    "dp": DpSettings,
    "anchor": AnchorSettings,
    "finetune": FinetuneSettings,
}

_TYPES = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}


def part_defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in fields(cls)}


def parse_part(name: str, value: Any) -> Any:
    """The part ``name`` of a run record from its wire map; ``RecordError`` naming the field if bad."""
    cls = PARTS[name]
    if not isinstance(value, dict):
        raise RecordError(f"run record {name!r} settings are a {type(value).__name__}, not a map")
    schema = {f.name: f for f in fields(cls)}
    missing, unknown = set(schema) - set(value), set(value) - set(schema)
    if missing or unknown:
        raise RecordError(
            f"run record {name!r} settings: missing {sorted(missing)}, unknown {sorted(unknown)}; "
            "the run was started by another release: install the matching one"
        )
    hints = typing.get_type_hints(cls)
    kw = {}
    for key, f in schema.items():
        v, kind = value[key], hints[key]
        # bool is an int in Python; a flag where a number belongs is still a malformed record
        if not isinstance(v, _TYPES[kind]) or (isinstance(v, bool) and kind is not bool):
            raise RecordError(
                f"run record {name}.{key} has type {type(v).__name__}, expected {kind.__name__}"
            )
        m = f.metadata
        if (
            (m["choices"] and v not in m["choices"])
            or (m["min"] is not None and v < m["min"])
            or (m["max"] is not None and v > m["max"])
            or (m["above"] is not None and v <= m["above"])
        ):
            raise RecordError(f"run record {name}.{key} = {v!r} is out of range ({_range(m)})")
        kw[key] = float(v) if kind is float else v
    return cls(**kw)


def _range(m: dict) -> str:
    if m["choices"]:
        return "one of " + ", ".join(map(str, m["choices"]))
    lo = f"> {m['above']}" if m["above"] is not None else f">= {m['min']}" if m["min"] is not None else ""
    hi = f"<= {m['max']}" if m["max"] is not None else ""
    return " and ".join(s for s in (lo, hi) if s)
