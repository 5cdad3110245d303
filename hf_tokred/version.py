"""The package version (its own module so that the pure layer can record it without importing the package)."""

__version__ = "0.3.0"  # 0.3.0: front_prune is the default method
