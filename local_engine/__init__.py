"""The whole engine in one process: ``from local_engine import LocalEngine`` (local_engine/engine.py)."""

from local_engine.engine import LocalEngine

__all__ = ["LocalEngine"]
