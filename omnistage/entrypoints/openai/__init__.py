"""The OpenAI-compatible HTTP server: app assembly, data routes, metrics."""
