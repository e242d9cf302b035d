"""The help format every `evolm` command shares: the description as written (it opens with commands
to copy and run), and each option's default stated after its help."""
from __future__ import annotations

import argparse


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's lines and indentation; appends ``(default: X)`` to an option's help
    unless its help already says what the default is, or it has none (None, an off switch)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or any(action.default is nothing for nothing in (None, False, argparse.SUPPRESS)):
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            text += " (default: %(default)s)"
        return text

