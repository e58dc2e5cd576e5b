"""The rollout-engine contract (rlep_megatron/rollout/contract.py): every backend implements every
member with the contract's parameters, and no caller probes an engine or a request driver for
members of one backend."""
import ast
import inspect
import os

import pytest

import rlep_megatron
from rlep_megatron.rollout import contract
from tests.unit.test_imports import package_trees

pytestmark = pytest.mark.unit


def members(protocol) -> dict[str, object]:
    """The protocol's methods, properties and annotated attributes."""
    names = {n: v for n, v in vars(protocol).items()
             if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    names.update(dict.fromkeys(getattr(protocol, "__annotations__", {})))
    return names


def parameters(function) -> list[str]:
    return [p.name for p in inspect.signature(function).parameters.values()
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]


def backends():
    from rlep_megatron.rollout.colocated.engine import RolloutEngine
    from rlep_megatron.rollout.colocated.requests import EngineRequests
    from rlep_megatron.rollout.megatron.engine import MegatronEngine
    from rlep_megatron.rollout.megatron.requests import MegatronRequests
    from rlep_megatron.rollout.servers.engine import ServerEngine
    from rlep_megatron.rollout.servers.requests import ServerRequests

    return {contract.InferenceEngine: [RolloutEngine, ServerEngine, MegatronEngine],
            contract.RequestDriver: [EngineRequests, ServerRequests, MegatronRequests]}


@pytest.mark.parametrize("protocol", ["InferenceEngine", "RequestDriver"])
def test_every_backend_implements_every_member(protocol):
    protocol = getattr(contract, protocol)
    for backend in backends()[protocol]:
        init = inspect.getsource(backend.__init__)
        for name, spec in members(protocol).items():
            if spec is None:  # an attribute: on the class, or set in __init__
                assert hasattr(backend, name) or f"self.{name} =" in init, (backend, name)
                continue
            ours = getattr(backend, name, None)
            assert ours is not None, f"{backend.__name__} lacks {name}"
            if isinstance(spec, property):
                assert isinstance(ours, property), (backend, name)
                continue
            # the contract's parameters, in order (a backend may add keyword-only ones)
            want = parameters(spec)
            assert parameters(ours)[:len(want)] == want, (backend.__name__, name)


def test_no_caller_probes_an_engine_or_a_request_driver():
    """No ``hasattr``/``getattr`` on an engine or a request driver anywhere in the package: a
    member one backend lacks belongs in the contract, as a no-op where it does nothing."""
    root = os.path.dirname(rlep_megatron.__file__)
    probes = []
    for rel, tree in package_trees(root):
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and node.args):
                target = ast.unparse(node.args[0]).lower()
                if "engine" in target or "requests" in target:
                    probes.append(f"{rel}:{node.lineno} "
                                  f"{ast.unparse(node)}")
    assert probes == [], probes


def test_the_probe_finder_sees_a_probe(tmp_path, monkeypatch):
    """The check above, on a package with one probe, finds it."""
    package = tmp_path / "rlep_megatron"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "loop.py").write_text("def f(engine):\n"
                                     "    return hasattr(engine, 'plan_weights')\n")
    monkeypatch.setattr(rlep_megatron, "__file__", str(package / "__init__.py"))
    with pytest.raises(AssertionError, match="loop.py:2"):
        test_no_caller_probes_an_engine_or_a_request_driver()
