"""The lab's command-line parser: argparse, except that a bad argument is one line, not a usage
block and an exit from inside the parser.

`python -m labkit` (labkit.cli) and `python -m labkit.gpu_check` both promise one line on stderr
and exit code 2 for bad input, with no traceback; argparse would print its usage and call
sys.exit(2) itself. Standard library only: the GPU check imports this on a GPU image with no
Jupyter packages, and the CLI's `predict` answers without loading torch.
"""
from __future__ import annotations

import argparse


class UsageError(Exception):
    """argparse's complaint, or a command's own about its arguments, shown as one line."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser that raises UsageError instead of printing its usage and exiting."""

    def error(self, message):
        raise UsageError(message)
