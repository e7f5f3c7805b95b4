"""Builds the optional C extensions: the serving lookup path (``consumers.serving.native``)
and the FIRST-row bookkeeping of TorchRec shards (``deltastream.tracking.native``).

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
            "deltastream.tracking.native",
            ["deltastream/tracking/native.c"],
            extra_compile_args=["-O3"],
            optional=True,
        ),
    ]
)
