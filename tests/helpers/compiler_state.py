"""Dynamo's caches live for the process: a layer compiled by one test at some shapes makes
the next compile of the same code dynamic (automatic dynamic shapes), so a test would pass or
fail by which tests its process happened to run before it (pytest-xdist workers, the pooled
distributed workers)."""
import sys


def reset_compiler_state() -> None:
    """Leaves dynamo as a fresh process finds it, if anything was compiled (a reset costs ~10 ms)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None and dynamo.convert_frame.FRAME_COUNTER > 0:
        dynamo.reset()
