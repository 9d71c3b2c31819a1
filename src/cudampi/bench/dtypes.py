"""The dtypes the benchmarks take (``--dtype``), their aliases, sizes and nccl-tests' names.

The arrays themselves (patterns, expected values, the check) are each array library's
:class:`~cudampi.comm.arrays.Checks`.
"""

from __future__ import annotations

from cudampi.errors import ConfigError

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
"""dtypes the benchmarks take (``--dtype``)."""

DTYPE_ALIASES = {
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
    "double": "float64",
    "fp64": "float64",
}

NCCL_TYPENAME = {
    "float16": "half",
    "bfloat16": "bfloat16",
    "float32": "float",
    "float64": "double",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
}
"""The type column as nccl-tests prints it."""

ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}


def parse_dtype(text: str) -> str:
    """``float``, ``fp32`` or ``float32`` -> ``float32``; anything else is a ConfigError."""
    name = DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    if name not in DTYPES:
        raise ConfigError(
            f"--dtype {text!r} is not a dtype the benchmarks know; use one of {', '.join(DTYPES)}"
        )
    return name
