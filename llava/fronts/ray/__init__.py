"""The Ray Serve front: one replica process per GPU, sessions pinned by a session-affinity router.

- `replica`: a Ray Serve deployment holding one assembled instance (engine, sessions, service)
  and its step loop; it answers raw requests exactly as the TorchServe worker does.
- `router`: the request router that sends a session's requests to the replica that holds it
  (the session id says which) and opens new sessions on the least loaded replica (by bytes).
- `ingress`: the HTTP routes (`/ping`, `/invocations`, `/predictions/<model>`, `/v1/...`).
- `app`: the application builder a Serve config points at, and `python -m llava serve-ray`.
Nothing below this package imports Ray.
"""
