"""Per-token, per-layer signals of a generated trace: hidden-state change, K/V statistics, attention scores."""
