"""Build hook for the one optional native module (everything else is in pyproject.toml).

``tierstore.io._ringloop`` (``tierstore/io/_ringloop.c``) is the per-I/O turn of ``tierstore
bench``'s plain io_uring jobs in C. It is optional: where it cannot be compiled (no C compiler, no
Python headers) the install still succeeds and the jobs run the Python turn, saying so.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "tierstore.io._ringloop",
            ["tierstore/io/_ringloop.c"],
            optional=True,
            extra_compile_args=["-O2", "-Wall", "-Wextra", "-Werror=implicit-function-declaration"],
        )
    ]
)
