"""One request's output, folded from its stream of `TokenDelta`s and its `Finished`: the only
place where engine output becomes tokens, logprobs and text (the HTTP handlers, `ringserve
generate` and the offline `LLM` all fold through `ChoiceStream`).

Text comes from incremental detokenization, with stop strings matched across chunks: text is
emitted as soon as it cannot be the start of a stop string, so with stop strings the last
(longest stop − 1) characters are held back until more text arrives or the choice ends. A stop
string ends the choice; the text before it is the output (the stop string itself is not).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ipc.messages import Finished, PromptLogprobs, TokenDelta

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
    error: str | None = None  # why the engine failed or refused the request
    error_code: int = 0
    prompt: PromptLogprobs | None = None  # prompt scores, when the request asked for them
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied (from the Finished)
    stop_string: str | None = None  # the stop string that ended the choice (Anthropic's stop_sequence)


class ChoiceStream:
    def __init__(self, index: int, tokenizer: Tokenizer | None, stop: list[str] | None = None,
                 skip_special_tokens: bool = True):
        self.state = ChoiceState(index)
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens) if tokenizer is not None else None
        self.stop = stop or []
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.pending = ""  # decoded, not yet emitted
        self.stopped = False

    def feed(self, item: TokenDelta | Finished) -> str:
        """Fold one item of the request's stream; returns the text that can be emitted now."""
        if isinstance(item, Finished):
            self.state.completion_tokens = item.completion_tokens
            self.state.cached_tokens = item.cached_tokens
            self.state.error, self.state.error_code = item.error, item.error_code
            return self.finish(item.reason)
        if item.prompt is not None:
            self.state.prompt = item.prompt
        return self.push(item.token_ids, item.logprobs, item.top_logprobs)

    def push(self, token_ids: list[int], logprobs: list[float] | None, top: list | None) -> str:
        """Feed new tokens; returns the text that can be emitted now (may be empty)."""
        st = self.state
        st.token_ids.extend(token_ids)
        if logprobs is not None:
            st.logprobs.extend(logprobs)
            st.top_logprobs.extend(top or [[] for _ in token_ids])
        if self.stopped or self.detok is None:
            return ""
        self.pending += self.detok.push(token_ids)
        return self._release(final=False)

    def finish(self, reason: str | None) -> str:
        """The engine finished the choice: flush what is held back (still honouring stops)."""
        text = ""
        if not self.stopped and self.detok is not None:
            self.pending += self.detok.flush()
            text = self._release(final=True)
        if self.state.finish_reason is None:
            self.state.finish_reason = reason
        return text

    def _release(self, final: bool) -> str:
        hit = self._find_stop()
        if hit is not None:
            hit, self.state.stop_string = hit
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

    def _find_stop(self) -> tuple[int, str] | None:
        """(position in `pending`, string) of the earliest stop string (it may begin in held text);
        of two starting at one place, the first listed."""
        best = None
        for s in self.stop:
            i = self.pending.find(s)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        return best


async def collect(client, prompt_token_ids: list[int], params, tokenizer: Tokenizer | None, index: int = 0,
                  stop: list[str] | None = None, session: str | None = None, images: list | None = None
                  ) -> ChoiceState:
    """Run one request to its end through an engine client and return its folded state
    (`images`: its ipc ImageData, DeepSeek-V4.1)."""
    choice = ChoiceStream(index, tokenizer, stop)
    kw = {"images": images} if images else {}
    async for item in client.generate(prompt_token_ids, params, session=session, **kw):
        choice.feed(item)
        if choice.stopped:  # a stop string ended it; leaving the loop aborts the engine request
            break
    return choice.state
