"""stepscope Grafana bundle: dashboards and alert provisioning generated from code and the rules file."""
