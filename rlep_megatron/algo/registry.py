"""Name -> class tables of the plug-ins a config key chooses (``algo.loss``, ``algo.advantage``)."""
from __future__ import annotations


class Registry(dict):
    """The classes ``key`` (a ``section.key`` config name) can choose, by name."""

    def __init__(self, key: str):
        super().__init__()
        self.key = key

    def register(self, name: str):
        """Class decorator: the class ``<key>=<name>`` builds (its ``name`` set)."""
        def add(cls):
            if name in self:
                raise ValueError(f"{self.key}={name!r} is already registered")
            cls.name = name
            self[name] = cls
            return cls
        return add

    def choose(self, name: str) -> type:
        """The class ``name`` names; a clear error listing the choices otherwise."""
        if name not in self:
            raise ValueError(f"{self.key} must be one of {', '.join(self)}, got {name!r}")
        return self[name]
