"""Models built from mila_py components, and what generating from them needs."""
