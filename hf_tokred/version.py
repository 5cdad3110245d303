"""The package version (its own module so that the pure layer can record it without importing the package)."""

__version__ = "0.2.0"
