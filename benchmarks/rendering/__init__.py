"""Rendering: the tables and figures of the README and the docs, from the suites' results files."""
