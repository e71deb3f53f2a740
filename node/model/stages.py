"""Split a transformers causal LM into pipeline stages.

Stage 0 (head) owns the token embedding, the last stage (tail) the final norm, lm_head and
loss; every stage runs a contiguous range of decoder layers with the same rotary position
embeddings and causal mask the whole model would use, so the S-stage pipeline computes
exactly the whole model (tests compare logits and every gradient).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

IGNORE_INDEX = -100


def layer_costs(model) -> list[float]:
    return [float(sum(p.numel() for p in layer.parameters())) for layer in model.model.layers]


def balance_layers(
    costs: list[float], n_stages: int, head_extra: float = 0.0, tail_extra: float = 0.0
) -> list[list[int]]:
    """Contiguous [start, end) ranges minimising the largest stage cost (greedy over a bisected bound).

    ``head_extra``/``tail_extra`` are the costs the first/last stage carry besides their layers.
    We count parameters that take part in matmuls: lm_head weighs in on the tail, while the
    embedding is a table lookup and costs the head almost nothing.
    """
    n = len(costs)
    if not 1 <= n_stages <= n:
        raise ValueError(f"cannot split {n} layers into {n_stages} stages")

    def split(bound: float) -> list[list[int]] | None:
        ranges, start, acc = [], 0, head_extra
        for i, c in enumerate(costs):
            remaining_layers = n - i
            remaining_stages = n_stages - len(ranges)
            extra = tail_extra if remaining_stages == 1 else 0.0
            # close the current stage if adding this layer exceeds the bound, or layers would run out
            if i > start and (acc + c + extra > bound or remaining_layers < remaining_stages):
                ranges.append([start, i])
                start, acc = i, 0.0
            acc += c
        ranges.append([start, n])
        last_cost = acc + tail_extra
        if len(ranges) != n_stages or last_cost > bound:
            return None
        return ranges

    lo, hi = max(costs), sum(costs) + head_extra + tail_extra
    best = None
    for _ in range(60):
        mid = (lo + hi) / 2
        r = split(mid)
        if r is not None:
            best, hi = r, mid
        else:
            lo = mid
    if best is None:  # degenerate inputs: fall back to equal layer counts
        step = n / n_stages
        best = [[round(i * step), round((i + 1) * step)] for i in range(n_stages)]
    return best


def default_stage_ranges(model, n_stages: int) -> list[list[int]]:
    head = model.get_output_embeddings()
    tail_extra = float(head.weight.numel()) if head is not None else 0.0
    return balance_layers(layer_costs(model), n_stages, head_extra=0.0, tail_extra=tail_extra)


class Stage(nn.Module):
    """Layers [start, end) of a decoder, plus the embedding (head) and/or norm+lm_head (tail)."""

    def __init__(self, model, start: int, end: int, is_head: bool, is_tail: bool):
        super().__init__()
        inner = model.model
        self.start, self.end, self.is_head, self.is_tail = start, end, is_head, is_tail
        self.config = model.config
        self.layers = nn.ModuleList(inner.layers[start:end])
        self.rotary_emb = inner.rotary_emb
        self.embed_tokens = inner.embed_tokens if is_head else None
        self.norm = inner.norm if is_tail else None
        self.lm_head = model.lm_head if is_tail else None
        # activation checkpointing (--recompute-layers): keep each layer's input only and recompute
        # the layer in backward, so activation memory stops growing 34x per layer
        self.recompute = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Head: token ids (B, T) -> hidden; body: hidden -> hidden; tail: hidden -> logits."""
        hidden = self.layers_forward(x)
        if self.is_tail:
            hidden = self.lm_head(self.norm(hidden))
        return hidden

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Tail: the causal LM loss, with lm_head applied only where a label is.

        Equal to ``causal_lm_loss(self(x), labels)``, but the vocabulary projection (the
        largest matmul of a small model) runs on the labelled positions only: on
        prompt/completion data that is a fraction of the tokens.
        """
        hidden = self.layers_forward(x)[:, :-1]
        target = labels[:, 1:]
        sel = target != IGNORE_INDEX
        n = int(sel.sum())
        logits = self.lm_head(self.norm(hidden[sel]))
        loss = nn.functional.cross_entropy(logits.float(), target[sel], reduction="sum")
        return loss / max(n, 1), n

    def attention_types(self) -> list[str]:
        """Each of this stage's layers' attention, as the whole model picks its mask: Qwen2/3 name it
        per layer (``layer_types``), Mistral slides a window in every layer, Llama attends fully."""
        types = getattr(self.config, "layer_types", None)
        if types is None:
            window = getattr(self.config, "sliding_window", None) is not None
            types = ["sliding_attention" if window else "full_attention"] * self.config.num_hidden_layers
        unknown = set(types[self.start : self.end]) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"layers with attention {sorted(unknown)} cannot be split into stages")
        return list(types[self.start : self.end])

    def layers_forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        hidden = self.embed_tokens(x) if self.is_head else x
        b, t = hidden.shape[:2]
        pos = torch.arange(t, device=hidden.device).unsqueeze(0).expand(b, t)
        cos_sin = self.rotary_emb(hidden, pos)
        # Right-padded batches need no padding mask: real tokens never attend to later pads,
        # and pad positions carry no loss.
        kw = dict(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=pos)
        types = self.attention_types()
        masks = {
            t: (create_sliding_window_causal_mask if t == "sliding_attention" else create_causal_mask)(**kw)
            for t in set(types)
        }
        for layer, kind in zip(self.layers, types):
            kw = dict(attention_mask=masks[kind], position_ids=pos, position_embeddings=cos_sin)
            if self.recompute and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                hidden = checkpoint(layer, hidden, use_reentrant=False, **kw)
            else:
                hidden = layer(hidden, **kw)
            if isinstance(hidden, tuple):  # older transformers returned tuples
                hidden = hidden[0]
        return hidden


def build_stage(model, ranges: list[list[int]], index: int, keep_model: bool = False) -> Stage:
    """The stage ``index`` of ``ranges``. Unless ``keep_model``, other layers are freed."""
    start, end = ranges[index]
    src = copy.deepcopy(model) if keep_model else model
    stage = Stage(src, start, end, is_head=index == 0, is_tail=index == len(ranges) - 1)
    if not keep_model:
        src.model.layers = nn.ModuleList()  # drop references to layers other stages own
    return stage


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Mean next-token loss over labelled positions, and how many there were."""
    shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[:, 1:].reshape(-1)
    n = int((shift_labels != IGNORE_INDEX).sum())
    loss = nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / max(n, 1), n
