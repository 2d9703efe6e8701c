"""How often each request with presence/frequency penalties has emitted each token, on the device.

OpenAI's penalties subtract `frequency · count(t) + presence · [count(t) > 0]` from the logit of
every token t, counted over the request's output so far. Rebuilding those counts from the host's
token lists costs a copy of the whole output per request and step, and needs the previous step's
tokens on the host first. Here each penalized request owns one row of a [slots, V] fp32 matrix
instead (as SGLang's penalizers keep cumulative counts): the row is filled from the host's output
once, when the request first samples, and from then on every step adds the tokens it emits, on
the device, in its own launch. So the next step (even one launched before this one is read back,
under async scheduling) penalizes with them, and MTP drafting sees the tokens it follows too.

Invariant: a request's row counts exactly the tokens of `Request.output_token_ids` plus every
token a launched step has emitted for it since (emitted tokens past a stop are counted too, but
the request then finishes and its row is released). Rows of finished requests are reused.
"""

from __future__ import annotations

import torch

from .request import Request


class OutputCounts:
    def __init__(self, vocab: int, device):
        self.vocab, self.device = vocab, torch.device(device)
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=self.device)  # [slots, V]
        self._slot: dict[int, tuple[Request, int]] = {}  # id(request) → (request, its row)
        self._free: list[int] = []

    def slots(self, reqs: list[Request]) -> torch.Tensor:
        """The rows of these requests [n] on the device; a request seen for the first time gets
        a row holding the counts of its output so far (one host → device copy, once)."""
        self._release_finished()
        out = []
        for req in reqs:
            entry = self._slot.get(id(req))
            if entry is None:
                entry = self._slot[id(req)] = (req, self._new_row(req.output_token_ids))
            out.append(entry[1])
        return _ints(out, self.device)

    def add(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Count tokens [n, Q] (−1: none) into rows `slots` [n], on the device, without a sync."""
        rows = slots[:, None].expand_as(tokens).reshape(-1)
        flat = tokens.reshape(-1)
        self.counts.index_put_((rows, flat.clamp(min=0)), (flat >= 0).float(), accumulate=True)

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        """[n, V] copies of the rows (a step adds its own drafts to them)."""
        return self.counts[slots]

    @property
    def num_live(self) -> int:
        return len(self._slot)

    def _new_row(self, history: list[int]) -> int:
        if not self._free:
            grow = max(4, self.counts.shape[0])
            self._free = list(range(self.counts.shape[0] + grow - 1, self.counts.shape[0] - 1, -1))
            self.counts = torch.cat((self.counts, self.counts.new_zeros(grow, self.vocab)))
        row = self._free.pop()
        self.counts[row].zero_()
        if history:
            tokens = _ints(history, self.device)
            self.counts[row].index_put_((tokens,), torch.ones(len(history), device=self.device), accumulate=True)
        return row

    def _release_finished(self) -> None:
        for key, (req, row) in list(self._slot.items()):
            if req.is_finished:
                del self._slot[key]
                self._free.append(row)


def _ints(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
