"""A dict that counts how often it is walked: tests that stats never scan a large index."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class CountingDict(dict[Any, Any]):
    """A dict that counts walks (iteration) and single-key touches."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.walks = 0
        self.touches = 0

    def __iter__(self) -> Iterator[Any]:
        self.walks += 1
        return super().__iter__()

    def items(self) -> Any:
        self.walks += 1
        return super().items()

    def keys(self) -> Any:
        self.walks += 1
        return super().keys()

    def values(self) -> Any:
        self.walks += 1
        return super().values()

    def get(self, key: Any, default: Any = None) -> Any:
        self.touches += 1
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.touches += 1
        return super().__getitem__(key)

    def __delitem__(self, key: Any) -> None:
        self.touches += 1
        super().__delitem__(key)
