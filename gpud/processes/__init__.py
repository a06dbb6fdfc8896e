"""Who uses the GPUs: each compute process, its GPU memory and SM use, and the container or systemd
unit it belongs to."""
