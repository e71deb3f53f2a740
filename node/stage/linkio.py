"""A stage's two links: frames built, validated, encoded and decoded, and the bases they need.

Everything here but the basis fetches is synchronous tensor work and runs in the compute
thread (``node.stage.compute``); the checks that read only a frame's header (``check_forward``)
are cheap and run where the frame arrives.
"""

from __future__ import annotations

import asyncio
import logging
import time

import torch

from compression.codec import LinkCodec, LinkContext
from compression.prf import mask_seed
from node.model.stages import IGNORE_INDEX
from node.stage.basis import BasisUnavailable
from node.stage.links import Link, loss_rows
from protocol.frames import (
    LABEL_TENSORS,
    BadDtype,
    Frame,
    FrameError,
    MalformedFrame,
    OutOfRange,
    ShapeMismatch,
    check_labels,
    check_payload_magnitude,
    decode_frame,
    pack_labels,
    unpack_labels,
)
from protocol.records import RunRecord

log = logging.getLogger("node")


BASIS_WAIT_S = 180.0  # the starter calibrates every boundary before it announces a basis
BASIS_POLL_S = 2.0


class LinkError(RuntimeError):
    """This microbatch cannot cross the link (no token ids for a subspace link, a gradient that does
    not decode); another peer would fare no better, so the hop is not retried."""


class LinkIO:
    def __init__(self, run: RunRecord, index: int, vocab: int, peer_id: str, dense_only: bool) -> None:
        self.run, self.index, self.vocab, self.peer_id = run, index, vocab, peer_id
        n_stages = len(run.stages)
        self.link_in = None if index == 0 else Link(run, index - 1, dense_only)
        self.link_out = None if index == n_stages - 1 else Link(run, index, dense_only)
        self.bases = None  # node.stage.basis.BasisStore when the run's codec needs a basis

    def parse(self, data: bytes) -> Frame:
        """Frame bytes -> Frame, every check of ``protocol.frames`` included (compute thread)."""
        return decode_frame(data, run_id=self.run.run_id)

    # ------------------------------------------------------------ receiving a FORWARD frame
    def check_forward(self, frame: Frame) -> LinkCodec:
        """The input codec of a FORWARD frame whose header fits this stage; FrameError otherwise."""
        if frame.kind != "forward":
            raise MalformedFrame(f"expected a forward frame, got {frame.kind}")
        if frame.boundary != self.index - 1:
            raise MalformedFrame(f"frame for boundary {frame.boundary} reached stage {self.index}")
        codec = self.link_in.by_id(frame.codec)
        if codec is None:
            raise MalformedFrame(f"codec {frame.codec!r} is not this run's ({self.run.codec['codec']!r})")
        if len(frame.shape) != 3 or frame.shape[2] != self.run.hidden:
            raise ShapeMismatch(f"activation shape {frame.shape} does not end in hidden {self.run.hidden}")
        check_labels(frame.tensors, frame.shape)
        if not self.run.frame_fits(frame.shape[0], frame.shape[1]):
            raise ShapeMismatch(f"microbatch {frame.shape[:2]} is empty or exceeds the run's limits")
        for name, want in codec.payload_dtypes().items():
            t = frame.tensors.get(name)
            if t is not None and t.dtype != want:
                raise BadDtype(f"payload {name!r} is {t.dtype}, this run sends {want}")
        return codec

    def decode_input(self, frame: Frame) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(activations, labels, token ids or None) of a checked FORWARD frame (compute thread)."""
        codec = self.link_in.by_id(frame.codec)
        shape = tuple(frame.shape)
        payload = {k: v for k, v in frame.tensors.items() if k not in LABEL_TENSORS}
        check_payload_magnitude(payload, "activations")
        try:
            x = codec.decode_forward(payload, _ctx(frame), shape)
        except (KeyError, RuntimeError, ValueError) as e:
            raise MalformedFrame(f"payload does not decode with codec {frame.codec}: {e}") from None
        token_ids = None
        if codec.carries_tokens:  # passed on to the next link's payload
            token_ids = codec.tokens_from_payload(frame.tensors).reshape(shape[:2])
        labels = unpack_labels(frame.tensors, frame.shape)
        if bool(((labels != IGNORE_INDEX) & ((labels < 0) | (labels >= self.vocab))).any()):
            raise OutOfRange(f"labels outside [0, {self.vocab})")
        return x, labels, token_ids

    def reply(self, frame: Frame, grad_x: torch.Tensor, meta: dict) -> Frame:
        """The BACKWARD frame answering ``frame`` (compute thread: the codec math runs here)."""
        codec = self.link_in.by_id(frame.codec)
        tokens = frame.shape[0] * frame.shape[1]
        return Frame(
            kind="backward",
            run_id=self.run.run_id,
            step=frame.step,
            microbatch=frame.microbatch,
            boundary=frame.boundary,
            codec=frame.codec,
            seed=frame.seed,
            basis_version=frame.basis_version,
            shape=list(frame.shape),
            tensors=codec.encode_backward(grad_x.cpu(), _ctx(frame)),
            meta={**meta, "mb_tokens": tokens},
        )

    # ------------------------------------------------------------ sending a FORWARD frame
    def forward_frame(
        self,
        step: int,
        mb: int,
        path: list[str],
        y: torch.Tensor,
        labels: torch.Tensor,
        token_ids: torch.Tensor | None,
    ) -> Frame:
        """The FORWARD frame carrying this stage's output ``y`` on (compute thread)."""
        codec = self.link_out.for_step(step)
        seed = mask_seed(self.run.seed, step, mb, self.index)
        ctx = LinkContext(seed=seed, basis_version=codec.version or 0, loss_rows=loss_rows(labels))
        if codec.carries_tokens:  # subspace: k numbers + the token id per position
            if token_ids is None:
                raise LinkError("the subspace link needs the microbatch's token ids")
            tensors = dict(codec.encode_forward_with_tokens(y.detach(), token_ids.to(y.device), ctx))
        else:
            tensors = dict(codec.encode_forward(y.detach(), ctx))
        tensors.update(pack_labels(labels, self.vocab))
        return Frame(
            kind="forward",
            run_id=self.run.run_id,
            step=step,
            microbatch=mb,
            boundary=self.index,
            path=path + [self.peer_id],
            codec=codec.codec_id,
            seed=seed,
            basis_version=ctx.basis_version,
            shape=list(y.shape),
            tensors=tensors,
        )

    def decode_gradient(self, down: Frame, bwd: Frame) -> torch.Tensor:
        """The gradient of our output from the BACKWARD frame answering ``down`` (compute thread)."""
        codec = self.link_out.by_id(down.codec)
        try:
            check_payload_magnitude(bwd.tensors, "gradient")
            return codec.decode_backward(bwd.tensors, _ctx(down), tuple(down.shape))
        except (FrameError, KeyError, RuntimeError, ValueError) as e:
            raise LinkError(f"the next stage's gradient is unusable: {e}") from None

    # ------------------------------------------------------------ bases (event loop: network)
    async def ensure_basis(self, codec: LinkCodec, frame: Frame) -> None:
        """Basis codecs: fetch a basis version this node does not hold yet (once per version)."""
        if self.bases is not None and not codec.holds_basis(frame.basis_version):
            await self.bases.fetch(frame.boundary, frame.basis_version, codec)

    async def install_bases(self, wait_s: float = BASIS_WAIT_S) -> None:
        """Basis codecs: get the newest basis of both links before serving (the sender needs it).

        A node that joins while the run's starter is still calibrating (~40 s for the bundled model
        on a CPU, after it printed the join command) finds no basis yet: it waits, saying so."""
        for boundary, link in ((self.index - 1, self.link_in), (self.index, self.link_out)):
            if link is None or not link.needs_basis:
                continue
            deadline, said = time.monotonic() + wait_s, False
            while (version := await self.bases.latest_version(boundary)) is None:
                if time.monotonic() > deadline:
                    raise BasisUnavailable(
                        f"no peer announces a basis for boundary {boundary} after {wait_s:.0f}s; is the "
                        "run's first node still running?"
                    )
                if not said:
                    log.info(
                        "waiting for the basis of boundary %d (the run's starter may be calibrating)",
                        boundary,
                    )
                    said = True
                await asyncio.sleep(BASIS_POLL_S)
            await self.bases.fetch(boundary, version, link.main)


def _ctx(frame: Frame) -> LinkContext:
    return LinkContext(seed=frame.seed, basis_version=frame.basis_version)
