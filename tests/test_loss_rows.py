"""The rows the loss reads (node.stage.links.loss_rows) and the link that fits its basis by them.

A forward frame's labels travel with it, so every hop knows which positions the loss reads; the
default lowrank link at long frames (``loss_share``) gives those rows half the basis' fit.
"""

import torch

from compression.codec import LinkContext
from node.model.stages import IGNORE_INDEX, causal_lm_loss
from node.stage.linkio import LinkIO
from node.stage.links import build_codec, loss_rows
from protocol.records import RunRecord


def _labels() -> torch.Tensor:
    labels = torch.full((3, 9), IGNORE_INDEX)
    labels[0, 5:8] = torch.tensor([11, 12, 2])  # an answer and its EOS, then a pad
    labels[1, 1:] = 7  # every next token labelled (pretraining)
    return labels  # row 2: nothing labelled


def test_loss_rows_are_where_the_loss_has_a_gradient():
    """Against autograd: the logits the causal LM loss depends on are exactly the loss rows."""
    labels = _labels()
    logits = torch.randn(3, 9, 16, requires_grad=True)
    causal_lm_loss(logits, labels)[0].backward()
    assert torch.equal(loss_rows(labels), logits.grad.abs().sum(-1) > 0)


def test_a_forward_frame_is_fitted_by_the_loss_rows_of_its_labels():
    run = RunRecord(
        run_id="r",
        model_name="m",
        model_hash="h",
        num_layers=2,
        hidden=64,
        stages=[[0, 1], [1, 2]],
        codec={"codec": "lowrank", "k": 4, "basis_dtype": "int8", "basis_block": 32, "loss_share": True},
    )
    io = LinkIO(run, 0, vocab=512, peer_id="QmHead", dense_only=False)
    y, labels = torch.randn(3, 9, 64, generator=torch.Generator().manual_seed(5)), _labels()
    frame = io.forward_frame(0, 0, [], y, labels, None)
    codec = build_codec(run.codec)
    fitted = codec.encode_forward(y, LinkContext(loss_rows=loss_rows(labels)))
    plain = codec.encode_forward(y, LinkContext())
    assert all(torch.equal(frame.tensors[n], fitted[n]) for n in fitted)
    assert not torch.equal(fitted["vq"], plain["vq"])  # the fit moved: the check above can tell
