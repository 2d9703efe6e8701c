"""The Anthropic Messages and OpenAI Responses APIs, as thin adapters over the one chat path.

Each API's request is translated into an OpenAI chat-completions body (`*_request.py`), which
takes the chat endpoint's own way: `protocol.parse_chat` → `handlers.prepare_chat` (render,
grammar, tokens, context) → `run.Generation` → one `ChatOutput` reading the model's text into
reasoning / content / tool-call events. The API's response is then built from those events
(`anthropic_api.py`, `responses_api.py`): streamed, each event becomes that API's SSE events; whole,
the same events are accumulated into the same blocks or items, so both forms always agree.
`common.py` holds what the two share: the run, error renaming and the reasoning-effort table.
"""
