"""The version /version answers (and pyproject.toml's)."""

__version__ = "0.1.0"
