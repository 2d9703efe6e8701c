"""Grammar-constrained decoding (structured outputs) with xgrammar.

A request whose `SamplingParams.structured` names a grammar (a JSON Schema, any JSON object, a
regular expression, a choice of strings, EBNF, or an xgrammar structural tag) gets:

1. its grammar compiled against the model's vocabulary off the step loop (`GrammarCache`: one
   compile per distinct specification, on a thread of its own; the request waits in the
   scheduler, as vLLM's waits for its FSM, while other requests run);
2. a matcher (`RequestGrammar`) that follows its output tokens — from the start, or after the
   reasoning section's end token (`start_after`);
3. at every step in which it samples, one bitmask row per logits row (its 1 + d rows under
   speculation: row j is the grammar's state after its first j drafts), filled on the host and
   applied to the logits on their device before sampling (`apply_bitmask`: a few tensor ops,
   no host sync, CUDA-graph safe);
4. after the step, its accepted tokens fed to the matcher; a grammar that reaches its end
   finishes the request with `stop`.

EOS is in the bitmask only where the grammar may end. Drafts (MTP / DSpark) are not
constrained: a draft the grammar forbids has probability 0 under the masked target and is
rejected, so greedy output with speculation equals greedy output without.
"""

from .bitmask import apply_bitmask
from .compiler import GrammarCache, GrammarError
from .matcher import RequestGrammar

__all__ = ["GrammarCache", "GrammarError", "RequestGrammar", "apply_bitmask"]
