"""The version of trainmon (one place; ``trainmon.__version__`` and ``run.json`` read it)."""

__version__ = "0.1.0"
