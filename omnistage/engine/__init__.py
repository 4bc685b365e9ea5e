"""The engine client: AsyncOmni and the per-stage clients it drives."""
