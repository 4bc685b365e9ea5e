"""Benchmarks (never collected by pytest). Each writes JSON and prints a table."""
