"""cudampi's version, in a module of its own: the CLI, the doctor and the generated files read it
without importing the package's lazy API, and the build reads it from here (pyproject.toml)."""

__version__ = "0.1.0"
