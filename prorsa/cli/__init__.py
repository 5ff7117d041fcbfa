"""Command-line interface (``prorsa``). Only this package prints."""
