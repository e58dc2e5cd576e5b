"""The test suite (tiers by pytest marker; see docs/development.md)."""
import gc
import importlib
import os


def requires(module: str):
    """The optional dependency ``module``: imported, or the calling test module skipped when it
    is missing -- except in CI (``CI`` set), where a missing dependency is an error."""
    import pytest

    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        return importlib.import_module(module)
    return pytest.importorskip(module)


def bench_module(name: str):
    """``bench/<name>.py`` imported as a module (the benches are scripts, not a package)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench",
                        f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pause_gc_in_program(name: str) -> None:
    """At the top of a test program, before its imports (``pause_gc_in_program(__name__)``): run
    as a program (``name`` is ``"__main__"``), its imports and its short run go without cyclic
    collections over that heap, as a job's start-up does (rlep_megatron/platform/heap.py; the
    package cannot be imported for this, it imports torch). Imported by a test module, nothing
    changes in the pytest process."""
    if name == "__main__":
        gc.disable()
