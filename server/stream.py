"""One choice's text stream: incremental detokenization plus stop strings matched across chunks.

Text is emitted as soon as it cannot be the start of a stop string: with stop strings, the last
(longest stop − 1) characters are held back until more text arrives or the choice ends. A stop
string ends the choice; the text before it is the output (the stop string itself is not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class ChoiceState:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""  # text emitted so far
    finish_reason: str | None = None
    completion_tokens: int = 0


class ChoiceStream:
    def __init__(self, index: int, tokenizer: Tokenizer, stop: list[str]):
        self.state = ChoiceState(index)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.pending = ""  # decoded, not yet emitted
        self.stopped = False

    def push(self, token_ids: list[int], logprobs: list[float] | None, top: list | None) -> str:
        """Feed new tokens; returns the text that can be emitted now (may be empty)."""
        st = self.state
        st.token_ids.extend(token_ids)
        if logprobs is not None:
            st.logprobs.extend(logprobs)
            st.top_logprobs.extend(top or [[] for _ in token_ids])
        if self.stopped:
            return ""
        self.pending += self.detok.push(token_ids)
        return self._release(final=False)

    def finish(self, reason: str | None) -> str:
        """The engine finished the choice: flush what is held back (still honouring stops)."""
        if not self.stopped:
            self.pending += self.detok.flush()
        text = self._release(final=True) if not self.stopped else ""
        if self.state.finish_reason is None:
            self.state.finish_reason = reason
        return text

    def _release(self, final: bool) -> str:
        hit = self._find_stop()
        if hit is not None:
            out, self.pending = self.pending[:hit], ""
            self.stopped = True
            self.state.finish_reason = "stop"
        elif final or not self.stop:
            out, self.pending = self.pending, ""
        else:
            cut = max(0, len(self.pending) - self.hold)
            out, self.pending = self.pending[:cut], self.pending[cut:]
        self.state.text += out
        return out

    def _find_stop(self) -> int | None:
        """Position in `pending` where the earliest stop string starts (it may begin in held text)."""
        best = None
        for s in self.stop:
            i = self.pending.find(s)
            if i != -1 and (best is None or i < best):
                best = i
        return best
