"""A small bounded map of recent answers (least recently used goes first)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any


class Recent:
    def __init__(self, size: int):
        self.size = size
        self._d: OrderedDict = OrderedDict()

    def get(self, key) -> Any:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def put(self, key, value) -> None:
        if value is None:
            return
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.size:
            self._d.popitem(last=False)
