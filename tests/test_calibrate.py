"""The run's starter fits the PCA link bases one stage at a time (``node.stage.basis.calibrate_stagewise``),
with the same result as running the whole model through transformers."""

import gc
import weakref

import torch

from compression.pca import fit_basis
from node.model.loading import open_model
from node.stage.basis import calibrate_stagewise, real_tokens
from tests.test_loading import _save, _whole

RANGES = [[0, 1], [1, 3], [3, 4]]
PAD = 0


def _batches(n: int = 3):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(1, 100, (2, 12), generator=g)
        ids[1, 7 + i :] = PAD  # right padding: those positions are not calibration samples
        out.append((ids, ids.clone()))
    return out


def test_stagewise_bases_equal_the_whole_models_hidden_states(tmp_path):
    path = _save("llama-tied", tmp_path / "ckpt")
    source = open_model(str(path))
    got = calibrate_stagewise(
        lambda i: source.load_stage(RANGES, i, torch.device("cpu"), torch.float32),
        RANGES,
        _batches(),
        k=4,
        pad_id=PAD,
    )
    # the reference: transformers' own hidden states entering the first layer of each next stage
    whole = _whole(path).eval()
    with torch.no_grad():
        outs = [
            (whole(input_ids=ids, output_hidden_states=True), real_tokens(ids, PAD)) for ids, _ in _batches()
        ]
    assert len(got) == len(RANGES) - 1
    for b, (mean, v) in enumerate(got):
        samples = torch.cat([o.hidden_states[RANGES[b][1]][keep] for o, keep in outs])
        want_mean, want_v = fit_basis(samples, 4)
        assert (mean - want_mean).abs().max() <= 1e-5, b
        # the same subspace (the projector; each column's sign is fixed by fit_basis anyway)
        assert (v @ v.T - want_v @ want_v.T).abs().max() <= 1e-4, b


def test_one_stage_in_memory_at_a_time_and_the_last_never_loaded(tmp_path):
    path = _save("llama-tied", tmp_path / "ckpt")
    source = open_model(str(path))
    loaded: list[int] = []
    alive: list[weakref.ref] = []

    def load(i: int):
        gc.collect()
        assert not any(r() is not None for r in alive), f"stage {i} loaded while an earlier one is still held"
        loaded.append(i)
        stage = source.load_stage(RANGES, i, torch.device("cpu"), torch.float32)
        alive.append(weakref.ref(stage))
        return stage

    calibrate_stagewise(load, RANGES, _batches(), k=4, pad_id=PAD)
    assert loaded == [0, 1]


def test_stagewise_rotations_equal_the_whole_models_activations_and_gradients(tmp_path):
    """The tiered codec's rotations, fitted one stage at a time (forward, then backward from the
    tail), against transformers' whole model: its hidden states and autograd's gradients of its
    own loss at each boundary."""
    from compression.tiered import fit_rotation
    from node.stage.basis import calibrate_rotations_stagewise

    path = _save("llama-tied", tmp_path / "ckpt")
    source = open_model(str(path))
    loaded: list[int] = []

    def load(i: int):
        loaded.append(i)
        return source.load_stage(RANGES, i, torch.device("cpu"), torch.float32)

    got = calibrate_rotations_stagewise(load, RANGES, _batches(), pad_id=PAD)
    assert loaded == [0, 1, 2, 1]  # forward 0..n-2, backward n-1..1: one stage at a time
    whole = _whole(path).train()
    acts: list[list[torch.Tensor]] = [[] for _ in got]
    grads: list[list[torch.Tensor]] = [[] for _ in got]
    for ids, labels in _batches():
        out = whole(input_ids=ids, labels=labels, output_hidden_states=True)
        hs = [out.hidden_states[RANGES[b][1]] for b in range(len(got))]
        for h in hs:
            h.retain_grad()
        out.loss.backward()
        keep = real_tokens(ids, PAD)
        for b, h in enumerate(hs):
            acts[b].append(h.detach()[keep])
            grads[b].append(h.grad[keep])
    for b, (r_fwd, r_bwd) in enumerate(got):
        for r, want in (
            (r_fwd, fit_rotation(torch.cat(acts[b]), centre=True)),
            (r_bwd, fit_rotation(torch.cat(grads[b]), centre=False)),
        ):
            # the same top directions (projectors: robust to the order of near-equal eigenvalues)
            p, q = r[:4].T @ r[:4], want[:4].T @ want[:4]
            assert (p - q).abs().max() <= 1e-3, b
