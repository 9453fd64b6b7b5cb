"""The package version, in a module of its own so that ``tpusync.info`` reads it without
importing the package facade above it."""

__version__ = "0.1.0.dev0"
