"""The scripted fake NVML used by tests (see pynvml.py here for the scenario format)."""
