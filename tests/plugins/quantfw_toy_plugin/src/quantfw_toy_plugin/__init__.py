"""Example quantfw plugin (see docs/plugins.md)."""
