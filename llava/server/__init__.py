"""The service: the step loop over the engine contract, admission, opening, in-flight work."""
