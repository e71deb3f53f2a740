"""Outer-round tensor parts at 8 or 4 bits on hivemind's all-reduce wire (``compression.outer_quant``).

hivemind's butterfly all-reduce cuts every tensor into parts, sends each part to the member
that reduces it, and gets the part's average back. With ``--outer-bits 8`` or ``4``:

* a sender's tensors are already quantised (``outer_quant.with_feedback``: values that are
  exact multiples of bf16 block scales); ``QuantParts`` encodes a part with the slice of those
  scales its values were made with, so nothing is rounded again and what the sender keeps as
  sent (its error feedback) is exactly what the reducer receives;
* the reducer averages and quantises the average afresh (``encode_average``) for every member,
  itself included (``average_as_received``): all members hold bit-identical results;
* the bytes are ``runtime_pb2.Tensor`` messages with dtype ``vnode-q8``/``vnode-q4`` and
  compression NONE: hivemind's enum has no 4-bit type and no way to add one, so such a message
  reaching hivemind's own decoder fails loudly (an unknown numpy dtype) rather than decoding
  wrong; ``decoded_stub`` turns the replies into plain tensors before hivemind reads them.

Parts must start on a block boundary: hivemind cuts a tensor into parts of
``part_size_bytes / (4 * ratio)`` values, and ``estimate_compression_ratio`` = bits / 32 makes
that a multiple of the block for hivemind's power-of-two part sizes (checked per part).
"""

from __future__ import annotations

import math

import torch
from hivemind.compression import CompressionBase, CompressionInfo, NoCompression, serialize_torch_tensor
from hivemind.compression.serialization import deserialize_torch_tensor
from hivemind.proto import averaging_pb2, runtime_pb2

from compression import outer_quant

PREFIX = "vnode-q"


def bits_of(msg: runtime_pb2.Tensor) -> int:
    """The bits of a quantised part (0 for any other tensor message)."""
    return int(msg.dtype[len(PREFIX) :]) if msg.dtype.startswith(PREFIX) else 0


def _message(values: torch.Tensor, scales: torch.Tensor, bits: int) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(
        buffer=outer_quant.encode(values, scales, bits),
        size=list(values.shape),
        dtype=f"{PREFIX}{bits}",
        compression=runtime_pb2.CompressionType.NONE,
    )


def unpack(msg: runtime_pb2.Tensor) -> torch.Tensor:
    """A part as fp32 values: quantised ones decoded here, anything else by hivemind."""
    bits = bits_of(msg)
    if not bits:
        return deserialize_torch_tensor(msg)
    n = math.prod(msg.size)
    return outer_quant.decode(msg.buffer, n, bits).reshape(tuple(msg.size))


def encode_average(avg: torch.Tensor, bits: int) -> runtime_pb2.Tensor:
    """The reducer's average of a part, quantised afresh (its own block scales)."""
    values, scales = outer_quant.quantize(avg.reshape(-1), bits)
    return _message(values, scales, bits)


def average_as_received(avg: torch.Tensor, bits: int) -> torch.Tensor:
    """What every member decodes from ``encode_average``: the reducer keeps exactly that too."""
    return unpack(encode_average(avg, bits))


class QuantParts(CompressionBase):
    """Encodes the parts of the tensors listed in ``scales`` (tensor key -> its flat block scales)
    at ``bits``; other tensors (the re-anchoring state) go as they are."""

    compression_type = runtime_pb2.CompressionType.NONE

    def __init__(self, bits: int, scales: dict[int, torch.Tensor]):
        self.bits = outer_quant.check_bits(bits)
        self.scales = scales

    def quantised(self, info: CompressionInfo) -> bool:
        return self.bits != 32 and info.key in self.scales

    def compress(
        self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False
    ) -> runtime_pb2.Tensor:
        if not self.quantised(info):
            return NoCompression().compress(tensor, info, allow_inplace)
        start = info.part_index * (info.part_size or 0)
        if start % outer_quant.BLOCK:
            raise ValueError(
                f"part {info.part_index} starts at {start}, not on a {outer_quant.BLOCK}-value block"
            )
        first = start // outer_quant.BLOCK
        nb = math.ceil(tensor.numel() / outer_quant.BLOCK)
        return _message(tensor.reshape(-1), self.scales[info.key][first : first + nb], self.bits)

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        return unpack(serialized_tensor)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return self.bits / 32 if self.quantised(info) else 1.0


class _DecodedStub:
    """A peer's averaging stub whose ``rpc_aggregate_part`` replies arrive as plain fp32 parts."""

    def __init__(self, stub):
        self._stub = stub

    def __getattr__(self, name):
        return getattr(self._stub, name)

    async def rpc_aggregate_part(self, inputs):
        replies = await self._stub.rpc_aggregate_part(inputs)
        return _decoded(replies)


async def _decoded(replies):
    async for msg in replies:
        if msg.code == averaging_pb2.AVERAGED_PART and bits_of(msg.tensor_part):
            msg = averaging_pb2.AveragingData(
                code=msg.code, tensor_part=serialize_torch_tensor(unpack(msg.tensor_part))
            )
        yield msg


def decoded_stub(stub) -> _DecodedStub:
    return _DecodedStub(stub)
