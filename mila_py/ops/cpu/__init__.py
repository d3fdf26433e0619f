"""NumPy ops (the readable references)."""
