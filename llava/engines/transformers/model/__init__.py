"""The model on its device: loading, the vision tower, forwards (packed or not), KV caches."""
