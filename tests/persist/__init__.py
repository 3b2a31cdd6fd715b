"""Tests of the persistent tier: a package, so that its conftest.py does not shadow tests/'s."""
