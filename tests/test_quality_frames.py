"""bench/quality.py --frame-tokens: each step is one frame packed as the node packs microbatches."""

from bench.quality import BATCH, SEQ_LEN, step_frames, task_stream
from node.data import ByteTokenizer, collate, tokenize


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
