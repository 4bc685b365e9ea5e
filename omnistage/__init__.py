"""omnistage."""
