"""Fronts: adapters that put the service on a server (TorchServe) or in front of it (a runtime)."""
