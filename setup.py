"""Builds the optional C extensions: the serving lookup path (``consumers.serving.native``),
the HashTable index's CPU probes (``deltastream.embedding.native``), the FIRST-row
bookkeeping of tracked tables (``deltastream.tracking.native``) and the budget worker's
serving errors (``deltastream.publishing.native``).

Everything else about the package is in ``pyproject.toml``. ``optional=True``: without a C
compiler (or Python headers) the install still succeeds and both use numpy
(:mod:`consumers.serving.accel` and :mod:`deltastream.tracking.fresh_rows` log that once).
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
        Extension(
            "deltastream.embedding.native",
            ["deltastream/embedding/native.c"],
            depends=["deltastream/native_buffers.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "deltastream.publishing.native",
            ["deltastream/publishing/native.c"],
            depends=["deltastream/native_buffers.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
        Extension(
            "deltastream.tracking.native",
            ["deltastream/tracking/native.c"],
            depends=["deltastream/native_buffers.h"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
