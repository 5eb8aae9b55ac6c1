"""The package version, in a module of its own so that `kvcache --version` imports nothing else."""

__version__ = "0.3.0.dev0"
