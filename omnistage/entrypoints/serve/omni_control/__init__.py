"""The ``/v1/omni/*`` control plane: request/response models and route bodies (see README.md)."""

from omnistage.entrypoints.serve.omni_control.routes import router

__all__ = ["router"]
