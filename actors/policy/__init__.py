"""Pure scheduling: the rules of the Scheduler, as composed parts (see core.py)."""

from .core import Policy

__all__ = ["Policy"]
