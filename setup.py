"""Builds the optional C extension of the lookup path (``consumers.serving.native``).

Everything else about the package is in ``pyproject.toml``. ``optional=True``: without a C
compiler (or Python headers) the install still succeeds and lookups use numpy
(:mod:`consumers.serving.lookup` logs that once).
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
        )
    ]
)
