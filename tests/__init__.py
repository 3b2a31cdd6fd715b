"""The test suite: a package, so that ``tests._support`` (the shared helpers) is imported by one
name from the tests, their conftest files and mypy alike."""
