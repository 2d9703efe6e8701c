"""Model architectures behind one interface: `base.Architecture` (what an architecture provides),
`registry` (config.json → architecture), and the built-in DeepSeek-V4 / V4.1 entries."""
