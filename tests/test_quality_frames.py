"""bench/quality/quality.py --frame-tokens: each step is one frame packed as the node packs microbatches."""

from bench.quality.quality_tasks import BATCH, SEQ_LEN, step_frames, task_stream
from node.model.data import ByteTokenizer, collate, tokenize


def test_frames_fill_the_token_budget_as_node_microbatches():
    tok = ByteTokenizer(256)
    stream = task_stream("word", 0)
    frames = step_frames(stream, tok, steps=5, frame_tokens=512)
    nxt = next(stream)  # the example after the last frame: it did not fit
    for i, f in enumerate(frames):
        ids, _ = collate([tokenize(tok, e, SEQ_LEN) for e in f], tok.eos_token_id)
        assert ids.numel() <= 512  # (examples x longest) padded tokens, as the node's frames
        follower = frames[i + 1][0] if i + 1 < len(frames) else nxt
        grown, _ = collate([tokenize(tok, e, SEQ_LEN) for e in [*f, follower]], tok.eos_token_id)
        assert grown.numel() > 512  # greedy: the next example would not have fit
    assert len({e.prompt for f in frames for e in f}) == sum(len(f) for f in frames)  # no repeats


def test_without_frame_tokens_a_step_is_the_bench_batch():
    frames = step_frames(task_stream("arithmetic", 0), ByteTokenizer(256), steps=3, frame_tokens=0)
    assert [len(f) for f in frames] == [BATCH] * 3


def test_node_microbatches_pack_by_tokens_without_dropping_an_example():
    """--microbatch-tokens: the node's own stream fills each microbatch greedily, as the bench does."""
    from node.model.data import load_examples, microbatches

    tok = ByteTokenizer(256)
    examples = load_examples("arithmetic", seed=0, n_builtin=50)
    seen = []
    stream = microbatches(examples, tok, batch=8, seq_len=64, seed=3, max_tokens=512)
    for _ in range(12):  # more than one pass over the 50 examples
        ids, labels = next(stream)
        assert ids.numel() <= 512 and ids.shape[1] <= 64
        assert ids.shape[0] > 8  # the budget, not --microbatch, sets the rows
        seen += [bytes(r[r != tok.eos_token_id].tolist()) for r in ids]
    first_pass = seen[:50]
    assert sorted(first_pass) == sorted(bytes(tokenize(tok, e, 64)[0][:-1]) for e in examples)
    # without a budget: exactly --microbatch rows
    ids, _ = next(microbatches(examples, tok, batch=8, seq_len=64, seed=3))
    assert ids.shape[0] == 8


def test_run_record_bounds_a_token_packed_frame():
    from protocol.records import RunRecord

    base = dict(run_id="r", model_name="m", model_hash="h", num_layers=2, hidden=8, stages=[[0, 2]])
    rows = RunRecord(**base, seq_len=64, microbatch=8)
    assert rows.frame_fits(8, 64) and not rows.frame_fits(9, 10)
    packed = RunRecord(**base, seq_len=64, microbatch=8, microbatch_tokens=512)
    assert packed.frame_fits(25, 20) and not packed.frame_fits(9, 64) and not packed.frame_fits(1, 65)
    assert packed.max_frame_tokens == 512 and rows.max_frame_tokens == 512


def test_lowrank_one_way_diagnostics_compress_only_their_direction():
    """lowrank80-fwd-only / -bwd-only: the default link on one direction, dense bf16 on the other."""
    import torch

    from bench.quality.quality_codecs import build_codec
    from bench.quality.quality_tasks import VARIANTS
    from compression.codec import LinkContext
    from compression.lowrank import LowRankCodec

    torch.manual_seed(0)
    x, g, ctx, shape = torch.randn(300, 576), torch.randn(300, 576), LinkContext(), (300, 576)
    ref = LowRankCodec(k=80, basis_dtype="int8", basis_block=32)
    fwd, bwd = build_codec(VARIANTS["lowrank80-fwd-only"]), build_codec(VARIANTS["lowrank80-bwd-only"])
    ref_x = ref.decode_forward(ref.encode_forward(x, ctx), ctx, shape)
    ref_g = ref.decode_backward(ref.encode_backward(g, ctx), ctx, shape)
    assert torch.equal(fwd.decode_forward(fwd.encode_forward(x, ctx), ctx, shape), ref_x)
    assert torch.equal(fwd.decode_backward(fwd.encode_backward(g, ctx), ctx, shape), g.bfloat16().float())
    assert torch.equal(bwd.decode_forward(bwd.encode_forward(x, ctx), ctx, shape), x.bfloat16().float())
    assert torch.equal(bwd.decode_backward(bwd.encode_backward(g, ctx), ctx, shape), ref_g)
    assert fwd.frame_bytes(300, 576, "forward") == ref.frame_bytes(300, 576, "forward")
    assert fwd.frame_bytes(300, 576, "backward") == 300 * 576 * 2
    assert bwd.frame_bytes(300, 576, "backward") == ref.frame_bytes(300, 576, "backward")
    assert bwd.frame_bytes(300, 576, "forward") == 300 * 576 * 2
