"""Codec names -> constructors, so the node and the benchmarks build codecs from settings."""

from __future__ import annotations

from collections.abc import Callable

from compression.codec import DenseCodec, LinkCodec


def _mask(**kw) -> LinkCodec:
    from compression.mask import MaskCodec

    return MaskCodec(**kw)


def _pca(**kw) -> LinkCodec:
    from compression.pca import PcaCodec

    return PcaCodec(**kw)


def _pcamask(**kw) -> LinkCodec:
    from compression.pcamask import PcaMaskCodec

    return PcaMaskCodec(**kw)


def _outliermask(**kw) -> LinkCodec:
    from compression.outlier import OutlierMaskCodec

    return OutlierMaskCodec(**kw)


def _topk(**kw) -> LinkCodec:
    from compression.baselines import TopKCodec

    return TopKCodec(**kw)


def _int8(**kw) -> LinkCodec:
    from compression.baselines import QuantCodec

    return QuantCodec(bits=8, **kw)


def _int4(**kw) -> LinkCodec:
    from compression.baselines import QuantCodec

    return QuantCodec(bits=4, **kw)


def _bottleneck(**kw) -> LinkCodec:
    from compression.baselines import BottleneckCodec

    return BottleneckCodec(**kw)


def _lowrank(**kw) -> LinkCodec:
    from compression.lowrank import LowRankCodec

    return LowRankCodec(**kw)


def _subspace(**kw) -> LinkCodec:
    from compression.subspace import SubspaceCodec

    return SubspaceCodec(**kw)


def _linkbasis(**kw) -> LinkCodec:
    from compression.linkbasis import LinkBasisCodec

    return LinkBasisCodec(**kw)


def _tiered(**kw) -> LinkCodec:
    from compression.tiered import TieredCodec

    return TieredCodec(**kw)


CODECS: dict[str, Callable[..., LinkCodec]] = {
    "dense": DenseCodec,
    "mask": _mask,
    "pca": _pca,
    "pcamask": _pcamask,
    "outliermask": _outliermask,
    "topk": _topk,
    "int8": _int8,
    "int4": _int4,
    "bottleneck": _bottleneck,
    "subspace": _subspace,
    "lowrank": _lowrank,
    "linkbasis": _linkbasis,
    "tiered": _tiered,
}


def make_codec(name: str, **settings) -> LinkCodec:
    """Build a codec by name; unknown names fail with the list of known ones."""
    try:
        factory = CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}") from None
    return factory(**settings)
