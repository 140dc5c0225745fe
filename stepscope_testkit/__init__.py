"""What the tests and the benchmarks both need: running the exporter, Prometheus's and the Pushgateway's
processes, push bodies, profile-trace helpers, and the scripted fakes of NVML and CUDA.

A repository package beside tests/ and benchmarks/ (not shipped in the wheel), so a benchmark never
imports the test suite and the test suite never imports a benchmark.
"""
