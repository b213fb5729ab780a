"""Install asyncpipe: ``pip install -e .`` (metadata lives in pyproject.toml)."""

from setuptools import setup

setup()
