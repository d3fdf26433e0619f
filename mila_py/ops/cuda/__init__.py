"""CuPy ops; each module imports CuPy lazily."""
