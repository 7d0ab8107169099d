// Builds Prometheus and promtool, which Ferrite's monitoring tests run against the chart's
// alert rules and dashboards. Nothing here is imported by Ferrite.
module ferrite.dev/testcluster/prometheus

go 1.26.7

require github.com/prometheus/prometheus v0.316.0 // indirect
