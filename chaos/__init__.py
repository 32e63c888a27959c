"""Fault injection for elastictrain jobs and scenario checks of its invariants."""
