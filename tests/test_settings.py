"""The run record's typed parts: one default each, plain maps on the wire, one-line errors naming fields."""

import msgpack
import pytest

from node.config import NodeConfig, run_parts
from protocol.records import RecordError, RunRecord
from protocol.settings import AnchorSettings, DpSettings, OuterSettings


def _record(**kw) -> RunRecord:
    return RunRecord(
        run_id="r", model_name="m", model_hash="h", num_layers=4, hidden=64, stages=[[0, 2], [2, 4]], **kw
    )


def test_record_is_a_plain_msgpack_map_and_round_trips():
    rec = _record(
        outer=OuterSettings(every=3, mode="gasloc", lr=0.5, bits=8, overlap=True),
        dp=DpSettings(mode="scape", density=0.25),
        anchor=AnchorSettings(tau_relative=True, rank=4),
    )
    wire = msgpack.unpackb(msgpack.packb(rec.to_dict()))  # what a joiner reads from the DHT
    assert wire["outer"] == {
        "every": 3,
        "rank": 16,
        "group_size": 2,
        "lr": 0.5,
        "momentum": 0.9,
        "mode": "gasloc",
        "timeout": 20.0,
        "bits": 8,
        "overlap": True,
    }
    assert wire["dp"] == {"mode": "scape", "density": 0.25, "timeout": 10.0}
    back = RunRecord.from_dict(wire)
    assert back == rec and isinstance(back.outer, OuterSettings) and back.anchor.rank == 4


# (part, key, bad value, words the one error line must hold)
BAD = [
    ("outer", "every", "10", "outer.every has type str"),
    ("outer", "every", -1, "outer.every = -1 is out of range"),
    ("outer", "lr", True, "outer.lr has type bool"),
    ("outer", "mode", "adam", "outer.mode = 'adam' is out of range (one of diloco, gasloc)"),
    ("outer", "timeout", 0, "outer.timeout = 0 is out of range (> 0)"),
    ("outer", "bits", 6, "outer.bits = 6 is out of range (one of 32, 8, 4)"),
    ("outer", "overlap", 1, "outer.overlap has type int"),
    ("dp", "mode", "allreduce", "dp.mode = 'allreduce'"),
    ("dp", "density", 1.5, "dp.density = 1.5 is out of range (> 0 and <= 1)"),
    ("dp", "timeout", [1], "dp.timeout has type list"),
    ("anchor", "alpha", "0.3", "anchor.alpha has type str"),
    ("anchor", "tau_relative", 1, "anchor.tau_relative has type int"),
    ("anchor", "max_staleness", 2.5, "anchor.max_staleness has type float"),
    ("anchor", "beta", 2.0, "anchor.beta = 2.0 is out of range"),
]


@pytest.mark.parametrize("part,key,value,words", BAD)
def test_a_bad_part_value_is_one_line_naming_the_field(part, key, value, words):
    d = _record().to_dict()
    d[part] = {**d[part], key: value}
    with pytest.raises(RecordError) as e:
        RunRecord.from_dict(d)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("part", ["outer", "dp", "anchor"])
def test_a_part_missing_a_key_with_an_extra_one_or_not_a_map_is_refused(part):
    d = _record().to_dict()
    first = next(iter(d[part]))
    for bad, words in (
        ({k: v for k, v in d[part].items() if k != first}, f"missing ['{first}']"),
        ({**d[part], "later": 1}, "unknown ['later']"),
        ([1, 2], f"'{part}' settings are a list, not a map"),
    ):
        with pytest.raises(RecordError) as e:
            RunRecord.from_dict({**d, part: bad})
        assert words in str(e.value) and "\n" not in str(e.value)


def test_config_defaults_are_the_records():
    """A run started with no flags publishes the record's own defaults (once 4 vs 8, 1024 vs 192)."""
    assert run_parts(NodeConfig()) == {k: getattr(_record(), k) for k in run_parts(NodeConfig())}
    cfg = NodeConfig()
    assert (cfg.microbatch, cfg.batch_tokens, cfg.outer_every) == (8, 192, 10)
    assert (cfg.ap_alpha, cfg.dp_timeout, cfg.outer_timeout) == (0.3, 10.0, 20.0)


def test_config_to_record_and_back_keeps_every_run_field():
    cfg = NodeConfig(
        outer_every=7,
        powersgd_rank=0,
        outer_mode="gasloc",
        dp="scape",
        density=0.5,
        dp_timeout=3.0,
        ap_alpha=1.0,
        ap_tau_relative=True,
        anchor_pull_every=5,
        seed=9,
        lr=0.01,
        microbatch=2,
        batch_tokens=64,
        mode="pretrain",
        dense_every=4,
    )
    rec = _record(**run_parts(cfg))
    assert (rec.outer.every, rec.outer.rank, rec.outer.mode) == (7, 0, "gasloc")
    assert (rec.dp.mode, rec.dp.density, rec.dp.timeout) == ("scape", 0.5, 3.0)
    assert (rec.anchor.alpha, rec.anchor.tau_relative, rec.anchor.pull_every) == (1.0, True, 5)
    assert (rec.seed, rec.lr, rec.microbatch, rec.batch_tokens, rec.mode, rec.dense_every) == (
        9,
        0.01,
        2,
        64,
        "pretrain",
        4,
    )
    back = RunRecord.from_dict(rec.to_dict())
    assert {k: getattr(back, k) for k in run_parts(cfg)} == run_parts(cfg)
