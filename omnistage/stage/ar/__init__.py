"""The autoregressive (AR) stage: continuous batching over a paged KV cache in the arena."""
