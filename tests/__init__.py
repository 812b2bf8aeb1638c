"""The test suite. A package, so the runtime tests' helper modules import as ``tests.runtime.*``."""
