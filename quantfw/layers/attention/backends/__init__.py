"""Attention backends: each computes cache-aware attention for one layer from the step's
`AttentionMetadata` (see `base.AttentionBackend`)."""
