"""The package version (its own module so that the pure layer can record it without importing the package)."""

__version__ = "0.4.0"  # 0.4.0: long prompts (keep_tokens, prefilter, the question split, match_window)
