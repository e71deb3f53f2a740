import pytest

from protocol.records import RecordError, RunRecord, StageRecord


def _run(**kw) -> dict:
    d = RunRecord(
        run_id="r", model_name="m", model_hash="h", num_layers=4, hidden=64, stages=[[0, 2], [2, 4]]
    ).to_dict()
    d.update(kw)
    return d


def test_run_record_round_trip():
    assert RunRecord.from_dict(_run()).to_dict() == _run()


@pytest.mark.parametrize(
    "bad",
    [
        dict(stages=[[0, 2], [3, 4]]),
        dict(stages=[[0, 2]]),
        dict(stages=[[0, 4], [4, 4]]),
        dict(num_layers="4"),
        dict(lr=True),
        dict(protocol=99),
        dict(seq_len=0),
        dict(unknown_field=1),
    ],
)
def test_run_record_rejects(bad):
    with pytest.raises(RecordError):
        RunRecord.from_dict(_run(**bad))


def test_run_record_not_a_map():
    with pytest.raises(RecordError):
        RunRecord.from_dict([1, 2])


def test_stage_record_validation():
    rec = StageRecord(throughput=10.0, ready=True, maddrs=["/ip4/1.2.3.4/tcp/1"])
    assert StageRecord.from_dict(rec.to_dict()) == rec
    assert StageRecord.from_dict({**rec.to_dict(), "future_field": 1}) == rec
    for bad in (
        {"circuit": "evil"},
        {"throughput": -1.0},
        {"queue": "3"},
        {"maddrs": ["x" * 600]},
        {"ready": 1},
    ):
        with pytest.raises(RecordError):
            StageRecord.from_dict({**rec.to_dict(), **bad})


def _nested(name: str, **kw) -> dict:
    d = _run()
    d[name] = {**d[name], **kw}
    return d


@pytest.mark.parametrize(
    "record",
    [
        # the joiner crash the issue names: an anchor map without "alpha" was a KeyError at start-up
        {**_run(), "anchor": {k: v for k, v in _run()["anchor"].items() if k != "alpha"}},
        _nested("anchor", alpha="0.3"),
        _nested("anchor", tau_relative=1),
        _nested("outer", every=None),
        _nested("outer", extra=1),
        _nested("dp", timeout=[1]),
        {**_run(), "codec": {"wire_dtype": "bfloat16"}},
    ],
)
def test_malformed_nested_settings_are_one_line_record_errors(record):
    with pytest.raises(RecordError) as e:
        RunRecord.from_dict(record)
    assert "\n" not in str(e.value)
