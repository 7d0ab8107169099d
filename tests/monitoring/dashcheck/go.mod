// Checks the chart's Grafana dashboards against Grafana's dashboard schema, as the
// grafana-foundation-sdk types it (tests/chart/test_monitoring.py runs it). Nothing here is
// imported by Ferrite.
module ferrite.dev/tests/dashcheck

go 1.26.7

require github.com/grafana/grafana-foundation-sdk/go v0.0.22
