"""Model architectures behind one interface: `base.Architecture` (what an architecture provides),
`registry` (config.json → architecture). The built-in architectures are packages of their own:
DeepSeek-V4 in engine/v4/, DeepSeek-V4.1 in engine/v41/ (each `architecture.py`)."""
