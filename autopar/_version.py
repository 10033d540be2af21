"""autopar's release number (a base module: it imports nothing)."""

__version__ = "0.1.0"
