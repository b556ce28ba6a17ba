"""Stand-in for SGLang (see tests/sglang_stand_in/README.md)."""

from sglang.engine import Engine

__version__ = "0.5.21"
__all__ = ["Engine"]
