"""The test suite (tiers by pytest marker; see docs/development.md)."""
import importlib
import os


def requires(module: str):
    """The optional dependency ``module``: imported, or the calling test module skipped when it
    is missing -- except in CI (``CI`` set), where a missing dependency is an error."""
    import pytest

    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return importlib.import_module(module)
    return pytest.importorskip(module)
