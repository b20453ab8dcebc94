# Metadata lives in pyproject.toml; this file keeps `pip install -e .` working
# with older tooling.
from setuptools import setup

setup()
