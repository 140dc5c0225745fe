"""The exporter's metric contract (README "What it publishes" plus the pushed training families).

Dashboards and alerts may only reference these names or recording rules (tests/test_dashboards.py),
and tests/test_bundle_e2e.py checks that a real scrape holds exactly these names: a renamed metric in
the exporter then fails the tests instead of leaving an empty panel.
"""

HISTOGRAMS = ("stepscope_step_phase_seconds", "stepscope_step_seconds")

EXPORTER_METRICS = frozenset(
    {
        # node
        "stepscope_node_info",
        "stepscope_node_cpu_seconds_total",
        "stepscope_node_cpus",
        "stepscope_node_memory_total_bytes",
        "stepscope_node_memory_available_bytes",
        "stepscope_node_disk_read_bytes_total",
        "stepscope_node_disk_written_bytes_total",
        "stepscope_node_disk_reads_completed_total",
        "stepscope_node_disk_writes_completed_total",
        "stepscope_node_disk_io_time_seconds_total",
        "stepscope_node_network_receive_bytes_total",
        "stepscope_node_network_transmit_bytes_total",
        "stepscope_node_filesystem_size_bytes",
        "stepscope_node_filesystem_avail_bytes",
        # GPU
        "stepscope_gpu_collector_up",
        "stepscope_gpu_up",
        "stepscope_gpu_info",
        "stepscope_gpu_utilization_ratio",
        "stepscope_gpu_memory_utilization_ratio",
        "stepscope_gpu_memory_used_bytes",
        "stepscope_gpu_memory_free_bytes",
        "stepscope_gpu_memory_total_bytes",
        "stepscope_gpu_temperature_celsius",
        "stepscope_gpu_power_watts",
        "stepscope_gpu_power_limit_watts",
        "stepscope_gpu_energy_joules_total",
        "stepscope_gpu_sm_clock_hertz",
        "stepscope_gpu_memory_clock_hertz",
        "stepscope_gpu_clock_event_active",
        "stepscope_gpu_clock_event_seconds_total",
        "stepscope_gpu_pcie_receive_bytes_per_second",
        "stepscope_gpu_pcie_transmit_bytes_per_second",
        "stepscope_gpu_ecc_errors_total",
        "stepscope_gpu_xid_errors_total",
        "stepscope_gpu_xid_last_seen_timestamp_seconds",
        "stepscope_gpu_sm_active_ratio",
        "stepscope_gpu_sm_occupancy_ratio",
        "stepscope_gpu_tensor_active_ratio",
        "stepscope_gpu_dram_active_ratio",
        "stepscope_gpu_nvlink_receive_bytes_per_second",
        "stepscope_gpu_nvlink_transmit_bytes_per_second",
        "stepscope_gpu_c2c_receive_bytes_per_second",
        "stepscope_gpu_c2c_transmit_bytes_per_second",
        # processes
        "stepscope_process_cpu_seconds_total",
        "stepscope_process_resident_memory_bytes",
        "stepscope_process_io_read_bytes_total",
        "stepscope_process_io_write_bytes_total",
        "stepscope_process_children",
        "stepscope_process_gpu_memory_bytes",
        # training (pushed by training_hooks, published by the exporter)
        *(f"{name}{suffix}" for name in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")),
        "stepscope_steps_total",
        "stepscope_samples_total",
        "stepscope_training_info",
        "stepscope_training_state",
        "stepscope_training_last_push_timestamp_seconds",
        "stepscope_loader_limit_samples_per_second",
        "stepscope_compute_limit_samples_per_second",
        "stepscope_profile_trace_bytes",
        "stepscope_profile_trace_steps",
        "stepscope_profile_trace_timestamp_seconds",
        # exporter self
        "stepscope_exporter_collector_duration_seconds",
        "stepscope_exporter_collector_errors_total",
        "stepscope_exporter_collector_last_success_timestamp_seconds",
        "stepscope_exporter_ingest_accepted_total",
        "stepscope_exporter_ingest_rejected_total",
        "stepscope_exporter_ingest_groups",
        "stepscope_exporter_build_info",
    }
)
