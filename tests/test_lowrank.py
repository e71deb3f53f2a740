"""Per-microbatch low-rank link codec (compression/lowrank.py): exactness, optimality, bytes, bad input."""

import pytest
import torch

from compression.codec import LinkContext, apply_link, payload_nbytes
from compression.lowrank import LowRankCodec, top_directions

CTX = LinkContext()


def _low_rank(t: int, h: int, r: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, r, generator=g) @ torch.randn(r, h, generator=g)


def test_rank_k_input_round_trips_exactly_in_fp32():
    c = LowRankCodec(k=8, coeff_dtype="float32", basis_dtype="float32")
    mean = torch.randn(64)
    h = (_low_rank(40, 64, 8, 0) + mean).reshape(4, 10, 64)  # rank 8 around a mean
    out = c.decode_forward(c.encode_forward(h, CTX), CTX, tuple(h.shape))
    assert torch.allclose(out, h, atol=1e-4), (out - h).abs().max()
    g = _low_rank(40, 64, 8, 1).reshape(4, 10, 64)  # gradients: uncentred, rank 8
    back = c.decode_backward(c.encode_backward(g, CTX), CTX, tuple(g.shape))
    assert torch.allclose(back, g, atol=1e-4)


def test_reconstruction_is_the_best_rank_k_approximation():
    """Against an independent reference: the truncated SVD (Eckart-Young)."""
    x = torch.randn(200, 48, generator=torch.Generator().manual_seed(2)) * torch.linspace(3, 0.1, 48)
    c = LowRankCodec(k=12, coeff_dtype="float32", basis_dtype="float32")
    rec = c.decode_backward(c.encode_backward(x, CTX), CTX, tuple(x.shape))
    u, s, vh = torch.linalg.svd(x.double(), full_matrices=False)
    best = (u[:, :12] * s[:12]) @ vh[:12]
    assert abs(float((rec.double() - x).norm()) - float((best - x).norm())) < 1e-3 * float(x.norm())


def test_same_rows_same_basis_and_orthonormal():
    x = torch.randn(100, 32, generator=torch.Generator().manual_seed(3))
    v1, v2 = top_directions(x, 6), top_directions(x.clone(), 6)
    assert torch.equal(v1, v2)
    assert torch.allclose(v1.T @ v1, torch.eye(6), atol=1e-5)


@pytest.mark.parametrize("coeff", ["int8", "bfloat16", "float32"])
@pytest.mark.parametrize("basis", ["int8", "int8/16", "bfloat16", "float32"])
def test_payload_bytes_match_frame_bytes(coeff, basis):
    dtype, _, bb = basis.partition("/")
    c = LowRankCodec(k=20, coeff_dtype=coeff, basis_dtype=dtype, block=8, basis_block=int(bb or 0))
    h = torch.randn(3, 7, 50)
    fwd, bwd = c.encode_forward(h, CTX), c.encode_backward(h, CTX)
    assert payload_nbytes(fwd) == c.frame_bytes(21, 50, "forward")
    assert payload_nbytes(bwd) == c.frame_bytes(21, 50, "backward")
    for name, t in {**fwd, **bwd}.items():
        assert t.dtype == c.payload_dtypes()[name], name


def test_int8_quantised_link_stays_close_and_backward_follows_gradients():
    """Through the in-graph link: int8 coefficients and basis keep most of a low-rank signal."""
    c = LowRankCodec(k=16)
    h = (_low_rank(64, 96, 16, 4) + 0.01 * torch.randn(64, 96)).reshape(2, 32, 96).requires_grad_(True)
    w = _low_rank(96, 96, 4, 5)
    out = apply_link(h, c, CTX)
    assert float((out - h).detach().norm() / h.detach().norm()) < 0.05
    (out @ w).square().sum().backward()
    exact = torch.autograd.grad((h @ w).square().sum(), h)[0]
    cos = torch.nn.functional.cosine_similarity(h.grad.reshape(-1), exact.reshape(-1), dim=0)
    assert cos > 0.95, cos


def test_malformed_payloads_are_refused():
    c = LowRankCodec(k=4, basis_dtype="float32")
    p = c.encode_backward(torch.randn(10, 16), CTX)
    with pytest.raises(ValueError, match="unit vectors"):  # a basis that amplifies
        c.decode_backward({**p, "v": p["v"] * 1000}, CTX, (10, 16))
    with pytest.raises(ValueError, match="unit vectors"):  # more directions than the run's k
        c.decode_backward({**p, "v": torch.cat([p["v"], p["v"]])}, CTX, (10, 16))
    with pytest.raises(RuntimeError):  # coefficients for another number of tokens
        c.decode_backward(p, CTX, (11, 16))
    with pytest.raises(ValueError):
        LowRankCodec(k=0)


def test_blockwise_int8_basis_is_closer_with_massive_activations():
    """A few tokens with huge values on a few channels (as SmolLM2's first tokens): one int8
    scale per direction loses more than one per 32 entries (on real boundary activations 5%
    against 1.3% of the centred signal; bench/results/quality.md)."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(300, 24, generator=g) @ torch.randn(24, 128, generator=g)
    x[:10, 3] += 500.0
    x[:10, 77] -= 300.0
    ref = LowRankCodec(k=16, coeff_dtype="float32", basis_dtype="float32")
    want = ref.decode_forward(ref.encode_forward(x, CTX), CTX, tuple(x.shape))
    errs = {}
    for bb in (0, 32):
        c = LowRankCodec(k=16, coeff_dtype="float32", basis_dtype="int8", basis_block=bb)
        got = c.decode_forward(c.encode_forward(x, CTX), CTX, tuple(x.shape))
        errs[bb] = float((got - want).norm() / (want - x.mean(0)).norm())
    assert errs[32] < 0.75 * errs[0], errs


def test_backward_with_its_own_k_is_exact_on_its_rank_and_bills_each_direction():
    """k_backward: the gradient gets more directions than the activations; each direction is the
    best approximation of its own rank (truncated SVD), and its bytes are its own frame_bytes."""
    c = LowRankCodec(k=4, k_backward=12, coeff_dtype="float32", basis_dtype="float32")
    g = _low_rank(40, 64, 12, 6).reshape(4, 10, 64)  # rank 12: only the backward's k holds it
    back = c.decode_backward(c.encode_backward(g, CTX), CTX, tuple(g.shape))
    assert torch.allclose(back, g, atol=1e-4)
    h = _low_rank(40, 64, 12, 7).reshape(4, 10, 64)
    fwd = c.decode_forward(c.encode_forward(h, CTX), CTX, tuple(h.shape))
    rows = h.reshape(40, 64) - h.reshape(40, 64).mean(0)
    u, s, vh = torch.linalg.svd(rows.double(), full_matrices=False)
    best = (u[:, :4] * s[:4]) @ vh[:4]  # the forward keeps only its 4 (Eckart-Young)
    err = float((fwd.reshape(40, 64) - h.reshape(40, 64)).norm())
    assert abs(err - float((best - rows).norm())) < 1e-3 * float(rows.norm())
    q = LowRankCodec(k=8, k_backward=24, basis_dtype="int8", basis_block=16)
    x = torch.randn(3, 7, 50)
    pf, pb = q.encode_forward(x, CTX), q.encode_backward(x, CTX)
    assert payload_nbytes(pf) == q.frame_bytes(21, 50, "forward") < q.frame_bytes(21, 50, "backward")
    assert payload_nbytes(pb) == q.frame_bytes(21, 50, "backward")
    assert pb["vq"].shape[0] == 24 and pf["vq"].shape[0] == 8
    with pytest.raises(ValueError, match="unit vectors"):  # a forward frame may not carry the backward's k
        q.decode_forward({**pf, "vq": pb["vq"], "vscale": pb["vscale"]}, CTX, (3, 7, 50))


def test_four_bit_backward_buys_more_directions_of_a_flat_gradient_at_equal_bytes():
    """A gradient whose energy is spread over 32 directions: 32 directions at 4 bits (with a scale
    per direction) leave less error than 16 at 8 bits, for about the same bytes per token."""
    g = (
        torch.randn(512, 32, generator=torch.Generator().manual_seed(8))
        @ torch.linalg.qr(torch.randn(96, 32, generator=torch.Generator().manual_seed(9)))[0].T
    )  # equal singular values: a flat spectrum
    g = g + 0.01 * torch.randn(512, 96, generator=torch.Generator().manual_seed(10))
    wide = LowRankCodec(k=4, k_backward=32, backward_bits=4, basis_dtype="int8", basis_block=32)
    narrow = LowRankCodec(k=4, k_backward=16, basis_dtype="int8", basis_block=32)

    def err(c):
        p = c.encode_backward(g, CTX)
        assert payload_nbytes(p) == c.frame_bytes(512, 96, "backward")
        return float((c.decode_backward(p, CTX, (512, 96)) - g).norm() / g.norm())

    assert wide.frame_bytes(512, 96, "backward") <= 1.25 * narrow.frame_bytes(512, 96, "backward")
    assert err(wide) < 0.15 < 0.5 < err(narrow)  # measured: 0.098 against 0.62
    p = wide.encode_backward(g, CTX)
    with pytest.raises(ValueError, match="direction scales"):
        wide.decode_backward({**p, "cs": p["cs"][:-1]}, CTX, (512, 96))


def test_tiers_code_more_directions_of_a_falling_spectrum_at_equal_bytes():
    """Energy over 48 directions, falling 10x: 12 at 8 bits + 36 at 4 bits (tiers) leave less error
    than 36 at 8 bits for fewer bytes, in both directions; the bytes are the frame's own."""
    g = torch.Generator().manual_seed(11)
    basis = torch.linalg.qr(torch.randn(128, 48, generator=g))[0].T
    x = (torch.randn(1024, 48, generator=g) * torch.logspace(0, -1, 48)) @ basis
    x = x + 0.001 * torch.randn(1024, 128, generator=g)
    tiered = LowRankCodec(
        tiers=((12, 8), (36, 4)), backward_tiers=((12, 8), (36, 4)), basis_dtype="int8", basis_block=32
    )
    flat = LowRankCodec(k=36, basis_dtype="int8", basis_block=32)
    for direction in ("forward", "backward"):
        errs = []
        for c in (tiered, flat):
            enc, dec = (
                (c.encode_forward, c.decode_forward)
                if direction == "forward"
                else (c.encode_backward, c.decode_backward)
            )
            p = enc(x, CTX)
            assert payload_nbytes(p) == c.frame_bytes(1024, 128, direction)
            for name, t in p.items():
                assert t.dtype == c.payload_dtypes()[name], name
            errs.append(float((dec(p, CTX, (1024, 128)) - x).norm() / (x - x.mean(0)).norm()))
        assert tiered.frame_bytes(1024, 128, direction) <= flat.frame_bytes(1024, 128, direction)
        assert errs[0] < 0.5 * errs[1], (direction, errs)  # measured: 0.053 against 0.141
    p = tiered.encode_backward(x, CTX)
    with pytest.raises(ValueError, match="direction"):
        tiered.decode_backward({**p, "vq": p["vq"][:40], "vscale": p["vscale"][:40]}, CTX, (1024, 128))


def test_median_centre_keeps_the_bulk_rows_when_a_few_rows_are_sinks():
    """A few rows ~100x louder (a pretrained LM's attention sinks): the mean is pulled towards them
    and every other row carries that offset; around the median the bulk rows keep their precision."""
    g = torch.Generator().manual_seed(12)
    basis = torch.linalg.qr(torch.randn(64, 9, generator=g))[0].T
    x = torch.randn(1000, 8, generator=g) @ basis[:8] + 2.0
    x[::25] += 2000.0 * basis[8]  # the sinks, in a direction of their own
    bulk = torch.ones(1000, dtype=torch.bool)
    bulk[::25] = False

    def bulk_err(centre: str) -> float:
        c = LowRankCodec(k=10, centre=centre, basis_dtype="int8", basis_block=32)
        y = c.decode_forward(c.encode_forward(x, CTX), CTX, tuple(x.shape))
        return float(((y - x)[bulk].norm(dim=1) / (x - 2.0)[bulk].norm(dim=1)).median())

    # k = 10 holds the bulk, the sinks and the sample median's own offset either way; around the
    # mean every bulk row also carries the sinks' offset (2000 / 25 = 80, against bulk coefficients
    # ~1), and that coefficient sets the int8 scale of the row's block: the bulk's own get a few
    # levels. Measured: 0.014 against 0.287.
    assert bulk_err("median") < 0.02 < 0.2 < bulk_err("mean")


def _with_first(b: int, t: int, h: int, seed: int) -> torch.Tensor:
    """(b, t, h): rank 8 around a mean at positions 1.., and at position 0 rows ~100x louder in a
    rank-3 set of their own (a pretrained LM's attention sink is its first position)."""
    g = torch.Generator().manual_seed(seed)
    x = (_low_rank(b * t, h, 8, seed) + torch.randn(h, generator=g)).reshape(b, t, h)
    x[:, 0] = 100.0 * (
        torch.randn(b, 3, generator=g) @ torch.randn(3, h, generator=g) + torch.randn(h, generator=g)
    )
    return x


def test_first_positions_apart_round_trip_exactly_in_fp32():
    x = _with_first(6, 10, 64, 20)
    apart = LowRankCodec(k=8, coeff_dtype="float32", basis_dtype="float32", first_apart=True)
    out = apart.decode_forward(apart.encode_forward(x, CTX), CTX, tuple(x.shape))
    assert torch.allclose(out, x, rtol=1e-4, atol=1e-2), (out - x).abs().max()
    # in one shared basis the first positions take directions from the rest: rank 8 no longer holds
    shared = LowRankCodec(k=8, coeff_dtype="float32", basis_dtype="float32")
    y = shared.decode_forward(shared.encode_forward(x, CTX), CTX, tuple(x.shape))
    assert float((y - x)[:, 1:].norm() / x[:, 1:].norm()) > 0.1


def test_first_apart_keeps_the_other_rows_precise_beside_sinks():
    """As the median test above, with the sinks where a pretrained LM has them (position 0): coded
    apart, the other rows keep their precision at int8 (measured 0.007 against 0.25 shared)."""
    g = torch.Generator().manual_seed(12)
    basis = torch.linalg.qr(torch.randn(64, 9, generator=g))[0].T
    x = (torch.randn(40 * 25, 8, generator=g) @ basis[:8] + 2.0).reshape(40, 25, 64)
    x[:, 0] += 2000.0 * basis[8]

    def rest_err(apart: bool) -> float:
        c = LowRankCodec(k=10, basis_dtype="int8", basis_block=32, first_apart=apart)
        y = c.decode_forward(c.encode_forward(x, CTX), CTX, tuple(x.shape))
        return float(((y - x)[:, 1:].norm(dim=-1) / (x - 2.0)[:, 1:].norm(dim=-1)).median())

    assert rest_err(True) < 0.02 < 0.2 < rest_err(False)


@pytest.mark.parametrize("shape", [(12, 9, 64), (2, 30, 64), (5, 1, 64), (40, 64)])
def test_first_apart_payload_bytes_match_frame_bytes(shape):
    """Fewer sequences than FIRST_K, one position per sequence (nothing apart), 2-D rows (none)."""
    c = LowRankCodec(k=8, basis_dtype="int8", basis_block=32, first_apart=True)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    p = c.encode_forward(x, CTX)
    seqs = shape[0] if len(shape) == 3 else 0
    tokens = x[..., 0].numel()
    assert payload_nbytes(p) == c.frame_bytes(tokens, 64, "forward", sequences=seqs)
    assert c.decode_forward(p, CTX, shape).shape == x.shape


def test_first_apart_malformed_payloads_are_refused():
    c = LowRankCodec(k=8, basis_dtype="int8", basis_block=32, first_apart=True)
    x = _with_first(6, 10, 64, 21)
    good = c.encode_forward(x, CTX)
    bad = [
        {k: v for k, v in good.items() if k != "f_q"},  # the first positions' codes missing
        good | {"f_q": good["f_q"][:-1]},  # codes for 5 sequences, the frame has 6
        good | {"f_mean": good["f_mean"][:-1]},
        good | {"f_scale": good["f_scale"][:, :0]},
        good | {"q": good["q"][:-1], "scale": good["scale"][:-1]},  # one row short of the rest
    ]
    for payload in bad:
        with pytest.raises(ValueError):
            c.decode_forward(payload, CTX, tuple(x.shape))


def _answer_frame(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(20, 25, 64) rows: the prompt's bulk in 12 directions of falling scale (4 to 0.25); the rows
    the loss reads (the last 3 positions of each sequence: 12% of the frame) add 2 directions of
    their own at scale 1.5, as an answer carries what the prompt's bulk does not. And their mask."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(64, 14, generator=g))[0].T
    x = torch.randn(20 * 25, 12, generator=g) @ (basis[:12] * torch.linspace(4.0, 0.25, 12)[:, None]) + 1.5
    read = torch.zeros(20, 25, dtype=torch.bool)
    read[:, -3:] = True
    flat = read.reshape(-1)
    x[flat] += torch.randn(int(flat.sum()), 2, generator=g) @ basis[12:] * 1.5
    return x.reshape(20, 25, 64), read


def _row_errors(codec: LowRankCodec, x: torch.Tensor, ctx: LinkContext) -> torch.Tensor:
    y = codec.decode_forward(codec.encode_forward(x, ctx), CTX, tuple(x.shape))  # receiver: no mask
    return (y - x).norm(dim=-1) / (x - 1.5).norm(dim=-1)


def test_loss_share_spends_the_basis_on_the_rows_the_loss_reads():
    """k = 12 directions for 14: fitted to all rows alike, the bulk takes them all and the answer
    rows lose their own two (0.13 error each); with the loss rows given half the fit, those two
    displace the bulk's quietest and the answer rows' error halves (0.06), the bulk's stays small."""
    x, read = _answer_frame(30)
    ctx = LinkContext(loss_rows=read)
    plain = _row_errors(LowRankCodec(k=12, basis_dtype="int8", basis_block=32), x, ctx)
    share = _row_errors(LowRankCodec(k=12, basis_dtype="int8", basis_block=32, loss_share=True), x, ctx)
    assert float(share[read].median()) < 0.5 * float(plain[read].median())
    assert float(share[~read].median()) < 0.1


@pytest.mark.parametrize("first_apart", [False, True])
def test_loss_share_is_exact_inside_the_subspace_and_costs_no_byte(first_apart):
    """Any positive weighting of rank-k rows spans the same subspace: exact in fp32, same bytes."""
    if first_apart:
        x = _with_first(6, 10, 64, 31)  # rank 8 past position 0, rank 3 at it
    else:
        x = (_low_rank(60, 64, 8, 31) + torch.randn(64)).reshape(6, 10, 64)
    read = torch.zeros(6, 10, dtype=torch.bool)
    read[:, 7:] = True
    c = LowRankCodec(
        k=8, coeff_dtype="float32", basis_dtype="float32", loss_share=True, first_apart=first_apart
    )
    p = c.encode_forward(x, LinkContext(loss_rows=read))
    assert torch.allclose(c.decode_forward(p, CTX, tuple(x.shape)), x, rtol=1e-4, atol=1e-2)
    assert payload_nbytes(p) == c.frame_bytes(60, 64, "forward", sequences=6)


def test_loss_share_changes_nothing_where_all_rows_or_none_are_read():
    """Pretraining (every row read), generation (no labels), a frame without answer rows: the fit
    is the plain one, bit for bit."""
    x, _ = _answer_frame(32)
    plain = LowRankCodec(k=12, basis_dtype="int8", basis_block=32)
    share = LowRankCodec(k=12, basis_dtype="int8", basis_block=32, loss_share=True)
    ref = plain.encode_forward(x, CTX)
    for rows in (None, torch.ones(20, 25, dtype=torch.bool), torch.zeros(20, 25, dtype=torch.bool)):
        got = share.encode_forward(x, LinkContext(loss_rows=rows))
        assert got.keys() == ref.keys() and all(torch.equal(got[n], ref[n]) for n in ref)


def test_loss_share_refuses_a_mask_of_another_frame():
    x, read = _answer_frame(33)
    c = LowRankCodec(k=12, loss_share=True)
    with pytest.raises(ValueError, match="loss rows"):
        c.encode_forward(x, LinkContext(loss_rows=read[:, :-1]))
