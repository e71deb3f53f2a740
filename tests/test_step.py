"""``node.step.mean_and_clip``: the one place summed microbatch gradients become the step's mean, clipped."""

import pytest
import torch

from node.step import mean_and_clip


def _summed_grads(model: torch.nn.Module, batches: list[torch.Tensor]) -> None:
    for x in batches:  # one backward per microbatch: gradients add up, as in the pipeline
        model(x).pow(2).mean().backward()


@pytest.mark.parametrize("factor", [0.5, 10.0])  # the clip binds (every entry scaled) / does not
def test_mean_and_clip_matches_the_full_batch_gradient_clipped_by_hand(factor):
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3)
    batches = [torch.randn(4, 6) for _ in range(3)]
    _summed_grads(model, batches)
    params = list(model.parameters())
    # reference: the gradient of the mean loss over the microbatches, from a separate model copy
    ref = torch.nn.Linear(6, 3)
    ref.load_state_dict(model.state_dict())
    torch.stack([ref(x).pow(2).mean() for x in batches]).mean().backward()
    want = [p.grad.clone() for p in ref.parameters()]
    norm = torch.sqrt(sum((g**2).sum() for g in want))
    clip = float(norm) * factor
    assert mean_and_clip(params, 3, clip)
    for p, g in zip(params, want):
        torch.testing.assert_close(p.grad, g * min(1.0, clip / norm), rtol=1e-5, atol=1e-7)


def test_mean_only_and_a_filter_between_mean_and_clip():
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.grad = torch.full_like(p, 6.0)
    seen = []
    assert mean_and_clip(list(model.parameters()), 3, None, lambda: seen.append(model.weight.grad.clone()))
    assert torch.equal(seen[0], torch.full((2, 2), 2.0))  # the filter saw the mean
    assert torch.equal(model.weight.grad, torch.full((2, 2), 2.0))  # clip=None: no clipping


def test_non_finite_gradient_is_reported():
    model = torch.nn.Linear(2, 2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    model.bias.grad[0] = float("inf")
    assert not mean_and_clip(list(model.parameters()), 2, 1.0)
