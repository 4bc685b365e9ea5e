"""User-facing entry points: the Python APIs and the HTTP server."""
