"""The TorchServe front: the handler TorchServe loads, and a launcher for a local TorchServe."""
