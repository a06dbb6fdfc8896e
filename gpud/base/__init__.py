"""Base utilities: logging, durable files, strict YAML, the host's processes, systemd, the error type,
metric samples and the components' lifecycle. They know nothing of GPUs and import nothing of gpud
outside this package (tests/test_architecture.py, "layers")."""
