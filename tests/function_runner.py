"""Entry point used by tests.torchrun.run_function: ``python -m tests.function_runner
module:function JSON``."""
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests import pause_gc_in_program  # noqa: E402

pause_gc_in_program(__name__)

if __name__ == "__main__":
    module_name, function_name = sys.argv[1].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    function(**json.loads(sys.argv[2]))
