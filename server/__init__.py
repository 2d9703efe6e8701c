"""OpenAI-compatible HTTP front end of ringserve (tokenizer, API handlers)."""
