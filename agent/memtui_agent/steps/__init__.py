"""A step's life: where it opens and closes, whether its activations are measured or
carried, the health checks and forecasts judged at its close, and the frame built once from
the gathered inputs."""
