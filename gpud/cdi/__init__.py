"""The node's devices as a CDI spec for container runtimes: built from gpud's state, kept current."""
