"""`ringserve bench`: a streaming benchmark client for any OpenAI-compatible server.

Modules: `records` (request specs and timings), `client` (one streamed request), `server_api`
(/tokenize, /detokenize, Prometheus scraping), `textgen` (prompt text without a tokenizer),
`workloads` (fixed), `agentx` (synthetic agentic sessions), `trace` (JSONL replay format),
`weka` (AIPerf's AgentX trace format), `conversation` (the agentx request shape: growing chat
histories), `runner` (arrivals, concurrency, session trees), `metrics` (the arithmetic), `report`
(result document and table), `sweep`, `plot`, `cli`.
"""
