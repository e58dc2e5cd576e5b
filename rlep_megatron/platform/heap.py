"""Python's cyclic garbage collector during a job's start-up.

A job imports torch, megatron-core, transformers and vLLM: about a million tracked objects, almost
none of them garbage. Each full collection walks all of them (about 0.6 s on a 2-core machine), and
start-up triggers a dozen: automatic ones while the heap grows during the imports, and the
explicit ``gc.collect()`` calls vLLM makes while it builds its engine. vLLM freezes its heap
once the engine exists (``gc.freeze``: frozen objects are never walked again); here the same is
done earlier:

* :func:`pause_gc_for_startup` (the CLI, first thing in a job): no automatic collection while
  the job imports and builds its models; reference counting still frees everything acyclic.
* :func:`freeze_startup_heap` (:class:`rlep_megatron.rollout.RolloutEngine`, before vLLM
  builds its engine): ``gc.freeze()`` without a collection first, and automatic collection back
  on if it was paused. vLLM's own collections then walk only what the engine creates. The
  imports leave little cyclic garbage (about 18,000 objects, 12.5 MiB by ``sys.getsizeof``,
  against a million live ones); it is frozen with the rest rather than found by a full
  collection, which costs about 0.5 s of every start-up (``python bench/startup_costs.py
  --only heap``).
* :func:`resume_gc` (the CLI, when the job returns or fails): automatic collection back on if a
  job ended before its engine was built.
"""
from __future__ import annotations

import gc

_paused = False


def pause_gc_for_startup() -> None:
    """Turn automatic cyclic collection off until :func:`freeze_startup_heap`."""
    global _paused
    if gc.isenabled():
        gc.disable()
        _paused = True


def freeze_startup_heap() -> None:
    """Freeze the heap as it is (no collection first: module doc) and resume automatic
    collection if :func:`pause_gc_for_startup` paused it. Safe to call more than once: a later
    call freezes the objects created since the previous one."""
    gc.freeze()
    resume_gc()


def resume_gc() -> None:
    """Automatic collection back on if :func:`pause_gc_for_startup` paused it and nothing has
    resumed it since."""
    global _paused
    if _paused:
        gc.enable()
        _paused = False

