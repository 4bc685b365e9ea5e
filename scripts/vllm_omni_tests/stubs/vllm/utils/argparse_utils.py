"""STUB of vllm.utils.argparse_utils.FlexibleArgumentParser.

vllm_omni.utils.tracking_parser (used by the example clients) subclasses it. vLLM's parser is an
argparse.ArgumentParser that also accepts ``--flag_name`` for ``--flag-name`` and
``--flag=value``; that is what this one does. (vLLM's ``--config file.yaml`` expansion is not
used by the example clients and is not implemented.)
"""

from __future__ import annotations

import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args=None, namespace=None):
        if args is None:
            args = sys.argv[1:]
        normalized = []
        for arg in args:
            if arg.startswith("--") and len(arg) > 2:
                key, sep, value = arg.partition("=")
                normalized.append(key.replace("_", "-") + sep + value)
            else:
                normalized.append(arg)
        return super().parse_known_args(normalized, namespace)
