"""Greedy generation with the plain reference, exactly as the golden data was produced.

Protocol (golden README "How the data was produced", step 3): prefill the whole prompt at
position 0, then one token per forward; the next token is the argmax of the fp32 logits (the
first index on ties). After every forward DSpark observes the main hidden states; after each
decode forward (not after the prefill) it drafts the block following the new token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .ref_dspark import DSpark
from .ref_state import IndexTrace
from .reference_model import ReferenceV41


@dataclass
class Generation:
    tokens: list[int]
    logprobs: torch.Tensor  # fp32 [steps, V]: log-softmax of the logits each token came from
    drafts: list[dict] = field(default_factory=list)  # per decode step: start_pos, anchor, draft, confidence
    index_traces: list[dict[int, IndexTrace]] = field(default_factory=list)  # per forward


def greedy_generate(model: ReferenceV41, prompt: list[int], max_new_tokens: int, eos: int | None = None,
                    with_drafts: bool = True) -> Generation:
    dspark = DSpark(model) if with_drafts and model.cfg.dspark_block_size else None
    state = model.new_state()
    out = model.forward(state, prompt)
    if dspark:
        dspark.observe(state, out.main_hidden, 0)
    gen = Generation([], torch.empty(0), index_traces=[out.index_trace])
    rows = []
    while True:
        logprobs = torch.log_softmax(out.logits[-1], dim=-1)
        rows.append(logprobs)
        gen.tokens.append(int(logprobs.argmax()))
        if len(gen.tokens) == max_new_tokens or gen.tokens[-1] == eos:
            break
        pos = state.length  # the new token's position
        out = model.forward(state, [gen.tokens[-1]])
        gen.index_traces.append(out.index_trace)
        if dspark:
            dspark.observe(state, out.main_hidden, pos)
            anchor = int(out.logits[-1].argmax())
            d = dspark.draft(state, anchor, pos)
            gen.drafts.append({"start_pos": pos, "anchor": anchor, "draft": d.tokens, "confidence": d.confidence})
    gen.logprobs = torch.stack(rows)
    return gen
