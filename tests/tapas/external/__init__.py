"""Transformer implementations from outside this repository, vendored for planning tests."""
