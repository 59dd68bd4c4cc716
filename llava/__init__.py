"""Serve LLaVA with stateful sessions on TorchServe and SageMaker sticky routing."""

__version__ = "0.1.0"
