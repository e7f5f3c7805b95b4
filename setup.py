"""Builds the optional C extensions: the serving lookup path (``consumers.serving.native``),
the HashTable index's CPU probes (``deltastream.embedding.native``), the FIRST-row
bookkeeping of tracked tables (``deltastream.tracking.native``) and the budget worker's
serving errors (``deltastream.publishing.native``).

Everything else about the package is in ``pyproject.toml``. ``optional=True``: without a C
compiler (or Python headers) the install still succeeds and their callers run numpy or torch
(:mod:`deltastream.native_ext` logs that once per extension).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "consumers.serving.native",
            ["consumers/serving/native.c", "consumers/serving/native_loops.c",
             "consumers/serving/native_warm.c"],
            depends=["consumers/serving/native_loops.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ] + [
        # sharing the buffer and row helpers of deltastream/native_*.h
        Extension(f"deltastream.{room}.native", [f"deltastream/{room}/{name}" for name in files],
                  depends=["deltastream/native_buffers.h", "deltastream/native_rows.h",
                           "deltastream/native_lane.h", "deltastream/tracking/native_tracking.h"],
                  extra_compile_args=["-O3"], optional=True)
        for room, files in (("embedding", ["native.c"]), ("publishing", ["native.c"]),
                            ("tracking", ["native.c", "native_owed.c", "native_later.c",
                                          "native_sorted.c"]))
    ]
)
