# What DeepEP V1 reports at the commit whose API this package implements: its setup.py appends
# `git rev-parse --short HEAD`, so a DeepEP built from a clone at 567632d is "1.2.1+567632d".
# setup.py reads this file for the deep_ep metadata the wheel installs (importlib.metadata.version).
__version__ = "1.2.1+567632d"
