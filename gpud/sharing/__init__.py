"""GPU sharing: the k8s-device-plugin sharing config (config.py), and the resources, replica IDs and
GPU feature discovery labels a device plugin would advertise from it on this node (resources.py)."""
