"""STUB of vllm.logger: init_logger is logging.getLogger."""

import logging


def init_logger(name: str) -> logging.Logger:
    return logging.getLogger(name)
