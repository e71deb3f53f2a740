"""Codec names -> constructors, so the node and the benchmarks build codecs from settings."""

from __future__ import annotations

from collections.abc import Callable

from compression.codec import DenseCodec, LinkCodec


def _mask(**kw) -> LinkCodec:
    from compression.mask import MaskCodec

    return MaskCodec(**kw)


CODECS: dict[str, Callable[..., LinkCodec]] = {
    "dense": DenseCodec,
    "mask": _mask,
}


def make_codec(name: str, **settings) -> LinkCodec:
    """Build a codec by name; unknown names fail with the list of known ones."""
    try:
        factory = CODECS[name]
    except KeyError:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(sorted(CODECS))}") from None
    return factory(**settings)
