"""Entry point used by tests.torchrun.run_function: ``function_runner.py module:function JSON``."""
import gc

gc.disable()  # a program: its imports and its short run without cyclic collections over that
# heap (rlep_megatron/platform/heap.py)
import importlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    module_name, function_name = sys.argv[1].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    function(**json.loads(sys.argv[2]))
