"""One request's grammar state: which tokens it may sample next, following its output.

The matcher (xgrammar.GrammarMatcher) follows the request's accepted output tokens. Until
`start_after` has been generated (a reasoning model's end-of-reasoning token) the grammar is
not active and every token is allowed; the token after it is the grammar's first. Speculation:
`fill` writes one bitmask row per logits row of the step — row j is the state after the
request's first j drafts — by advancing through the drafts and rolling back after (xgrammar
keeps the history); rows after a draft the grammar rejects are unreachable (verification stops
there) and repeat the last state.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np


class RequestGrammar:
    def __init__(self, compile: Future, start_after: int | None):
        self.compile = compile
        self.start_after = start_after
        self.matcher = None  # made once the grammar is compiled (`start`)
        self.active = start_after is None
        self.terminated = False

    @property
    def ready(self) -> bool:
        return self.compile.done()

    def error(self) -> str | None:
        """Why the grammar cannot be used (its compile failed), or None."""
        exc = self.compile.exception() if self.compile.done() else None
        return None if exc is None else str(exc)

    def start(self, output_tokens: list[int]) -> None:
        """Make the matcher and catch it up with the output so far (a resumed or PD-continued
        request has some). Raises ValueError if that output breaks the grammar."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(self.compile.result())
        self.active = self.start_after is None
        if self.advance(output_tokens) is not None and not self.terminated:
            raise ValueError("the request's output so far does not follow its grammar")

    def advance(self, tokens: list[int]) -> int | None:
        """Feed accepted output tokens. Returns the index of the token that ended the grammar
        (`terminated` is then set) or that it rejected; None when all were taken."""
        for j, token in enumerate(tokens):
            if not self.active:
                self.active = token == self.start_after
                continue
            if not self.matcher.accept_token(token):
                return j
            if self.matcher.is_terminated():
                self.terminated = True
                return j
        return None

    def fill(self, bitmask: np.ndarray, row: int, drafts: list[int], num_rows: int) -> list[int]:
        """Write rows row .. row + num_rows − 1 of `bitmask` [N, W] for a step whose logits rows
        follow this request's output then its drafts (row j after j drafts). Returns the offsets
        (0 .. num_rows − 1) of the rows it constrains; rows before the grammar is active stay
        unconstrained (not written). The matcher is left as it was."""
        constrained, active, fed, blocked = [], self.active, 0, False
        for j in range(num_rows):
            if active:
                if blocked:  # past a draft the grammar rejects (or its end): unreachable, any mask will do
                    bitmask[row + j] = bitmask[row + j - 1]
                else:
                    self.matcher.fill_next_token_bitmask(bitmask, row + j)
                constrained.append(j)
            if j == num_rows - 1 or j >= len(drafts):
                break
            if not active:
                active = drafts[j] == self.start_after
            elif not blocked:
                if self.matcher.accept_token(drafts[j]):
                    fed += 1
                    blocked = self.matcher.is_terminated()
                else:
                    blocked = True
        if fed:
            self.matcher.rollback(fed)
        return constrained
